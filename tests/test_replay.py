"""Gradient replay (``leto.integrity.replay``) without processes: the digest, the capture at
the model's boundary, a recomputation bit-identical to the original micro-batch and
leaving this rank's state alone, a wrong activation found, and the naming rule.

The multi-process path — faultkit's ``sdc-grad`` / ``sdc-activation`` found, named and
redone in place under ``leto run`` — is ``tests/test_faultkit_inject.py::test_sdc_*``;
the CI gate's matrix runs both modes too."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.integrity import replay
from leto.integrity.replay import GradReplay, digest, grads_digest, judge


@pytest.fixture(autouse=True)
def deterministic():
    """Replay's premise (a script under Leto sets it, as the examples do)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


class Tiny(torch.nn.Module):
    """nanoGPT's shape of output: (logits, loss), the loss computed inside from the
    logits; dropout, so the generators matter."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(17, 8)
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 17)
        self.drop = torch.nn.Dropout(0.2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, y):
        self.calls += 1  # a buffer the forward changes: the replay must put it back
        h = self.drop(torch.relu(self.fc(self.emb(x))))
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 17), y.view(-1))
        return logits, loss


def _retained(model: torch.nn.Module, device: str):
    """The model's gradients as views of one flat zeroed buffer (as Leto retains them)."""
    params = dict(model.named_parameters())
    n = sum(p.numel() for p in params.values())
    flat = torch.zeros(n + 5, device=device)  # 5 elements of padding at the end
    at = 0
    for p in params.values():
        p.grad = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    return params, flat


def _setup(device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    model = Tiny().to(device)
    params, flat = _retained(model, device)
    rp = GradReplay(model, params, flat, rank=0, world=2, k=3, group=object())
    x = torch.randint(0, 17, (4, 6), device=device)
    y = torch.randint(0, 17, (4, 6), device=device)
    return model, rp, flat, x, y


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(0, 999))
def test_every_single_flipped_bit_changes_the_digest(dtype, pos):
    t = torch.randn(125, dtype=torch.float32).to(dtype)
    words = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    before = int(digest(t))
    i, bit = divmod(pos, 8 * t.element_size())
    words[i % t.numel()] ^= (1 << bit) if bit < 8 * t.element_size() - 1 else -(1 << bit)
    assert int(digest(t)) != before


def test_gradients_digest_as_they_land_in_a_zeroed_buffer():
    # A -0.0 gradient lands as +0.0 in the buffer (0 + -0 = +0): grads_digest must say so.
    g = torch.tensor([-0.0, 1.5, -2.0])
    buf = torch.zeros(3)
    buf.add_(g)
    assert int(digest(buf)) == grads_digest([g]) != int(digest(g))


@pytest.mark.parametrize("k", [1, 2])
def test_a_replay_is_bit_identical_to_the_micro_batch_and_leaves_state_alone(k):
    model, rp, flat, x, y = _setup()
    rp.begin(3)  # due: 3 % k == 0
    torch.manual_seed(11)
    for _ in range(k):  # micro-batch 0, then (k = 2) one more that adds to the buffer
        logits, loss = model(x, y)
        (loss / k * 3.0).backward()  # the script's own scaling: the output's seed
    rp.whole()  # (k = 1: what the unbucketed all-reduce's seam does)
    cap = rp._payload()
    assert cap is not None and cap["seeds"] and list(cap["seeds"]) == [1]  # the loss only
    grads_before, rng, calls = flat.clone(), torch.get_rng_state(), model.calls.clone()
    again = rp._compute(cap)
    assert again == cap["digest"]
    # Nothing of this rank changed: its gradients, its generator, the model's buffer.
    assert torch.equal(flat, grads_before) and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.calls, calls)
    if k == 1:  # the digest is of the whole first micro-batch's gradient
        assert cap["digest"] == int(digest(flat))


def test_a_wrong_activation_in_the_original_is_found():
    model, rp, flat, x, y = _setup()
    rp.begin(0)
    handle = None

    def flip(_m, _a, out):  # faultkit's sdc-activation, in the original forward only
        handle.remove()
        with torch.no_grad():
            out.view(torch.int32).view(-1)[5] ^= 1 << 22

    handle = model.fc.register_forward_hook(flip)
    _, loss = model(x, y)
    loss.backward()
    rp.whole()
    cap = rp._payload()
    assert rp._compute(cap) != cap["digest"]


def test_no_replay_when_not_due_or_not_deterministic():
    model, rp, flat, x, y = _setup()
    rp.begin(1)  # k = 3: not due
    model(x, y)[1].backward()
    rp.whole()
    assert rp._payload() is None
    rp.begin(0)
    model(x, y)[1].backward()
    rp.whole()
    torch.use_deterministic_algorithms(False)
    assert rp._payload() is None  # a recomputation need not be bit-exact: skipped


