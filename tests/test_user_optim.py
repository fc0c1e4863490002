"""The script's own torch optimizer run by the updater: bit-identical to the same
optimizer, parameter groups and LR scheduler in a plain loop, fault-free and after a
crash at every step of the update (the hyperparameters of the interrupted iteration
come back from the loop record, as ``leto.Run`` does it)."""

from __future__ import annotations

import pytest
import torch

from faultkit import hooks
from leto.errors import InvalidInput
from leto.memory.client import PoolClient
from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager
from leto.update.loop_record import LoopRecord
from leto.update.rmu import Updater, UpdaterConfig, decide
from leto.update.user_optim import UserOptimizer
from tests import rmu_harness as h
from tests.pool_helpers import small_config

ITERS = 4
OPTIMIZERS = {
    "adamw-fused": lambda g: torch.optim.AdamW(g, betas=(0.9, 0.95), weight_decay=0.1, fused=True),
    "adamw-foreach": lambda g: torch.optim.AdamW(g, weight_decay=0.1, foreach=True),
    "adamw-single": lambda g: torch.optim.AdamW(g, weight_decay=0.1, foreach=False),
    "adam-fused": lambda g: torch.optim.Adam(g, weight_decay=0.01, fused=True),
    "adam-fused-no-l2": lambda g: torch.optim.Adam(g, betas=(0.8, 0.99), fused=True),
    "adam-single": lambda g: torch.optim.Adam(g, weight_decay=0.01, foreach=False),
    "sgd-nesterov": lambda g: torch.optim.SGD(
        g, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=False
    ),
    "sgd-dampening-foreach": lambda g: torch.optim.SGD(
        g, momentum=0.8, dampening=0.1, foreach=True
    ),
    "sgd-plain": lambda g: torch.optim.SGD(g, lr=0.1),
}


def muon_and_adamw(model: torch.nn.Module) -> list:
    """Muon for the 2-D weights, fused AdamW for the rest: how Muon scripts run."""
    named = list(model.named_parameters())
    return [
        torch.optim.Muon([p for _, p in named if p.ndim == 2], lr=2e-2, weight_decay=0.05),
        torch.optim.AdamW([p for _, p in named if p.ndim != 2], lr=3e-3, fused=True),
    ]


def make(kind: str, model: torch.nn.Module) -> list:
    if kind == "muon+adamw":
        return muon_and_adamw(model)
    return [OPTIMIZERS[kind](groups(model))]


