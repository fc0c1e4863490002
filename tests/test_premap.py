"""Premapping: a parked shadow maps the pool ahead of its promotion, and a page that
localization replaced is mapped again before anything can touch it.

A real state-manager process; the trainer and the shadow are two clients in this
process (the state manager fences by pid, so taking over from a client of the same
process kills nothing). Lost pages use the CPU build's emulation (a truncated memfd:
the old mapping raises SIGBUS when touched), so a view left on a lost page would crash
this test rather than read stale bytes. Bit-exact comparisons throughout.
"""

from __future__ import annotations

import pytest
import torch

from leto.memory import client as client_module
from leto.memory.client import PoolClient
from leto.memory.config import AllocationKind
from leto.memory.errors import FencedError, PoolAuthError, PoolError, PoolProtocolError
from leto.memory.host_pages import populate_read
from leto.memory.launch import start_state_manager
from tests.pool_helpers import PAGE, pattern, small_config

SET = (["param", "exp_avg"], [40 * PAGE, 40 * PAGE], [1, 1])


@pytest.fixture
def pool():
    sm = start_state_manager(small_config())
    yield sm
    assert sm.stop() == 0


def _trainer(pool) -> tuple[PoolClient, dict[str, torch.Tensor]]:
    t = PoolClient.connect(pool.socket_path, pool.token, takeover=True)
    t.attach_set(*SET)
    want = {}
    for seed, (name, n) in enumerate(zip(SET[0], SET[1], strict=True)):
        want[name] = pattern(n, seed)
        t.attach(name, n).copy_(want[name])
    t.attach("marker", 128, kind=AllocationKind.RECORD)[:] = 7
    t.encode_parity()
    return t, want


def _shadow(pool) -> PoolClient:
    return PoolClient.connect(pool.socket_path, pool.token, role="shadow")


def _parked(pool) -> tuple[PoolClient, dict[str, torch.Tensor], PoolClient]:
    """The trainer with its state written, and a shadow that premapped it."""
    t, want = _trainer(pool)
    s = _shadow(pool)
    s.premap()
    return t, want, s


def _faultkit(pool) -> PoolClient:
    return PoolClient.connect(pool.socket_path, pool.token, role="faultkit")


def _lose(pool, *losses: tuple[str, str, list[int]]) -> None:
    with _faultkit(pool) as f:
        for target, name, pages in losses:
            f.inject_loss(target, name, pages)


def _promote(s: PoolClient, t: PoolClient) -> None:
    t.close()  # the trainer is gone (a real one died)
    s.takeover()


def test_a_premapped_shadow_attaches_without_importing_and_sees_the_trainers_bytes(pool):
    t, want = _trainer(pool)
    s = _shadow(pool)
    assert s.premap() == 3 and sorted(s.mapped) == ["exp_avg", "marker", "param"]
    late = t.attach("late", 3 * PAGE, kind=AllocationKind.REUSABLE)  # after the premap
    assert s.premap() == 1 and "late" in s.mapped  # the next tick maps it
    assert s.premap() == 0  # nothing new: nothing mapped twice
    # Every mapping's page views were made while parked (cached: the layout at
    # promotion reuses them instead of making ~one view a page).
    made = {n: m.__dict__.get("pages") for n, (m, _, _) in s._maps.items()}
    assert all(v is not None for v in made.values()), made
    assert all("pages" in m.__dict__ for _, m in s._parity)
    s.takeover()
    assert s.localize()["allocations"] == {} and s.remapped == 0
    # The set and every allocation come from the premapped view: same pages, no Alloc.
    reply = s.attach_set(*SET)
    assert reply.units == 40 and reply.first_group == 0
    for name, n in zip(SET[0], SET[1], strict=True):
        assert torch.equal(s.attach(name, n), want[name])
    late.fill_(5)  # the (now fenced) trainer's view and the shadow's are the same pages
    assert torch.equal(s.attach("late", 3 * PAGE, kind=AllocationKind.REUSABLE), late)
    views = s.layout()
    assert all(len(g.tier1) == 4 for g in views if g.kind == "set")
    name, first, _ = views[0].members[0]
    assert views[0].data[0] is made[name][first]  # the views made while parked
    s.close()
    t.close()


