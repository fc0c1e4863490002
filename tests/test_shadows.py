"""The agent's shadows: at a fresh start beside the first trainers; after a recovery the
successors' start is held back until every local trainer of the new generation has
finished its first iteration after the recovery (or finished the job), so their start-up
does not compete with the recovered trainers — and never longer than ``DEFER_MAX_S``,
nor once a trainer asks for them.

Real store (torch's HashStore), the real monitor and the trainers' own heartbeat code;
cells are stand-ins that record which shadows they were asked to start."""

import time
from types import SimpleNamespace

import torch.distributed as dist

from leto.job.config import RunConfig
from leto.launch import shadows as shadows_mod
from leto.launch.monitor import Monitor
from leto.launch.shadows import Shadows
from leto.trainer.api import Context


class _Alive:
    def poll(self):
        return None


class _Cell(SimpleNamespace):
    def start_shadow(self, generation, level):
        self.started.append((generation, level))


def _job(n=2, generation=1):
    store = dist.HashStore()
    cfg = RunConfig(nproc_per_node=n, beat_poll_s=0.0, shadow_level="L2")
    cells = [
        _Cell(rank=r, active=_Alive(), active_error=lambda: None, started=[]) for r in range(n)
    ]
    monitor = Monitor(cfg, cells, store)
    sh = Shadows(cfg, cells)
    sh.store, sh.monitor = store, monitor
    trainers = [
        Context("active", r, n, r, generation, "L2", None, None, {}, store=store,
                env=SimpleNamespace(preinit=None))
        for r in range(n)
    ]  # fmt: skip
    return sh, monitor, cells, trainers


def _poll(sh, monitor, gen=1):
    monitor.failures(gen)  # reads every rank's beat, as the agent's loop does
    sh.start_due()


def test_successors_start_once_every_trainer_finished_its_first_iteration_after_recovery():
    sh, monitor, cells, trainers = _job()
    sh.after_recovery(1)
    _poll(sh, monitor)
    assert all(c.started == [] for c in cells)  # recovering: no beat yet
    for t in trainers:
        t.heartbeat(7)  # the first iteration after the regained one begins
    _poll(sh, monitor)
    assert all(c.started == [] for c in cells)
    trainers[0].heartbeat(8)  # rank 0 is done with it; rank 1 is not
    _poll(sh, monitor)
    assert all(c.started == [] for c in cells)
    trainers[1].heartbeat("done")  # the job's last iteration: finished counts as done
    _poll(sh, monitor)
    assert [c.started for c in cells] == [[(2, "L2")], [(2, "L2")]]
    _poll(sh, monitor)
    assert [len(c.started) for c in cells] == [1, 1]  # started once


def test_a_fresh_jobs_shadows_start_beside_the_first_trainers():
    # Not held back: a failure in a job's first seconds must meet a parked shadow.
    sh, monitor, cells, trainers = _job(generation=0)
    sh.start_first()
    assert [c.started for c in cells] == [[(1, "L2")], [(1, "L2")]]


def test_a_trainer_waiting_for_its_own_shadow_has_the_shadows_started_at_once():
    # Context.wait_shadow_parked (a script or faultkit's pressure job) in the first
    # iteration after a recovery, whose successors the agent holds back until the second.
    sh, monitor, cells, trainers = _job()
    sh.after_recovery(1)
    trainers[0].heartbeat(7)
    _poll(sh, monitor)
    assert all(c.started == [] for c in cells)
    assert trainers[0].wait_shadow_parked(0.05) is None  # (none parked: it gives up)
    sh._wanted_checked = 0.0
    _poll(sh, monitor)
    assert [c.started for c in cells] == [[(2, "L2")], [(2, "L2")]]


def _held_back():
    """A job after a recovery whose trainers are in their first iteration: the
    successors' shadows held back."""
    sh, monitor, cells, trainers = _job()
    sh.after_recovery(1)
    for t in trainers:
        t.heartbeat(7)
    _poll(sh, monitor)
    assert all(c.started == [] for c in cells)
    return sh, monitor, cells, trainers


def test_a_slow_first_iteration_does_not_hold_the_successors_past_the_cap(monkeypatch):
    monkeypatch.setattr(shadows_mod, "DEFER_MAX_S", 0.2)
    sh, monitor, cells, trainers = _held_back()
    time.sleep(0.25)
    _poll(sh, monitor)
    assert [c.started for c in cells] == [[(2, "L2")], [(2, "L2")]]