def groups(model: torch.nn.Module) -> list[dict]:
    """Two parameter groups as GPT scripts make them: weight decay off for biases, and
    a different learning rate."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "lr": 1e-2},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": 3e-3, "weight_decay": 0.0},
    ]


def schedule(t: int) -> float:
    return (t + 1) / ITERS


def reference(kind: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    model = h.mlp(h.DIMS)
    with torch.no_grad():
        h.init_params(model)
    model = model.to(device)
    opts = make(kind, model)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in opts]
    params = list(model.parameters())
    for t in range(ITERS):
        for p in params:
            p.grad = torch.zeros_like(p)
        h.grads_for(model, t)
        torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
        for o in opts:
            o.step()
        for sc in scheds:
            sc.step()
    state = {p: st for o in opts for p, st in o.state.items()}
    momentum = kind.startswith("sgd") or kind.startswith("muon")
    out = {"param": torch.cat([p.detach().reshape(-1) for p in params])}
    for k, key in (("exp_avg", "momentum_buffer" if kind.startswith("sgd") else "exp_avg"),
                   ("exp_avg_sq", "exp_avg_sq")):  # fmt: skip
        if k == "exp_avg_sq" and momentum:
            continue
        if kind.startswith("muon"):  # Muon's buffer is momentum_buffer, AdamW's exp_avg
            out[k] = torch.cat(
                [
                    (state[p]["momentum_buffer"] if p.ndim == 2 else state[p]["exp_avg"]).reshape(
                        -1
                    )
                    for p in params
                ]
            )
            continue
        out[k] = torch.cat(
            [
                state[p][key].reshape(-1)
                if state.get(p, {}).get(key) is not None
                else torch.zeros(p.numel(), device=device)
                for p in params
            ]
        )
    return {k: v.cpu() for k, v in out.items()}


class Trainer:
    """One trainer process's objects: the script's optimizer and scheduler over a model
    built on the meta device, the updater, the loop record."""

    def __init__(
        self, pool, kind: str, dims=h.DIMS, chunk_units: int = 1, undo: str = "chunk",
        ahead_at: str = "begin",
    ):  # fmt: skip
        # ahead_at (--undo ahead): "begin" copies at the iteration's start; "grad" when
        # the first gradient lands (as RetainedTraining's hook does), "update" in the
        # update (no gradient hook fired).
        self.client = PoolClient.connect(pool.socket_path, pool.token, takeover=True)
        self.ahead_at = ahead_at
        try:
            self._start(kind, dims, chunk_units, undo)
        except BaseException:
            self.client.close()  # (a recovery that failed leaves no socket behind)
            raise

    def _start(self, kind: str, dims, chunk_units: int, undo: str) -> None:
        report = self.client.localize()
        self.model = h.build_model(dims=dims)
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.opts = make(kind, self.model)
        self.opt = self.opts[0]
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.opts]
        self.up = Updater(
            self.client, self.model, None, UpdaterConfig(chunk_units=chunk_units, undo=undo),
            user=UserOptimizer(self.opts, names),
        )  # fmt: skip
        self.up.ahead_at_grad = self.ahead_at != "begin"
        self.loop = self.up.loop
        m = self.up.recover(report)
        if m is None:
            self.up.initialize(lambda: h.init_params(self.model))
            self.t = 0
            return
        action, t = decide([m])
        if action == "finish" and m.next_iteration() == t:
            self.up.hparams = self.loop.read(t)["hparams"]
            self.up.finish(m)
            t += 1
        self.t = t
        rec = self.loop.read(t - 1)  # the schedulers as of iteration t - 1's step ...
        for (_, g), hp in zip(self.up.user.groups, rec["hparams"], strict=True):
            g.update(hp)
        for o, sc, st in zip(self.opts, self.scheds, rec["scheduler"], strict=True):
            sc.load_state_dict(st)
            o._opt_called = True  # as leto.Run marks it: the update ran
            sc.step()  # ... then their step after that iteration

    def iteration(self) -> None:
        t = self.t
        self.up.begin(t)
        hooks.point("compute.backward", t)
        if self.ahead_at == "grad":
            self.up.ahead_at_first_grad()
        h.grads_for(self.model, t)
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), 0.5, foreach=True)
        self.step()

    def step(self) -> None:
        """The iteration's step once its gradients are in (and clipped): the loop record,
        protect, sync, update, the schedulers (what leto.Run does)."""
        t = self.t
        hp = UserOptimizer.hparams(self.up.user)
        scheds = [sc.state_dict() for sc in self.scheds]
        self.loop.write(t, {"hparams": hp, "scheduler": scheds, "state": {}})
        self.up.hparams = hp
        self.up.protect_grads(t)
        self.up.sync(t)
        self.up.update(t)
        for o, sc in zip(self.opts, self.scheds, strict=True):
            o._opt_called = True
            sc.step()
        self.t += 1


def train(pool, kind: str, crash=None, **trainer) -> dict[str, torch.Tensor]:
    """The retained state after ITERS iterations (``crash``: a hook point that raises
    once, then a fresh trainer recovers), and every group's host parity bytes
    ("tier1/<gid>", "tier2/<gid>"), checked to encode the state they protect."""
    if crash is not None:
        hooks.arm(*crash, mode="raise")
    tr = Trainer(pool, kind, **trainer)
    try:
        while tr.t < ITERS:
            tr.iteration()
        assert crash is None, f"crash point {crash} was never reached: the test proves nothing"
    except hooks.InjectedCrash:
        tr.client.close()
        hooks.disarm()
        tr = Trainer(pool, kind, **trainer)
        while tr.t < ITERS:
            tr.iteration()
    finally:
        hooks.disarm()
    st = tr.up.state
    out = {
        k: torch.cat([v[s.offset : s.offset + s.numel] for s in st.slots]).cpu()
        for k, v in st.flat.items()
    }
    for g in tr.up.groups:
        dev = g.data[0].device  # host parity, checked where the data lives
        t1, t2 = [p.to(dev) for p in g.tier1], [p.to(dev) for p in g.tier2]
        assert tr.up.code(g).verify(g.data, t1, t2), f"group {g.gid}'s parity is stale"
        out[f"tier1/{g.gid}"] = torch.cat([p.reshape(-1).view(torch.uint8) for p in g.tier1]).cpu()
        out[f"tier2/{g.gid}"] = torch.cat([p.reshape(-1).view(torch.uint8) for p in g.tier2]).cpu()
    out["chunk pass"] = tr.up.update_path
    tr.client.close()
    return out


@pytest.fixture
def pool():
    # Groups large enough that Muon's layers (updated whole) each fit one.
    sm = start_state_manager(small_config(data_pages=24, tier1_pages=2))
    yield sm
    sm.stop()


def assert_same(got: dict, want: dict, what: str) -> None:
    for k, w in want.items():
        g = got[k]
        diff = (g.view(torch.uint8) != w.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{what}: {k} differs from torch at byte {int(diff[0])}"


@pytest.mark.parametrize("kind", [*OPTIMIZERS, "muon+adamw"])
def test_the_scripts_optimizer_is_bit_identical_to_a_plain_loop(pool, kind):
    assert_same(train(pool, kind), reference(kind), kind)


@pytest.mark.parametrize("at", ["update.optimizer", "update.parity", "update.commit", "sync"])
@pytest.mark.parametrize("kind", ["adamw-fused", "sgd-nesterov", "muon+adamw"])
def test_a_crash_in_the_update_resumes_with_that_iterations_hyperparameters(pool, kind, at):
    # The crash strikes in iteration 2, whose learning rates differ from 3's: finishing
    # it with the wrong ones would show.
    assert_same(train(pool, kind, crash=(at, 2, 1)), reference(kind), f"{kind}, crash at {at}")


def test_what_leto_cannot_run_is_refused_by_name():
    model = h.mlp(h.DIMS)
    names = {id(p): n for n, p in model.named_parameters()}
    with pytest.raises(
        InvalidInput, match="RMSprop is not supported.*supported: torch.optim.AdamW"
    ):
        UserOptimizer(torch.optim.RMSprop(model.parameters()), names)
    with pytest.raises(InvalidInput, match="amsgrad=True"):
        UserOptimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), names)
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(InvalidInput, match=r"shape \(3,\) that is not a parameter of the model"):
        UserOptimizer(torch.optim.SGD([stranger], lr=0.1), names)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    with pytest.raises(InvalidInput, match="lr is a tensor"):
        UserOptimizer(opt, names).hparams()


@pytest.mark.gpu
@pytest.mark.parametrize("crash", [None, ("update.optimizer", 2, 1)])
@pytest.mark.parametrize("kind", ["adamw-fused", "adamw-foreach", "adam-fused", "sgd-nesterov"])
def test_on_the_gpu_too(kind, crash):
    sm = start_state_manager(
        PoolConfig.for_cuda(0, data_pages=8, tier1_pages=2, allow_fault_injection=True)
    )
    try:
        assert_same(train(sm, kind, crash), reference(kind, "cuda"), f"{kind} on CUDA, {crash}")
    finally:
        sm.stop()


def test_the_optimizers_state_dict_reports_the_retained_state(pool):
    kind = "adamw-fused"
    tr = Trainer(pool, kind)
    while tr.t < ITERS:
        tr.iteration()
    st = tr.up.state

    def view(name, state):
        slot = next(s for s in st.slots if s.name == name)
        return st.flat[state][slot.offset : slot.offset + slot.numel].view(slot.shape)

    tr.up.user.adopt(tr.up.params)  # as leto.Run does
    tr.up.user.expose_state(tr.up.params, view, ITERS)
    got = tr.opt.state_dict()
    model = h.mlp(h.DIMS)
    with torch.no_grad():
        h.init_params(model)
    opt = OPTIMIZERS[kind](groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for t in range(ITERS):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        h.grads_for(model, t)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5, foreach=True)
        opt.step()
        sched.step()
    want = opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        for k, v in s.items():
            g = got["state"][i][k]
            assert torch.equal(g.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (
                i,
                k,
            )
    tr.client.close()


def test_the_loop_record_keeps_two_iterations_and_refuses_what_does_not_fit(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as client:
        client.localize()
        rec = LoopRecord(client)
        rec.write(4, {"state": {"best": 1.5}})
        rec.write(5, {"state": {"best": 1.25}})
        assert rec.read(4) == {"state": {"best": 1.5}} and rec.read(5)["state"]["best"] == 1.25
        rec.write(6, {"x": 1})  # overwrites 4's slot
        assert rec.read(4) is None and rec.read(5) is not None and rec.read(7) is None
        with pytest.raises(InvalidInput, match="pickles to .* bytes; a record holds"):
            rec.write(7, {"big": "x" * rec.capacity})
        assert rec.read(5) is not None, "a refused write must leave the other slot intact"
        # A write torn by a crash (payload half written) fails its CRC: not read back.
        raw = rec.records[0]
        raw[40:48] = raw[40:48] ^ 0xFF
        assert rec.read(6) is None


def test_a_bound_loop_record_writes_through_the_given_layout_without_fetching_one(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as client:
        client.localize()
        rec = LoopRecord(client)
        views = client.layout()
        rec.bind(views)
        fetched = LoopRecord(client).mirrors  # the unbound way: its own layout
        assert [[t.data_ptr() for t in m] for m in rec.mirrors] == [
            [t.data_ptr() for t in m] for m in fetched
        ], "bound and fetched mirrors differ"

        def no_layout():
            raise AssertionError("the bound record fetched a layout")

        client.layout = no_layout
        rec.write(3, {"lr": 0.5})
        assert rec.read(3) == {"lr": 0.5}
        # Slot 1's parity copy (XOR of one page: the page itself) holds the record's bytes.
        head = rec.records[1][:64]
        assert torch.equal(rec.mirrors[1][0][:64], head), "the bound parity page was not written"