def test_an_allocation_made_between_the_premap_reply_and_its_layout_is_mapped_next_tick(pool):
    # The interleaving an H200 run hit: the trainer attaches a protected allocation after
    # the state manager answered PREMAP and before the shadow asked for the groups, so
    # the groups name an allocation the shadow has not mapped. That is not an error: the
    # parity is mapped now, the allocation at the next tick.
    t, want = _trainer(pool)
    s = _shadow(pool)
    map_parity = s._map_parity

    def trainer_allocates_first():
        t.attach("grad", 20 * PAGE).copy_(pattern(20 * PAGE, 9))
        return map_parity()

    s._map_parity = trainer_allocates_first
    assert s.premap() == 3 and "grad" not in s.mapped
    s._map_parity = map_parity
    assert s.premap() == 1 and "grad" in s.mapped
    t.encode_parity()
    s.takeover()
    assert s.localize()["allocations"] == {}
    views = s.layout()  # every group's members are mapped now
    assert any("grad" in [m[0] for m in g.members] for g in views)
    assert torch.equal(s.attach("grad", 20 * PAGE), pattern(20 * PAGE, 9))
    s.close()
    t.close()


def test_pages_lost_before_the_promotion_are_mapped_again_then_rebuilt_exactly(pool):
    t, want, s = _parked(pool)
    param = s.attach("param", SET[1][0])  # a view the promoted trainer keeps
    t1_group0 = s.layout()[0].tier1[1]
    _lose(pool, ("data", "param", [3, 17]), ("tier1", "0", [1]))
    _promote(s, t)
    report = s.localize()
    assert report["allocations"]["param"]["failed_pages"] == [3, 17]
    assert s.remapped == 3  # two data pages, one tier-1 page
    # Same addresses, fresh zeroed pages: the old (truncated) ones are no longer mapped.
    assert param.data_ptr() == s.pages_of("param").data_ptr()
    assert int(param[3 * PAGE : 4 * PAGE].count_nonzero()) == 0
    assert int(t1_group0.count_nonzero()) == 0
    s.reconstruct(report)
    assert torch.equal(param, want["param"])
    # The page views made while parked (before the loss) read the rebuilt pages too.
    page3 = s._maps["param"][0].pages[3]
    assert torch.equal(page3, want["param"].view(torch.uint8)[3 * PAGE : 4 * PAGE])
    assert torch.equal(s.attach("exp_avg", SET[1][1]), want["exp_avg"])
    t1 = s.layout()[0].tier1[1]
    s.encode_parity()  # tier 1 page 1 of group 0 was rebuilt too: encoding agrees
    assert torch.equal(t1, s.layout()[0].tier1[1])
    s.close()


def test_pages_replaced_while_the_shadow_was_parked_are_remapped_on_its_next_tick(pool):
    # A shadow that premapped before another trainer's recovery replaced pages (the
    # successor of a failed trainer localizes while the next shadow is parked).
    t, want, s = _parked(pool)
    _lose(pool, ("data", "exp_avg", [0]))
    t.close()
    successor = PoolClient.connect(pool.socket_path, pool.token, takeover=True)
    report = successor.localize()
    successor.attach_set(*SET)
    successor.attach("marker", 128, kind=AllocationKind.RECORD)
    successor.reconstruct(report)
    assert s.premap() == 0 and s.remapped == 1  # the tick follows the replacement log
    assert torch.equal(s.pages_of("exp_avg")[: SET[1][1]], want["exp_avg"])
    successor.attach("exp_avg", SET[1][1])[:PAGE] = 9  # one memory, both views
    assert int(s.pages_of("exp_avg")[:PAGE].unique().item()) == 9
    successor.close()
    s.close()


