"""``--undo ahead``: every chunk's undo copy taken once an iteration, as a copy of the
whole retained state made while forward and backward run, instead of one copy per chunk
on the update's path. Crash-consistent at every point (mid-copy in the compute phase,
between the copy and the update, inside a chunk that wrote no UNDO_DONE), with pages
of the copy lost, for the fused pass (its CPU twin) and the unfused steps alike; the
fused pass then copies nothing and writes one marker per chunk."""

from __future__ import annotations

import pytest
import torch

from faultkit import hooks
from leto.errors import RetainedStateLost
from leto.memory.client import PoolClient
from leto.memory.launch import start_state_manager
from leto.update.rmu import Updater, UpdaterConfig
from tests import rmu_harness as h
from tests import test_user_optim as u
from tests.pool_helpers import small_config
from tests.test_chunk_pass import same_bytes
from tests.test_rmu import ITERS

# Several units a chunk and chunks a group (test_chunk_pass's shape).
DIMS = (60, 1031, 37)
KW = {"dims": DIMS, "chunk_units": 2}


@pytest.fixture
def pool():
    sm = start_state_manager(small_config(data_pages=12, tier1_pages=3))
    yield sm
    sm.stop()


def _per_chunk(kind: str) -> dict:
    """``kind`` trained fault-free with per-chunk undo copies: what every ahead run must
    give, byte for byte (state and both parity tiers)."""
    sm = start_state_manager(small_config(data_pages=12, tier1_pages=3))
    try:
        return u.train(sm, kind, None, **KW)
    finally:
        sm.stop()


@pytest.fixture(scope="module")
def fused_reference():
    return _per_chunk("adamw-fused")


# "update.undo" #1 is the whole-state copy in iteration 2's compute phase (the fused
# pass copies nothing per chunk); the chunk points strike the first and a later chunk.
FUSED_CRASHES = [(p, 2, 1) for p in h.POINTS] + [
    ("update.optimizer", 2, 3),
    ("update.commit", 3, 2),
    ("update.parity", 1, 4),
]


@pytest.mark.parametrize("crash", FUSED_CRASHES, ids=lambda c: f"{c[0]}@{c[1]}#{c[2]}")
@pytest.mark.parametrize("at", ["grad", "begin"])
def test_the_fused_pass_with_the_undo_taken_ahead_resumes_exactly_from_every_point(
    pool, fused_reference, crash, at
):
    # at: the copy queued at the iteration's start (the default) or when the first
    # gradient lands (LETO_UNDO_AHEAD_AT=grad: RetainedTraining's hook).
    got = u.train(pool, "adamw-fused", crash, undo="ahead", ahead_at=at, **KW)
    assert got["chunk pass"] == "CPU twin"
    same_bytes(got, fused_reference, f"--undo ahead at {at}, crash at {crash}")


@pytest.mark.parametrize("crash", [None, ("update.optimizer", 2, 1), ("update.commit", 3, 1)],
                         ids=lambda c: "fault-free" if c is None else f"{c[0]}@{c[1]}#{c[2]}")  # fmt: skip
def test_without_a_gradient_hook_firing_the_update_takes_the_copy_itself(
    pool, fused_reference, crash
):
    # Hooks armed, none fired (no backward): begin only marks the copy as due; the
    # update queues it before its first chunk, and every byte is still as per chunk.
    got = u.train(pool, "adamw-fused", crash, undo="ahead", ahead_at="update", **KW)
    same_bytes(got, fused_reference, f"--undo ahead taken by the update, crash at {crash}")


def test_the_copy_waits_for_the_first_gradient_and_is_taken_once(pool):
    tr = u.Trainer(pool, "adamw-fused", undo="ahead", ahead_at="grad", **KW)
    try:
        tr.iteration()  # iteration 0
        up = tr.up
        up.begin(1)
        assert up._ahead_pending == 1 and up._ahead_of == 0, "copied before a gradient"
        up.ahead_at_first_grad()
        assert up._ahead_pending is None and up._ahead_of == 1
        before = {k: v.clone() for k, v in up._ahead.items()}
        for live in up._alloc_pages.values():
            live.add_(1)  # were it copied again, the mirror would change
        up.ahead_at_first_grad()  # a later gradient of the same iteration
        assert all(torch.equal(before[k], v) for k, v in up._ahead.items())
    finally:
        tr.client.close()


@pytest.fixture(scope="module")
def unfused_reference():
    return _per_chunk("adam-fused")


UNFUSED_CRASHES = [(p, 2, 1) for p in h.POINTS] + [
    ("update.undo", 2, 2),
    ("update.optimizer", 2, 3),
]


