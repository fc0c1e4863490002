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

from leto.memory.client import PoolClient
from leto.memory.config import AllocationKind
from leto.memory.errors import FencedError, PoolAuthError, PoolError, PoolProtocolError
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


def _faultkit(pool) -> PoolClient:
    return PoolClient.connect(pool.socket_path, pool.token, role="faultkit")


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
    t, want = _trainer(pool)
    s = _shadow(pool)
    s.premap()
    param = s.attach("param", SET[1][0])  # a view the promoted trainer keeps
    t1_group0 = s.layout()[0].tier1[1]
    with _faultkit(pool) as f:
        f.inject_loss("data", "param", [3, 17])
        f.inject_loss("tier1", "0", [1])
    t.close()  # the trainer is gone (a real one died)
    s.takeover()
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
    t, want = _trainer(pool)
    s = _shadow(pool)
    s.premap()
    with _faultkit(pool) as f:
        f.inject_loss("data", "exp_avg", [0])
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