def test_a_shadow_may_only_map_and_the_trainer_may_not_premap(pool):
    t, _ = _trainer(pool)
    s = _shadow(pool)
    with pytest.raises(PoolAuthError, match="trainer role required"):
        s.attach("new", PAGE)
    with pytest.raises(PoolAuthError, match="trainer role required"):
        s.localize()
    with pytest.raises(PoolError, match="premap is for a parked shadow"):
        t.premap()
    s.premap()
    # A shadow's request naming a cursor the log never had is refused, nothing changed.
    from leto.memory import protocol as P

    with pytest.raises(PoolProtocolError, match="replacement cursor 99"):
        P.request(s.sock, P.Replaced(s.epoch, 99), P.ReplacedReply)
    s.takeover()
    with pytest.raises(FencedError, match="stale"):
        t.attach("new", PAGE)  # the old trainer is fenced by the new epoch
    s.close()
    t.close()


def test_a_deferred_parity_scan_completes_the_report_before_parity_is_used(pool):
    # A premapped trainer localizes the data pages, binds its state while the host
    # parity scan runs, then settles: the lost parity page is remapped and pending, and
    # the rebuild is bit-exact.
    t, want, s = _parked(pool)
    t1_group0 = s.layout()[0].tier1[1]
    _lose(pool, ("data", "param", [3]), ("tier1", "0", [1]))
    _promote(s, t)
    report = s.localize(defer_parity=True)
    assert report["parity"] == "deferred" and s.localizing
    assert report["allocations"]["param"]["failed_pages"] == [3]
    (slot,) = report["groups"]["0"]["data"]  # param's page 3, in the group's order
    assert report["groups"] == {"0": {"data": [slot], "tier1": [], "tier2": []}}
    assert s.remapped == 1  # the data page only, so far
    s.attach_set(*SET)  # binding: served from the premapped views, parity untouched
    s.layout()  # every group known: served while the scan runs
    done = s.settle_localize()
    assert done is report and "parity" not in report and not s.localizing
    assert report["groups"] == {"0": {"data": [slot], "tier1": [1], "tier2": []}}
    assert report["parity_s"] > 0 and report["parity_wait_s"] >= 0
    assert report["parity_landed_by"] == "LOCALIZE_PARITY"  # binding did not land it
    assert report["seconds"] == pytest.approx(report["data_s"] + report["parity_s"])
    assert s.remapped == 2 and int(t1_group0.count_nonzero()) == 0  # fresh page, same view
    s.reconstruct(report)
    assert torch.equal(s.attach("param", SET[1][0]), want["param"])
    t1 = t1_group0.clone()
    s.encode_parity()  # the rebuilt tier-1 page agrees with a fresh encoding
    assert torch.equal(t1, t1_group0)
    with pytest.raises(PoolError, match="no deferred localization"):
        s.settle_localize()
    s.close()


def test_a_request_that_could_see_parity_lands_a_deferred_scan_first(pool):
    # An allocation made before the trainer settles (the server settles the scan first:
    # the new group's layout would hand out parity pages), then a trainer that dies
    # before settling: its successor's localization reports the lost parity page.
    t, want, s = _parked(pool)
    _lose(pool, ("tier2", "0", [0]))
    _promote(s, t)
    assert s.localize(defer_parity=True)["groups"] == {}
    s.attach("grad", 20 * PAGE).copy_(pattern(20 * PAGE, 9))  # ALLOC: the scan lands
    report = s.settle_localize()  # what it found is kept for the trainer's settle
    assert report["groups"] == {"0": {"data": [], "tier1": [], "tier2": [0]}}
    assert report["parity_landed_by"] == "ALLOC"
    assert s.remapped == 1
    s.close()
    s2 = _shadow(pool)
    s2.premap()
    _lose(pool, ("tier1", "0", [2]))
    s2.takeover()
    s2.localize(defer_parity=True)
    with PoolClient.connect(pool.socket_path, pool.token, role="observer") as o:
        # STATUS lands the scan: its counts include the lost parity page.
        assert o.status()["groups"][0]["pending"]["tier1"] == [2]
    s2.close()  # dies with the scan unsettled
    cold = PoolClient.connect(pool.socket_path, pool.token, takeover=True)
    with pytest.raises(PoolError, match="only a premapped client"):
        cold.localize(defer_parity=True)
    report = cold.localize()
    assert report["groups"]["0"] == {"data": [], "tier1": [2], "tier2": [0]}
    assert "parity" not in report and report["parity_s"] > 0
    cold.attach_set(*SET)
    cold.attach("grad", 20 * PAGE)
    cold.attach("marker", 128, kind=AllocationKind.RECORD)
    cold.reconstruct(report)
    for name, n in zip(SET[0], SET[1], strict=True):
        assert torch.equal(cold.attach(name, n), want[name])
    cold.close()