def test_a_trainer_waiting_for_parked_successors_has_them_started_at_once():
    # A fault plan's ``when: parked``: the trainer waits at the point, in its first
    # iteration, for shadows the agent holds back until its second — it asks for them
    # (``wait_successors_parked``), and the agent starts them at its next poll.
    sh, monitor, cells, trainers = _held_back()
    trainers[1].generation = 1
    assert trainers[1].wait_successors_parked(0.05) is False  # (none parked: it gives up)
    sh._wanted_checked = 0.0  # (the agent asks the store at most every 0.25 s)
    _poll(sh, monitor)
    assert [c.started for c in cells] == [[(2, "L2")], [(2, "L2")]]


class _Dead:
    def poll(self):
        return 1


def test_a_dead_l3_shadow_replaced_leaves_no_record_a_fault_plan_would_take_for_the_new_one():
    # A shadow whose set-up failed ahead had settled ("failed: ..."); a fault plan's
    # ``when: parked`` took that record for its replacement's and struck while the
    # replacements were still starting.
    from leto.job import keys

    sh, monitor, cells, trainers = _job()
    sh.level = "L3"
    for c in cells:
        c.shadow, c.shadow_generation, c.fallbacks = _Alive(), 2, 0
        c.drop_shadow = lambda c=c: setattr(c, "shadow", None)
    cells[0].shadow = _Dead()
    for r in (0, 1):
        sh.store.set(keys.parked(2, r), '{"pid": 1, "level": "L3"}')
        sh.store.set(
            keys.ahead_settled(2, r), "failed: the set-up raised" if r == 0 else "ran ahead"
        )
    sh.replace_dead(1)
    assert [c.started for c in cells] == [[(2, "L3")], [(2, "L3")]]  # every rank's, at L3
    left = [k for r in (0, 1) for k in (keys.parked(2, r), keys.ahead_settled(2, r))
            if sh.store.check([k])]  # fmt: skip
    assert left == []


class _Proc:
    def __init__(self, alive=True):
        self.alive = alive

    def poll(self):
        return None if self.alive else -9


class _RecoveryCell(SimpleNamespace):
    """A cell as a recovery drives it: fence, drop, start and promote shadows (recorded)."""

    def fence(self):
        self.events.append("fence")

    def drop_shadow(self):
        self.events.append(("drop", self.shadow is not None and self.shadow.alive))
        self.shadow = None

    def start_shadow(self, generation, level):
        self.shadow = _Proc()
        self.shadow_generation = generation
        self.events.append(("start", generation, self.pg_attempt))

    def promote(self, fault=None):
        assert self.shadow is not None and self.shadow.alive
        self.events.append(("promote", self.shadow_generation, self.pg_attempt))
        self.shadow = None


def _recovery(shadows_alive):
    from leto.launch.recovery import Recovery

    store = dist.HashStore()
    cfg = RunConfig(nproc_per_node=len(shadows_alive), shadow_level="L3")
    cells = [
        _RecoveryCell(rank=r, shadow=_Proc(a), shadow_generation=2, pg_attempt="0.0",
                      fallbacks=0, events=[])
        for r, a in enumerate(shadows_alive)
    ]  # fmt: skip
    sh = Shadows(cfg, cells)
    sh.store = store
    return Recovery(cfg, cells, store, sh, faults=[]), cells


def test_a_recovery_at_l3_with_a_shadow_just_dead_restarts_every_shadow_in_a_fresh_namespace():
    # The shadow died after the agent last looked (its set-up failed ahead, say) and the
    # failure came first: a fresh shadow alone would meet, in the old namespace, a group
    # the live ones formed with the dead one.
    rec, cells = _recovery([False, True])
    rec.in_place(1, detected_at=0.0)
    for c in cells:
        assert c.events[0] == "fence"
        assert c.events[-2:] == [("start", 2, "0.1"), ("promote", 2, "0.1")], c.events


def test_a_recovery_at_l3_with_every_shadow_alive_promotes_them_as_they_are():
    rec, cells = _recovery([True, True])
    rec.in_place(1, detected_at=0.0)
    assert [c.events for c in cells] == [["fence", ("promote", 2, "0.0")]] * 2
