"""The fused chunk pass (``leto.update.chunk_pass``): where it applies and why not, the
segment table it builds from the script's optimizer, and its bytes — state and both
parity tiers — equal to the unfused steps', fault-free and resumed after a crash
between its halves. On the CPU the pass is its twin (torch's fused kernel on the same
segments + the codec's update); on the GPU the CUDA kernel, against the same unfused
steps (torch's fused AdamW + the codec) and against a plain torch loop."""

from __future__ import annotations

import pytest
import torch

from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager
from leto.update.chunk_pass import ENV, SEG, self_check, unsupported
from leto.update.rmu import Updater, UpdaterConfig
from leto.update.user_optim import UserOptimizer
from tests import rmu_harness as h
from tests import test_user_optim as u
from tests.pool_helpers import small_config

# Several units per chunk and chunks per group: the pass's unit walk, its halves and
# the group's column offsets all matter. Odd sizes: segments end mid-vector.
DIMS = (60, 1031, 37)


@pytest.fixture
def pool():
    sm = start_state_manager(small_config(data_pages=12, tier1_pages=3))
    yield sm
    sm.stop()


def names_of(model):
    return {id(p): n for n, p in model.named_parameters()}


def test_where_the_fused_pass_applies_and_why_not(pool, monkeypatch):
    from leto.memory.client import PoolClient

    client = PoolClient.connect(pool.socket_path, pool.token)
    try:
        model = h.build_model()
        up = Updater(client, model, None, UpdaterConfig(chunk_units=2),
                     user=UserOptimizer(u.make("adamw-fused", model), names_of(model)))  # fmt: skip
        assert up.chunk_pass is not None and up.chunk_pass.name == "CPU twin"
        state, h1 = up.state, up.h1
        cases = {
            "adamw-foreach": "parameter group 0 is not fused=True",
            "sgd-nesterov": "optimizer 0 is sgd",
            "muon+adamw": "optimizer 0 is muon",
        }
        for kind, why in cases.items():
            user = UserOptimizer(u.make(kind, model), names_of(model))
            assert why in unsupported(state, user, h1), kind
        user = UserOptimizer(u.make("adam-fused", model), names_of(model))
        assert unsupported(state, user, h1) is None
        assert "at most 16" in unsupported(state, user, 17)
        assert "AdamWConfig" in unsupported(state, None, h1)
        monkeypatch.setenv(ENV, "0")
        assert unsupported(state, user, h1) == f"{ENV}=0"
    finally:
        client.close()


def test_the_segment_table_leaves_out_frozen_parameters_and_skipped_steps(pool):
    from leto.memory.client import PoolClient

    client = PoolClient.connect(pool.socket_path, pool.token)
    try:
        model = h.build_model()
        frozen = "2.weight"
        dict(model.named_parameters())[frozen].requires_grad_(False)
        trainable = [p for n, p in model.named_parameters() if n != frozen]
        opts = [
            torch.optim.AdamW(trainable[:2], lr=1e-2, weight_decay=0.1, fused=True),
            torch.optim.Adam(trainable[2:], lr=3e-3, betas=(0.8, 0.9), fused=True),
        ]
        user = UserOptimizer(opts, names_of(model))
        up = Updater(client, model, None, UpdaterConfig(chunk_units=2), user=user)
        cp = up.chunk_pass
        assert cp is not None
        cp.prepare(user.hparams(), [5, 3], frozenset())
        st = up.state
        slots = {s.name: s for s in st.slots}
        want = [n for n, p in model.named_parameters() if n != frozen]
        assert cp.table.dtype == SEG and len(cp.table) == len(want)
        for row, name in zip(cp.table, want, strict=True):
            s = slots[name]
            assert (int(row["start"]), int(row["end"])) == (s.offset, s.offset + s.numel)
            first = name in ("0.weight", "0.bias")
            assert float(row["lr"]) == pytest.approx(1e-2 if first else 3e-3)
            assert float(row["step"]) == (5.0 if first else 3.0)
            assert int(row["adamw"]) == int(first)
            assert int(row["start"]) % 4 == 0  # the kernel's 16-byte vectors
        cp.prepare(user.hparams(), [5, 3], frozenset({1}))  # a GradScaler skipped Adam
        assert [int(r["start"]) for r in cp.table] == [slots[n].offset for n in want[:2]]
    finally:
        client.close()


def test_adam_with_weight_decay_keeps_the_unfused_steps(pool):
    got = u.train(pool, "adam-fused", None, dims=DIMS, chunk_units=2)
    assert got["chunk pass"] == (
        "unfused steps (parameter group 0: Adam with weight decay (L2) on the GPU)"
    )


def same_bytes(got: dict, want: dict, what: str) -> None:
    keys = [k for k in want if k != "chunk pass"]
    assert keys == [k for k in got if k != "chunk pass"], what
    u.assert_same({k: got[k] for k in keys}, {k: want[k] for k in keys}, what)