def _host_table():
    """The state manager's table on host pages, with a 3-page protected allocation "w";
    (its device-page owner, the table)."""
    from leto.memory.backends.host import HostPageOwner
    from leto.memory.state_manager.table import Table
    from tests.pool_helpers import small_config

    owner = HostPageOwner(PAGE)
    table = Table(small_config(), owner, HostPageOwner(PAGE), HostPageOwner(PAGE))
    table.alloc("w", AllocationKind.PROTECTED.value, 3 * PAGE)
    return owner, table


def test_a_parity_scan_past_its_timeout_stays_pending_and_a_failed_one_is_dropped():
    # The state manager's table: settling waits at most the given time (the pool's I/O
    # timeout by default), replaces nothing until the scan is done, and a scan that
    # failed is raised once (the next localization scans everything again).
    import threading

    from leto.memory.errors import PoolTimeout

    _, table = _host_table()
    try:
        gate = threading.Event()
        real = table.parity_owner.failed_pages

        def slow(mapping):
            assert gate.wait(10)
            return real(mapping)

        table.parity_owner.failed_pages = slow
        assert table.localize(defer_parity=True)["parity"] == "deferred"
        with pytest.raises(PoolTimeout, match="did not finish within 0.05 s"):
            table.settle_parity(0.05)
        assert table.parity_scan_pending
        gate.set()
        assert table.settle_parity()["groups"] == {} and not table.parity_scan_pending
        assert table.settle_parity() is None  # nothing running

        def broken(mapping):
            raise OSError(5, "scanning: I/O error")

        table.parity_owner.failed_pages = broken
        table.localize(defer_parity=True)
        with pytest.raises(OSError, match="I/O error"):
            table.settle_parity(by="ALLOC")  # another request landed it
        assert not table.parity_scan_pending
        # Kept for the trainer's LOCALIZE_PARITY, which is refused with it (the server).
        assert table.parity_result == {
            "error": "the host parity scan failed: [Errno 5] scanning: I/O error"
        }
        table.localize(defer_parity=True)  # a new scan forgets it, and fails again
        assert table.parity_result is None
        table.parity_owner.failed_pages = real
        assert table.localize()["groups"] == {}  # lands the failed one quietly, scans anew
    finally:
        table.close()


def test_settling_without_a_deferred_localization_is_refused_by_the_state_manager(pool):
    from leto.memory import protocol as P

    t = PoolClient.connect(pool.socket_path, pool.token, takeover=True)
    t.localize()
    with pytest.raises(PoolError, match="no deferred localization to settle; LOCALIZE first"):
        P.request(t.sock, P.LocalizeParity(t.epoch), P.Localized)
    t.close()


class _PinningDriver:
    """The driver's page-locking of host memory, as it behaves on the H200: registering
    a range faults every page of it in, and fails with 1 (CUDA_ERROR_INVALID_VALUE) when
    one cannot be (a lost page: the truncated memfd's mapping); a range overlapping a
    registered one fails with 712 (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)."""

    def __init__(self):
        self.pinned: dict[int, int] = {}
        self.registered = 0

    def pin(self, index: int, ptr: int, n: int) -> int:
        if any(p < ptr + n and ptr < p + m for p, m in self.pinned.items()):
            return 712
        if populate_read(ptr, n) != 0:
            return 1
        self.pinned[ptr] = n
        self.registered += 1
        return 0

    def unpin(self, index: int, ptr: int) -> int:
        return 0 if self.pinned.pop(ptr, None) is not None else 713