def test_a_skipped_replay_is_not_counted_and_the_reason_is_kept(monkeypatch):
    model, rp, flat, x, y = _setup()
    monkeypatch.setattr(rp, "_exchange", lambda obj, dst, src: obj)  # its own, as a peer's
    monkeypatch.setattr(rp, "_gather", lambda *words: [list(words), list(words)])
    rp.begin(0)
    model(x, y)[1].backward()
    rp.whole()
    torch.use_deterministic_algorithms(False)
    rp.verify(0)
    torch.use_deterministic_algorithms(True)
    assert rp.replays == 0, "a replay that did not run was counted"
    assert "use_deterministic_algorithms(True) is off" in (rp.skipped or ""), rp.skipped


def test_an_output_of_another_type_is_not_replayed_and_is_said(capsys):
    class Out:
        def __init__(self, loss):
            self.loss = loss

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return Out((self.w * x).sum())

    m = Odd()
    params, flat = _retained(m, "cpu")
    rp = GradReplay(m, params, flat, rank=0, world=2, k=1, group=object())
    rp.begin(0)
    m(torch.ones(3)).loss.backward()
    rp.whole()
    assert rp._payload() is None
    assert "Out, not tensors" in capsys.readouterr().err


def test_the_third_computation_names_the_rank_that_computed_wrong():
    # rows[r] = (status, own digest, replay of r-1); rank 1 replayed rank 0's micro-batch.
    rows = [[1, 10, 30], [2, 20, 99], [1, 30, 20]]
    # World 3: rank 2 computes rank 0's micro-batch a third time.
    assert judge(0, rows, [[0], [0], [99]], 3)["named"] == 0  # agrees with the replay
    assert judge(0, rows, [[0], [0], [10]], 3)["named"] == 1  # agrees with the original
    assert judge(0, rows, [[0], [0], [55]], 3)["named"] is None  # with neither
    # World 2: the original rank recomputes its own.
    rows2 = [[1, 10, 20], [2, 20, 99]]
    v = judge(0, rows2, [[99], [0]], 2)
    assert v["checker"] == 0 and v["named"] == 0


def test_replay_is_on_by_default_and_leto_run_turns_it_off(monkeypatch):
    from leto.job.config import REPLAY_EVERY_DEFAULT

    monkeypatch.delenv(replay.ENV_REPLAY_EVERY, raising=False)
    assert replay.every() == REPLAY_EVERY_DEFAULT > 0
    monkeypatch.setenv(replay.ENV_REPLAY_EVERY, "0")
    assert replay.every() == 0


@pytest.mark.gpu
def test_a_replay_is_bit_identical_on_cuda_under_bf16_autocast():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, rp, flat, x, y = _setup("cuda")
    rp.begin(0)
    torch.manual_seed(5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    rp.whole()
    cap = rp._payload()
    grads_before = flat.clone()
    assert rp._compute(cap) == cap["digest"]
    assert torch.equal(flat, grads_before)


def test_leto_run_refuses_a_negative_replay_interval():
    from leto.job.config import RunConfig

    with pytest.raises(ValueError, match=r"--replay-every -1: expected >= 0 \(0: off\)"):
        RunConfig(replay_every=-1)
    assert RunConfig(replay_every=0).replay_every == 0


class _WithUnused(Tiny):
    def __init__(self):
        super().__init__()
        self.spare = torch.nn.Linear(8, 8)  # a parameter no forward reaches


def test_gradients_landing_by_copy_digest_a_parameter_the_micro_batch_missed_as_zero():
    # leto.trainer.grad_landing: the buffer is not zeroed, so a parameter no backward
    # reached holds the last iteration's gradient until finish() zeroes its view; the
    # whole buffer's digest after the first micro-batch must see the zero the
    # recomputation assumes (else a false alarm).
    from types import SimpleNamespace

    from leto.trainer.grad_landing import GradLanding
    from leto.update.layout import ParamSlot

    torch.manual_seed(0)
    model = _WithUnused()
    params = dict(model.named_parameters())
    slots, at = [], 0
    for name, p in params.items():
        slots.append(ParamSlot(name, p.shape, at, p.numel()))
        at += p.numel()
    flat = torch.full((at + 5,), 7.0)  # the last iteration's gradients, and padding
    landing = GradLanding(params, SimpleNamespace(grad=flat, slots=slots))
    rp = GradReplay(model, params, flat, rank=0, world=2, k=3, group=object())
    rp.before_whole = landing.finish
    x = torch.randint(0, 17, (4, 6))
    y = torch.randint(0, 17, (4, 6))
    landing.release()  # the script's zero_grad(set_to_none=True)
    rp.begin(3)
    for _ in range(2):  # the second micro-batch's forward digests the first's gradient
        logits, loss = model(x, y)
        loss.backward()
    cap = rp._payload()
    assert cap is not None
    assert rp._compute(cap) == cap["digest"]