@pytest.mark.parametrize("crash", [None, ("update.optimizer", 2, 1), ("update.parity", 3, 2)])
@pytest.mark.parametrize("kind", ["adamw-fused", "adam-fused-no-l2"])
def test_the_pass_gives_the_unfused_steps_bytes(pool, monkeypatch, kind, crash):
    kw = {"dims": DIMS, "chunk_units": 2}
    monkeypatch.setenv(ENV, "0")
    want = u.train(pool, kind, None, **kw)
    assert want["chunk pass"] == f"unfused steps ({ENV}=0)"
    monkeypatch.setenv(ENV, "1")
    pool.stop()
    fresh = start_state_manager(small_config(data_pages=12, tier1_pages=3))
    try:
        got = u.train(fresh, kind, crash, **kw)
    finally:
        fresh.stop()
    assert got["chunk pass"] == "CPU twin"
    same_bytes(got, want, f"{kind}, crash {crash}")


@pytest.mark.gpu
@pytest.mark.parametrize("h1", [1, 2, 3, 4, 8, 16])  # the Horner scheme to 4, tables above
@pytest.mark.parametrize(
    "kind,crash",
    [
        ("adamw-fused", None),
        ("adam-fused-no-l2", None),
        ("adamw-fused", ("update.optimizer", 2, 1)),
    ],
)
def test_the_cuda_kernel_gives_the_unfused_steps_bytes(monkeypatch, kind, crash, h1):
    assert self_check(torch.device("cuda", 0)) is None
    # 2 MiB pages (512 K parameters a unit): five units, two groups of up to four,
    # chunks of two units.
    cfg = PoolConfig.for_cuda(0, data_pages=12, tier1_pages=h1, allow_fault_injection=True)
    kw = {"dims": (1024, 2400, 7), "chunk_units": 2}
    out = {}
    for env in ("0", "1"):
        monkeypatch.setenv(ENV, env)
        sm = start_state_manager(cfg)
        try:
            out[env] = u.train(sm, kind, crash if env == "1" else None, **kw)
        finally:
            sm.stop()
    assert out["1"]["chunk pass"] == "cuda kernel"
    same_bytes(out["1"], out["0"], f"{kind} on CUDA, H1 {h1}, crash {crash}")


@pytest.mark.gpu
def test_the_trip_wire_stops_the_kernel_after_n_blocks():
    from nvbit_tools import tripwire

    sm = start_state_manager(PoolConfig.for_cuda(0, data_pages=12, tier1_pages=4))
    try:
        tr = u.Trainer(sm, "adamw-fused", dims=(1024, 2400, 7), chunk_units=2)
        tr.iteration()
        up, st = tr.up, tr.up.state
        up.chunk_pass.prepare(UserOptimizer.hparams(up.user), 2, frozenset())
        units = st.chunks(0)[0]
        first, _ = st.chunk_pages(0, units)
        ue = st.unit_elems
        h.grads_for(tr.model, 1)
        before = st.flat["param"].clone()
        scratch = [torch.zeros(st.page_bytes, dtype=torch.uint8, device="cuda") for _ in range(4)]
        code = up.code(up.groups[0]).tier1
        tripwire.arm(5, kill=False)
        with pytest.raises(tripwire.TripwireFired) as e:
            up.chunk_pass.run(units, (0, ue), first, scratch, code, None, None)
        per_block = 256 * 4  # elements of each page a block owns
        lo, hi = units[0] * ue, units[1] * ue
        changed = (st.flat["param"][lo:hi] != before[lo:hi]).view(
            units[1] - units[0], -1, per_block
        )
        blocks = changed.any(dim=2).any(dim=0)  # a block walks every unit of the chunk
        assert int(blocks.sum()) == 5
        touched = torch.stack([s.view(-1, per_block * 4).ne(0).any(dim=1) for s in scratch])
        assert torch.equal(touched.any(dim=0), blocks)  # parity only where the state changed
        assert e.value.report["blocks_launched"] == ue // per_block
        tr.client.close()
    finally:
        tripwire.disarm()
        sm.stop()


@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_page_changed_while_its_chunk_is_in_flight_is_found(pool, monkeypatch, fused):
    """A bit flipped in the in-flight chunk's not-yet-updated half (after the undo
    copy): the fused pass takes the parity change from what it read, so parity and
    state disagree and the scrub names the page; the unfused steps take it from the
    undo copy and re-encode the damage (the window docs/integrity.md describes)."""
    from leto import plugins
    from leto.integrity.scrub import CorruptState, Scrubber

    monkeypatch.setenv(ENV, fused)
    tr = u.Trainer(pool, "adamw-fused", dims=DIMS, chunk_units=2)
    tr.iteration()
    st = tr.up.state
    u0, _ = st.chunks(0)[0]
    e = (u0 + 2) * st.unit_elems - 10  # second half of both paths' halves, in 0.weight
    assert st.slot_at(e).name == "0.weight"
    flipped = []

    def at(name, it, dest):
        if name == "update.optimizer" and it == 1 and not flipped:
            st.flat["param"][e : e + 1].view(torch.int32).bitwise_xor_(1 << 20)
            flipped.append(e)

    before = plugins._point_handler
    plugins.install_point_handler(at)
    try:
        tr.iteration()
    finally:
        plugins.install_point_handler(before)
    assert flipped, "the flip never happened: the test proves nothing"
    scrub = Scrubber(tr.up, budget_bytes=0)
    try:
        if fused == "1":
            with pytest.raises(CorruptState, match=r"group \d+ param page 1 "):
                scrub.full()
        else:
            assert scrub.full()["repaired"] == []  # absorbed: nothing to find
    finally:
        tr.client.close()


