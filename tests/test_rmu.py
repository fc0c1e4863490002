"""The Resumable Model Updater against torch.optim.AdamW, with and without crashes."""

from __future__ import annotations

import pytest
import torch

from leto.memory.launch import start_state_manager
from leto.update.optim import AdamWConfig
from leto.update.rmu import UpdaterConfig
from tests import rmu_harness as h
from tests.pool_helpers import small_config
from tests.rmu_harness import reference, run

ITERS = 4


@pytest.fixture
def pool():
    sm = start_state_manager(small_config(data_pages=8, tier1_pages=2))
    yield sm
    sm.stop()


def assert_same(got: dict, want: dict) -> None:
    for k, w in want.items():
        g = got[k][: w.numel()]
        diff = (g.view(torch.uint8) != w.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{k} differs from torch.optim.AdamW at byte {int(diff[0])}"


@pytest.mark.parametrize("impl", ["fused", "single"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fault_free_updates_equal_torch_adamw_bit_for_bit(pool, dtype, impl):
    cfg = UpdaterConfig(chunk_units=1, adamw=AdamWConfig(impl=impl))
    assert_same(run(pool, ITERS, cfg, dtype), reference(ITERS, dtype, impl=impl))


POINTS = [(p, 1) for p in h.POINTS]


@pytest.mark.parametrize("name,nth", POINTS)
def test_crash_at_every_step_then_resume_is_exact(pool, name, nth):
    got = run(pool, ITERS, UpdaterConfig(chunk_units=1), crash=(name, 2, nth))
    assert_same(got, reference(ITERS))


def lose(*pages_by_target):
    def do(f):
        for target, name, pages in pages_by_target:
            f.inject_loss(target, name, pages)

    return do


# Group 0 of the allocation set holds units 0-1: param, exp_avg, exp_avg_sq pages 0 and 1.
CASES = {
    "in-flight chunk: 2 data pages of its group + a tier-1 page elsewhere": (
        ("update.optimizer", 2, 1),
        lose(("data", "param", [0]), ("data", "exp_avg_sq", [1]), ("tier1", "1", [0])),
    ),
    "in-flight chunk: its undo copy is what restores a lost chunk page": (
        ("update.parity", 2, 1),
        lose(("data", "param", [0]), ("data", "exp_avg", [0])),
    ),
    "parity being stored to host: device buffer rebuilds the group": (
        ("update.store", 2, 1),
        lose(("data", "exp_avg", [0, 1]), ("tier1", "0", [1])),
    ),
    "tier 2 being refreshed: host tier 1 rebuilds": (
        ("update.tier2", 2, 1),
        lose(("data", "param", [1]), ("tier2", "0", [0])),
    ),
    "tier 2 being refreshed, H1 data pages and a host tier-1 page lost: the buffer covers it": (
        ("update.tier2", 2, 1),
        lose(("data", "param", [0]), ("data", "exp_avg", [0]), ("tier1", "0", [1])),
    ),
    "gradients protected, then lost": (
        ("sync", 2, 1),
        lose(("data", "grad", [0, 3])),
    ),
    "gradients not yet protected, then lost (iteration redone)": (
        ("grad_parity", 2, 1),
        lose(("data", "grad", [0, 1])),
    ),
    "every device parity buffer lost while tier 2 is refreshed from one of them": (
        ("update.tier2", 2, 1),
        lose(("data", "rmu.parity", list(range(6))), ("data", "param", [1])),
    ),
    "the authoritative parity buffer lost before a chunk begins (re-encoded)": (
        ("update.commit", 2, 2),
        lose(("data", "rmu.parity", [0, 1, 2, 3, 4, 5])),
    ),
    "the marker's own page": (("update.undo", 2, 1), lose(("data", "rmu.marker", [0]))),
    "the parity buffers and undo buffer while no chunk is in flight": (
        ("update.load", 3, 1),
        lose(("data", "rmu.parity", [0, 3]), ("data", "rmu.undo", [0])),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_crash_plus_lost_pages_then_resume_is_exact(pool, case):
    crash, losses = CASES[case]
    assert_same(
        run(pool, ITERS, UpdaterConfig(chunk_units=1), crash=crash, lose=losses), reference(ITERS)
    )


def test_lost_pages_beyond_parity_are_a_fatal_failure(pool):
    from leto.errors import FatalFailure

    with pytest.raises(FatalFailure, match="protection group"):
        run(
            pool,
            ITERS,
            UpdaterConfig(chunk_units=1),
            crash=("update.optimizer", 2, 1),
            lose=lose(
                ("data", "param", [1]), ("data", "exp_avg", [1]), ("data", "exp_avg_sq", [1])
            ),
        )


def test_without_transactions_the_same_fault_gives_a_wrong_model(pool):
    """Fig. 12 ablation: pool and parity only, no undo and no incremental parity."""
    crash = ("update.optimizer", 2, 1)
    got = run(pool, ITERS, UpdaterConfig(chunk_units=1, transactions=False), crash=crash)
    want = reference(ITERS)
    assert not torch.equal(got["param"][: want["param"].numel()], want["param"]), (
        "the ablation recovered exactly: the test does not exercise a half-updated chunk"
    )


def assert_same_slices(got: dict, want: dict) -> None:
    for k, parts in want.items():
        for i, (g, w) in enumerate(zip(got[k], parts, strict=True)):
            d = (g.view(torch.uint8) != w.view(torch.uint8)).nonzero()
            assert d.numel() == 0, (
                f"{k} of parameter {i} differs from torch's Muon/AdamW at byte {int(d[0])}"
            )


MUON_CFG = UpdaterConfig(chunk_units=1, layerwise="muon")


@pytest.fixture
def muon_pool():
    # 5 units of 2048 elements per group: the largest weight (4500 elements) fits one.
    sm = start_state_manager(small_config(data_pages=16, tier1_pages=2))
    yield sm
    sm.stop()


def test_layerwise_muon_equals_torch_muon_bit_for_bit(muon_pool):
    from tests.rmu_harness import reference_muon

    assert_same_slices(run(muon_pool, ITERS, MUON_CFG), reference_muon(ITERS))


def test_a_layer_larger_than_a_group_is_refused(pool):
    with pytest.raises(ValueError, match="more than one protection group holds"):
        run(pool, 1, MUON_CFG)


@pytest.mark.parametrize(
    "point", ["update.undo", "update.optimizer", "update.parity", "update.store"]
)
def test_layerwise_muon_crash_with_lost_pages_is_exact(muon_pool, point):
    from tests.rmu_harness import reference_muon

    got = run(
        muon_pool,
        ITERS,
        MUON_CFG,
        crash=(point, 2, 1),
        lose=lose(("data", "param", [0]), ("data", "exp_avg", [1])),
    )
    assert_same_slices(got, reference_muon(ITERS))


def test_an_iteration_reaches_every_updater_injection_point(pool):
    from faultkit import hooks
    from leto.plugins import SDC_POINT

    client, up, model, t = h.start(pool, UpdaterConfig(chunk_units=1, adamw=h.ADAMW))
    try:
        seen = hooks.record()
        h.one_iteration(up, model, t)
        # And the seam of faultkit's sdc-update (no crash point: not in POINTS).
        assert set(seen) == {*h.POINTS, SDC_POINT}, f"reached {sorted(set(seen))}"
    finally:
        hooks.record(False)
        client.close()


def test_a_chunks_page_lists_are_the_groups_own_pages_taken_without_rechecking(pool):
    # The first update after a promotion builds every chunk's page lists: they are
    # slices of the layout's checked group list (the same page tensors, in order) and
    # one undo list per chunk length, not lists checked page by page.
    client, up, model, t = h.start(pool, UpdaterConfig(chunk_units=1))
    try:
        h.one_iteration(up, model, t)
        for gi, g in enumerate(up.groups):
            assert g.data_pages is not None and list(g.data_pages.pages) == g.data
            for j, units in enumerate(up.state.chunks(gi)):
                first, count = up.state.chunk_pages(gi, units)
                got = up._page_lists[("chunk", gi, j)].pages
                assert len(got) == count
                assert all(a is b for a, b in zip(got, g.data[first : first + count], strict=True))
        undo = {
            k: v for k, v in up._page_lists.items() if isinstance(k, tuple) and k[0] == "undo order"
        }
        assert undo and all(len(v) == k[1] * up.state.unit for k, v in undo.items()), undo
        order = up._undo_page_order_for(1)
        assert [p.data_ptr() for p in undo[("undo order", 1)].pages] == [
            up.undo[i].data_ptr() for i in order
        ]
    finally:
        client.close()


def test_a_lost_parity_buffer_is_avoided_only_by_the_update_resumed_after_it(pool):
    """Tier 2 of the update resumed after its buffer was lost is encoded from host tier
    1 (the buffer's bytes are gone); once that update is over, every buffer is written
    before it is read again, so no later update stages host tier 1 — on a GPU that read
    came right after the store's asynchronous copy to host and could see it half landed."""
    import dataclasses

    from faultkit import hooks
    from leto.memory.client import PoolClient

    cfg = UpdaterConfig(chunk_units=1)
    cfg = dataclasses.replace(cfg, adamw=dataclasses.replace(h.ADAMW, impl=cfg.adamw.impl),
                              muon=h.MUON)  # fmt: skip
    hooks.arm("update.tier2", 2, 1, mode="raise")
    client, up, model, t = h.start(pool, cfg)
    try:
        with pytest.raises(hooks.InjectedCrash):
            while t < ITERS:
                h.one_iteration(up, model, t)
                t += 1
    finally:
        hooks.disarm()
        client.close()
    with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
        lose(("data", "rmu.parity", list(range(6))))(f)
    staged = []
    real = h.Updater._refresh_tier2

    def spy(self, g, x):
        staged.append(x in self._stale)
        return real(self, g, x)

    h.Updater._refresh_tier2 = spy
    try:
        client, up, model, t = h.start(pool, cfg)  # finishes the update of iteration 2
        try:
            assert t == 3 and staged and staged[0], f"the resumed update read the lost buffer: {staged}"
            n = len(staged)
            h.one_iteration(up, model, t)
            assert not any(staged[n:]), f"a later update staged host tier 1: {staged}"
        finally:
            client.close()
    finally:
        h.Updater._refresh_tier2 = real
