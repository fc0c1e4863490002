"""Gradient parity taken in ``clip_grad_norm_``'s pass (``leto.update.grad_clip``).

* The clip under Leto leaves torch's bytes in every gradient (the retained ones, and
  others beside them), at any coefficient (clipped, 1.0, NaN), foreach or not; the parity
  it took is the codec's encode of the clipped gradients; the step then encodes nothing.
* A write after the clip that autograd sees (a GradScaler's, a second multiply) makes the
  step encode them again; one it does not see (``.data``) is found by the audit, which
  turns the pass off and says so; the parity the step keeps is right either way.
* On the CPU twin, and (gpu marker) the CUDA kernel.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from leto.erasure.codec import ReedSolomon
from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager
from leto.update import grad_clip
from tests import rmu_harness as h
from tests import test_user_optim as u
from tests.pool_helpers import small_config

DIMS = (60, 1031, 37)


def _config(device: str):
    if device == "cuda":
        return PoolConfig.for_cuda(0, data_pages=12, tier1_pages=4)
    return small_config(data_pages=12, tier1_pages=3)


@pytest.fixture
def installed():
    yield
    grad_clip.install(None)


def _trainer(sm, device: str):
    tr = u.Trainer(sm, "adamw-fused", dims=(1024, 2400, 7) if device == "cuda" else DIMS)
    assert tr.up.clip_parity_reason is None, tr.up.clip_parity_reason
    tr.up.clip_parity = grad_clip.ClipParity(tr.up)  # (as the trainer makes it: one rank)
    return tr


def _grads(tr) -> list[torch.Tensor]:
    return [p.grad for p in tr.model.parameters() if p.grad is not None]


def _encode(tr) -> list[list[torch.Tensor]]:
    """The codec's tier-1 parity of every gradient group, as the gradients now are."""
    out = []
    for g in tr.up.grad_groups:
        code = tr.up.code(g).tier1
        pages = tr.up._pages(("grad", g.gid), g.data_pages or g.data)
        out.append(list(code.encode(pages)))
    return out


def _step(tr, counting):
    """The iteration's step after the clip, the encodes counted from its start."""
    counting.clear()
    tr.step()


def _grad_lists(tr) -> set[int]:
    """The gradient groups' page lists, as the step's tier-1 encode gets them."""
    return {id(tr.up._pages(("grad", g.gid), g.data_pages or g.data)) for g in tr.up.grad_groups}


@contextlib.contextmanager
def _clipped():
    """A CPU trainer whose iteration's gradients are in and clipped at 0.5 under Leto."""
    sm = start_state_manager(_config("cpu"))
    try:
        tr = _trainer(sm, "cpu")
        grad_clip.install(tr.up.clip_parity)
        tr.up.begin(tr.t)
        h.grads_for(tr.model, tr.t)
        torch.nn.utils.clip_grad_norm_(list(tr.model.parameters()), 0.5)
        yield tr, tr.up.clip_parity
        tr.client.close()
    finally:
        sm.stop()


@pytest.fixture
def counting(monkeypatch):
    """The codec's encodes, by the identity of the pages they got."""
    calls: list = []
    real = ReedSolomon.encode

    def encode(self, data, *, out=None, group=None):
        calls.append(id(data))
        return real(self, data, out=out, group=group)

    monkeypatch.setattr(ReedSolomon, "encode", encode)
    return calls


def _clip_case(device: str, counting, monkeypatch) -> None:
    monkeypatch.setattr(grad_clip, "AUDIT_FIRST", 1)
    sm = start_state_manager(_config(device))
    try:
        tr = _trainer(sm, device)
        cp = tr.up.clip_parity
        grad_clip.install(cp)
        grad_ids = _grad_lists(tr)
        outside = torch.nn.Parameter(torch.zeros(37, device=device))
        for k, (max_norm, foreach) in enumerate([(0.5, True), (1e9, False), (0.5, None)]):
            tr.up.begin(tr.t)
            h.grads_for(tr.model, tr.t)
            outside.grad = torch.randn(37, device=device)
            params = [*tr.model.parameters(), outside]
            want = [g.clone() for g in _grads(tr)] + [outside.grad.clone()]
            norm = torch.nn.utils.get_total_norm(want, 2.0, False, foreach)
            grad_clip._torch_clip([type("P", (), {"grad": g})() for g in want], max_norm, norm, foreach)
            got = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)
            assert torch.equal(got, norm)
            for a, b in zip(_grads(tr) + [outside.grad], want, strict=True):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "torch's bytes"
            fresh = _encode(tr)
            for gi in range(len(tr.up.grad_groups)):
                for r, page in enumerate(fresh[gi]):
                    assert torch.equal(cp.bufs[gi][r], page), f"group {gi} row {r}"
            _step(tr, counting)
            encoded = {i for i in counting if i in grad_ids}
            # The first use is audited (a fresh encode beside it); then none is encoded.
            assert encoded == (grad_ids if k == 0 else set()), k
        assert cp.taken == 3 and cp.used == 3 and cp.off is None
        assert "in clip_grad_norm_'s pass" in tr.up.grad_parity_path
        tr.client.close()
    finally:
        sm.stop()


def test_the_clip_leaves_torchs_bytes_and_takes_the_parity_the_step_then_uses(counting, monkeypatch, installed):
    _clip_case("cpu", counting, monkeypatch)


@pytest.mark.gpu
def test_on_the_gpu_the_clip_leaves_torchs_bytes_and_takes_the_parity_the_step_then_uses(
    counting, monkeypatch, installed
):
    _clip_case("cuda", counting, monkeypatch)