@pytest.mark.parametrize("crash", UNFUSED_CRASHES, ids=lambda c: f"{c[0]}@{c[1]}#{c[2]}")
def test_an_update_the_fused_pass_cannot_take_copies_each_chunk_into_the_same_place(
    pool, unfused_reference, crash
):
    # Adam with weight decay: the pass exists, but no update takes it (each update's
    # unfused steps then copy every chunk into the whole-state copy, before its update).
    # "update.undo" #1 is the whole copy in the compute phase, #2 the first chunk's.
    got = u.train(pool, "adam-fused", crash, undo="ahead", **KW)
    assert got["chunk pass"].startswith("unfused steps (parameter group 0: Adam with weight")
    same_bytes(got, unfused_reference, f"--undo ahead, unfused, crash at {crash}")


def test_where_no_update_can_take_the_fused_pass_the_copy_ahead_is_not_taken(pool):
    client = PoolClient.connect(pool.socket_path, pool.token)
    try:
        up = Updater(client, h.build_model(), h.SCHEDULE, UpdaterConfig(undo="ahead"))
        assert not up.ahead and Updater.AHEAD_NAME not in client._maps
        assert up.undo_path == (
            "per chunk, before its update (--undo ahead not taken: the unfused steps (the "
            "updater's own AdamWConfig path) copy each chunk anyway)"
        )
    finally:
        client.close()


def _crash_lose_resume(pool, crash, lost_ahead, lost_data=(), then=None):
    """Train with the fused pass under --undo ahead to ``crash``; while no trainer is
    attached, lose pages ``lost_ahead`` of the whole-state copy (a callable of the
    crashed trainer's updater, evaluated before it goes) and ``lost_data`` (allocation,
    pages) of the state; resume (``then``: a second crash, in the resumed trainer, and
    resume again) and finish. Returns the retained state, its parity checked."""
    hooks.arm(*crash, mode="raise")
    tr = u.Trainer(pool, "adamw-fused", undo="ahead", **KW)
    try:
        with pytest.raises(hooks.InjectedCrash):
            while tr.t < ITERS:
                tr.iteration()
        pages = lost_ahead(tr.up)
    finally:
        hooks.disarm()
        tr.client.close()
    with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
        f.inject_loss("data", Updater.AHEAD_NAME, pages)
        for name, idx in lost_data:
            f.inject_loss("data", name, idx)
    if then is not None:
        hooks.arm(*then, mode="raise")
        try:
            with pytest.raises(hooks.InjectedCrash):
                tr = u.Trainer(pool, "adamw-fused", undo="ahead", **KW)  # finishes the update
                try:
                    while tr.t < ITERS:
                        tr.iteration()
                finally:
                    tr.client.close()
        finally:
            hooks.disarm()
    tr = u.Trainer(pool, "adamw-fused", undo="ahead", **KW)
    try:
        while tr.t < ITERS:
            tr.iteration()
        st = tr.up.state
        out = {
            k: torch.cat([v[s.offset : s.offset + s.numel] for s in st.slots]).clone()
            for k, v in st.flat.items()
        }
        for g in tr.up.groups:
            assert tr.up.code(g).verify(g.data, g.tier1, g.tier2), f"group {g.gid} stale"
        return out
    finally:
        tr.client.close()


def test_copy_pages_lost_outside_the_in_flight_chunk_are_taken_again(pool, fused_reference):
    # Iteration 2's first chunk is in flight (half updated, no UNDO_DONE written): its
    # copy reverts it; every other page of the copy is lost, and the resumed update
    # copies the whole state again before a later chunk needs it — the third chunk,
    # in flight when a second crash strikes the resumed update.
    def every_other_chunk(up):
        mine = set(up.ahead_pages_of(up.state.chunks(0)[0]))
        return [p for p in range(len(up._ahead_pages)) if p not in mine]

    got = _crash_lose_resume(
        pool, ("update.optimizer", 2, 1), every_other_chunk, [("param", [0]), ("exp_avg", [1])],
        then=("update.optimizer", 2, 3),
    )  # fmt: skip
    for k in ("param", "exp_avg", "exp_avg_sq"):
        want = fused_reference[k]
        assert torch.equal(got[k][: want.numel()].view(torch.uint8), want.view(torch.uint8)), k