@pytest.mark.gpu
def test_the_cuda_kernel_keeps_denormal_optimizer_state_as_torch_does(monkeypatch):
    """A tied embedding's rows of tokens a batch lacks get gradients of ~1e-20: their
    squared gradients and second moments are float32 denormals. Built with denormals
    flushed, the kernel wrote 0 where torch keeps them (parameters still equal, optimizer
    state not) and the update recheck stopped a healthy job."""
    import tests.rmu_harness as h

    plain = h.grads_for

    def tiny(model, iteration):
        plain(model, iteration)
        for p in model.parameters():
            p.grad.view(-1)[::2] *= 1e-17  # half: after clipping, denormal squares

    monkeypatch.setattr(h, "grads_for", tiny)
    cfg = PoolConfig.for_cuda(0, data_pages=12, tier1_pages=4, allow_fault_injection=True)
    kw = {"dims": (1024, 2400, 7), "chunk_units": 2}
    out = {}
    for env in ("0", "1"):
        monkeypatch.setenv(ENV, env)
        sm = start_state_manager(cfg)
        try:
            out[env] = u.train(sm, "adamw-fused", None, **kw)
        finally:
            sm.stop()
    assert out["1"]["chunk pass"] == "cuda kernel", out["1"]["chunk pass"]
    v = out["0"]["exp_avg_sq"]  # the test exercises what it names: denormals exist
    assert ((v != 0) & (v.abs() < torch.finfo(torch.float32).tiny)).any()
    same_bytes(out["1"], out["0"], "denormal second moments on CUDA")


@pytest.mark.gpu
def test_the_kernel_matches_torch_in_every_value_regime():
    """torch's fused Adam/AdamW beside the kernel's element-wise twin (``adam_check``) on
    2**20 elements per configuration: normal values, tiny gradients with denormal second
    moments, a mix over 1e-40..1e2, zero moments; AdamW with and without weight decay and
    Adam; several learning rates, steps and beta2 — every byte of p, m and v equal."""
    import itertools

    import numpy as np

    from leto.update import chunk_pass as cp
    from nvbit_tools import tripwire

    dev, n = torch.device("cuda", 0), 1 << 20
    fn = cp._module().get_function("adam_check")
    g = torch.Generator().manual_seed(1)

    def logu(lo, hi):
        e = torch.rand(n, generator=g) * (hi - lo) + lo
        return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) * 10.0**e

    regimes = {
        "normal": dict(p=logu(-3, 0), g=logu(-4, -1), m=logu(-6, -2), v=logu(-10, -5).abs()),
        "tiny": dict(p=logu(-3, 0), g=logu(-30, -10), m=logu(-30, -10), v=logu(-45, -20).abs()),
        "mixed": dict(p=logu(-3, 0), g=logu(-40, 2), m=logu(-40, 0), v=logu(-45, 0).abs()),
        "zero": dict(p=logu(-3, 0), g=logu(-20, -5), m=torch.zeros(n), v=torch.zeros(n)),
    }
    bad = []
    for (name, base), (adamw, wd), lr, step, b2 in itertools.product(
        regimes.items(), [(1, 0.1), (1, 0.0), (0, 0.0)], [1.8e-4, 3e-3], [1, 3, 1234], [0.95, 0.999]
    ):
        want = {k: v.to(dev) for k, v in base.items()}
        got = {k: v.clone() for k, v in want.items()}
        kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
        kernel([want["p"]], [want["g"]], [want["m"]], [want["v"]], [],
               [torch.tensor(float(step), device=dev)], amsgrad=False, lr=lr, beta1=0.9,
               beta2=b2, weight_decay=wd, eps=1e-8, maximize=False)  # fmt: skip
        seg = np.array([(0, n, lr, 0.9, b2, wd, 1e-8, float(step), adamw, 0)], dtype=cp.SEG)
        seg_t = torch.from_numpy(seg.view(np.uint8)).to(dev)
        ptrs = tuple(np.uint64(got[k].data_ptr()) for k in "pgmv")
        with tripwire.launch_on_torch_stream(dev):
            fn((-(-n // 256),), (256,), (*ptrs, np.int64(n), np.uint64(seg_t.data_ptr())))
        torch.cuda.synchronize(dev)
        for k in "pmv":
            if not torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)):
                bad.append((name, adamw, wd, lr, step, b2, k))
    assert not bad, f"{len(bad)} configurations differ from torch, e.g. {bad[:3]}"