def _edge_case(device: str) -> None:
    """Coefficients at the edges: NaN gradients (a NaN norm), a zero norm, denormals."""
    sm = start_state_manager(_config(device))
    try:
        tr = _trainer(sm, device)
        grad_clip.install(tr.up.clip_parity)
        for fill in ("nan", "zero", "denormal"):
            tr.up.begin(tr.t)
            h.grads_for(tr.model, tr.t)
            g0 = _grads(tr)[0]
            if fill == "nan":
                g0.view(-1)[3] = float("nan")
            elif fill == "zero":
                for g in _grads(tr):
                    g.zero_()
            else:
                g0.view(-1)[:5] = 1e-41
            want = [g.clone() for g in _grads(tr)]
            norm = torch.nn.utils.get_total_norm(want, 2.0, False, True)
            grad_clip._torch_clip([type("P", (), {"grad": g})() for g in want], 0.5, norm, True)
            torch.nn.utils.clip_grad_norm_(list(tr.model.parameters()), 0.5, foreach=True)
            for a, b in zip(_grads(tr), want, strict=True):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), fill
            fresh = _encode(tr)
            for gi in range(len(tr.up.grad_groups)):
                for r, page in enumerate(fresh[gi]):
                    assert torch.equal(tr.up.clip_parity.bufs[gi][r], page), (fill, gi, r)
            tr.t += 1
        tr.client.close()
    finally:
        sm.stop()


def test_edge_coefficients_keep_torchs_bytes_and_the_codecs_parity(installed):
    _edge_case("cpu")


@pytest.mark.gpu
def test_on_the_gpu_edge_coefficients_keep_torchs_bytes_and_the_codecs_parity(installed):
    _edge_case("cuda")


def test_a_clip_of_some_gradients_scales_those_alone_and_the_parity_covers_all(counting, installed):
    """Two clips in one iteration, each of a subset (as a script clipping its parts
    apart): each leaves torch's bytes; the parity after the second is the encode of all;
    the step encodes nothing."""
    sm = start_state_manager(_config("cpu"))
    try:
        tr = _trainer(sm, "cpu")
        cp = tr.up.clip_parity
        grad_clip.install(cp)
        cp.used = grad_clip.AUDIT_FIRST  # (past the first audits: the step encodes nothing)
        tr.up.begin(tr.t)
        h.grads_for(tr.model, tr.t)
        params = [p for p in tr.model.parameters() if p.grad is not None]
        assert len(params) >= 2
        for part in (params[:1], params[1:]):
            want = [p.grad.clone() for p in part]
            others = [p.grad.clone() for p in params if all(p is not q for q in part)]
            norm = torch.nn.utils.get_total_norm(want, 2.0, False, None)
            grad_clip._torch_clip([type("P", (), {"grad": g})() for g in want], 0.01, norm, None)
            torch.nn.utils.clip_grad_norm_(part, 0.01)
            for p, w in zip(part, want, strict=True):
                assert torch.equal(p.grad.view(torch.int32), w.view(torch.int32))
            rest = [p.grad for p in params if all(p is not q for q in part)]
            for a, b in zip(rest, others, strict=True):
                assert torch.equal(a, b), "a gradient the clip was not given changed"
        fresh = _encode(tr)
        for gi in range(len(tr.up.grad_groups)):
            for r, page in enumerate(fresh[gi]):
                assert torch.equal(cp.bufs[gi][r], page), (gi, r)
        _step(tr, counting)
        assert not _grad_lists(tr) & set(counting)
        assert cp.taken == 2 and cp.used == grad_clip.AUDIT_FIRST + 1
        tr.client.close()
    finally:
        sm.stop()


def test_a_write_autograd_sees_after_the_clip_makes_the_step_encode(counting, installed):
    with _clipped() as (tr, cp):
        assert cp.parity(tr.t) is not None
        _grads(tr)[1].mul_(0.5)  # (a GradScaler's unscale_, a second clip: in place)
        assert cp.parity(tr.t) is None
        _step(tr, counting)
        assert _grad_lists(tr) <= set(counting)
        assert cp.used == 0


def test_a_write_autograd_does_not_see_is_found_by_the_audit_which_turns_the_pass_off(
    counting, installed, capfd
):
    with _clipped() as (tr, cp):
        _grads(tr)[1].data.add_(1.0)  # autograd's version counter does not move
        assert cp.parity(tr.t) is not None and cp.audit_due()
        fresh = _encode(tr)
        _step(tr, counting)
        assert cp.off is not None and "without autograd seeing it" in cp.off
        assert "gradient parity is taken at the step from now on" in capfd.readouterr().err
        assert cp.parity(tr.t) is None
        assert "at the step (the gradients changed" in tr.up.grad_parity_path
        # What the step kept is the fresh encode: the host tier holds it.
        for g, want in zip(tr.up.grad_groups, fresh, strict=True):
            host = tr.up._host_tier(g, 0)
            got = host.reshape(-1)[: sum(p.numel() for p in want)]
            assert torch.equal(got, torch.cat([p.reshape(-1) for p in want])), g.gid
        # Later clips leave the gradients to torch alone.
        tr.up.begin(tr.t)
        h.grads_for(tr.model, tr.t)
        taken = cp.taken
        torch.nn.utils.clip_grad_norm_(list(tr.model.parameters()), 0.5)
        assert cp.taken == taken


def test_where_it_does_not_apply_the_reason_is_said(monkeypatch):
    monkeypatch.setenv(grad_clip.ENV, "0")
    sm = start_state_manager(_config("cpu"))
    try:
        tr = u.Trainer(sm, "adamw-fused", dims=DIMS)
        assert tr.up.clip_parity is None
        assert tr.up.grad_parity_path == f"at the step ({grad_clip.ENV}=0)"
        tr.client.close()
    finally:
        sm.stop()