def test_copy_pages_lost_in_the_compute_phase_are_taken_again(pool, fused_reference):
    # The crash strikes mid-copy (iteration 2's compute phase) and the whole copy is
    # lost: the iteration is redone and copies again.
    got = _crash_lose_resume(
        pool, ("update.undo", 2, 1), lambda up: list(range(len(up._ahead_pages)))
    )
    for k in ("param", "exp_avg", "exp_avg_sq"):
        want = fused_reference[k]
        assert torch.equal(got[k][: want.numel()].view(torch.uint8), want.view(torch.uint8)), k


def test_the_in_flight_chunks_copy_lost_is_a_fatal_failure_naming_it(pool):
    def its_first_page(up):
        return up.ahead_pages_of(up.state.chunks(0)[0])[:1]

    with pytest.raises(RetainedStateLost, match=r"undo copy of chunk 0 of group \d+ lost"):
        _crash_lose_resume(pool, ("update.optimizer", 2, 1), its_first_page)


def test_the_fused_pass_copies_nothing_on_the_update_path_and_writes_one_marker_a_chunk(pool):
    tr = u.Trainer(pool, "adamw-fused", undo="ahead", **KW)
    try:
        tr.iteration()  # iteration 0: the first steps
        with h.watched_update(tr.up) as (copies, steps):
            tr.iteration()
        assert copies == [], f"chunk copies on the update's path: {copies}"
        assert "UNDO_DONE" not in steps, steps
        assert len(steps) == h.update_steps_without_copies(tr.up), steps
    finally:
        tr.client.close()


def test_an_update_without_the_copy_for_its_iteration_is_refused(pool):
    tr = u.Trainer(pool, "adamw-fused", undo="ahead", **KW)
    try:
        tr.iteration()
        with pytest.raises(RuntimeError, match=r"without the state copied for it"):
            tr.up.update(5)
    finally:
        tr.client.close()


def test_an_unknown_undo_mode_is_refused(pool):
    client = PoolClient.connect(pool.socket_path, pool.token)
    try:
        with pytest.raises(ValueError, match=r"undo='later': use chunk or ahead"):
            Updater(client, h.build_model(), h.SCHEDULE, UpdaterConfig(undo="later"))
    finally:
        client.close()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "crash",
    [
        None,
        ("update.undo", 2, 1),
        ("update.optimizer", 2, 1),
        ("update.optimizer", 2, 2),
        ("update.commit", 3, 1),
    ],  # fmt: skip
    ids=lambda c: "fault-free" if c is None else f"{c[0]}@{c[1]}#{c[2]}",
)
@pytest.mark.parametrize("at", ["grad", "begin"])
def test_on_the_gpu_the_copy_beside_compute_gives_the_per_chunk_bytes(crash, at):
    """The CUDA kernel with the whole-state copy on the copy stream (the update waits
    for it), fault-free and resumed after a crash, against per-chunk undo copies."""
    from leto.memory.config import PoolConfig

    cfg = PoolConfig.for_cuda(0, data_pages=12, tier1_pages=4, allow_fault_injection=True)
    kw = {"dims": (1024, 2400, 7), "chunk_units": 2}  # 2 MiB pages: units of 512 K
    out = {}
    for undo in ("chunk", "ahead"):
        sm = start_state_manager(cfg)
        try:
            out[undo] = u.train(sm, "adamw-fused", crash if undo == "ahead" else None,
                                undo=undo, ahead_at=at, **kw)  # fmt: skip
        finally:
            sm.stop()
    assert out["ahead"]["chunk pass"] == "cuda kernel"
    same_bytes(out["ahead"], out["chunk"], f"--undo ahead at {at} on CUDA, crash {crash}")


def test_a_pool_that_cannot_hold_the_copy_is_a_clear_error_at_start(pool, monkeypatch):
    from leto.errors import InvalidInput
    from leto.memory.errors import RemoteError

    client = PoolClient.connect(pool.socket_path, pool.token)
    real = client.attach

    def attach(name, *a, **kw):
        if name == Updater.AHEAD_NAME:  # as a GPU out of memory in the state manager
            raise RemoteError("internal", "CudaError: cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY")
        return real(name, *a, **kw)

    monkeypatch.setattr(client, "attach", attach)
    try:
        model = h.build_model(dims=DIMS)
        user = u.UserOptimizer(
            u.make("adamw-fused", model), {id(p): n for n, p in model.named_parameters()}
        )
        with pytest.raises(InvalidInput, match=r"--undo ahead: the whole-state copy needs [\d.]+ GiB "
                           r"more pool memory.*OUT_OF_MEMORY.*--undo chunk"):  # fmt: skip
            Updater(client, model, None, UpdaterConfig(chunk_units=2, undo="ahead"), user=user)
    finally:
        client.close()