def test_a_pinned_parity_mapping_that_lost_several_pages_is_pinned_again_once_all_are_replaced(
    pool, monkeypatch
):
    # The fatal path's case on the H200 (a protection group lost more host parity
    # pages than H1): the parked shadow had page-locked its parity. Pinning it again
    # after the first replaced page, with the others still lost, failed the promotion.
    driver = _PinningDriver()
    monkeypatch.setattr(client_module, "pin_host", driver.pin)
    monkeypatch.setattr(client_module, "unpin_host", driver.unpin)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # close()'s, before unpinning
    t, want, s = _parked(pool)
    s.register_host(s.parity_mapping(0))  # what premap does on a CUDA pool
    tier1 = s.layout()[0].tier1
    _lose(pool, ("tier1", "0", [0, 1, 3]))
    _promote(s, t)
    report = s.localize(defer_parity=True)
    s.settle_localize()
    assert report["groups"]["0"]["tier1"] == [0, 1, 3] and s.remapped == 3
    assert list(driver.pinned) == [s.parity_mapping(0).data_ptr()]  # pinned again, once
    assert driver.registered == 2
    assert all(int(tier1[j].count_nonzero()) == 0 for j in (0, 1, 3))  # the fresh pages
    s.reconstruct(report)
    for name, n in zip(SET[0], SET[1], strict=True):
        assert torch.equal(s.attach(name, n), want[name])
    s.close()
    assert driver.pinned == {}


def test_a_cuda_driver_error_while_premapping_costs_the_shadow_only_its_head_start(
    pool, monkeypatch, capsys
):
    # Importing or pinning a page can fail in the CUDA driver (CudaError, not a pool
    # error): the parked shadow drops its premapped view and attaches cold at promotion.
    from leto.memory.backends.cuda import CudaError
    from leto.trainer.premap import Premap

    t, _ = _trainer(pool)

    class DriverError(CudaError):  # as the driver raises it, without a driver here
        def __init__(self):
            RuntimeError.__init__(self, "premapping: importing page 0: CUDA_ERROR_OUT_OF_MEMORY")

    def failing(self):
        raise DriverError()

    monkeypatch.setattr(PoolClient, "premap", failing)
    p = Premap(pool.socket_path, pool.token, 10.0, rank=0)
    p.tick()  # does not raise
    assert p.client is None and "CUDA_ERROR_OUT_OF_MEMORY" in p.why_not
    assert "will attach cold" in capsys.readouterr().err
    assert p.promote() is None and p.summary()["premapped"] is False
    t.close()


def test_a_localization_failing_part_way_leaves_each_replaced_page_marked_and_no_page_leaked():
    # No memory for the second fresh page (or a driver error mapping one): the first,
    # already zeroed in place of retained state, must stay known, and the fresh page
    # that never made it into the mapping is released.
    owner, table = _host_table()
    try:
        table.inject("data", "w", [0, 1, 2])
        created, released = [], []
        real_create, real_release, real_replace = owner.create, owner.release, owner.replace

        def create():
            if len(created) == 1:
                raise OSError(12, "cannot allocate a fresh page")
            created.append(real_create())
            return created[-1]

        def release(h):
            released.append(h)
            real_release(h)

        owner.create, owner.release = create, release
        with pytest.raises(OSError, match="cannot allocate a fresh page"):
            table.localize()
        assert table._pending() == {"0": {"data": [0], "tier1": [], "tier2": []}}
        assert table.replaced == [("data", "w", 0)] and table.allocations["w"].pages[0] is created[0]

        def refused(mapping, i, h):
            raise RuntimeError("mapping a fresh page: CUDA_ERROR_INVALID_VALUE")

        owner.create, owner.replace = lambda: created.append(real_create()) or created[-1], refused
        with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
            table.localize()
        assert released[-1] is created[-1]  # released, not leaked
        assert created[-1] not in table.allocations["w"].pages
        assert table.replaced == [("data", "w", 0)]

        owner.replace = real_replace
        report = table.localize()  # memory back: the rest found, all named
        assert report["allocations"]["w"]["failed_pages"] == [1, 2]
        assert report["groups"]["0"]["data"] == [0, 1, 2]
    finally:
        table.close()
