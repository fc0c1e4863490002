"""The agent's monitor: a stalled heartbeat is a hang after ``hang_timeout_s`` — except
while a trainer of the generation is in its process's first iteration (compiling), when
every rank is held to the general ``timeout_s``, since its peers stall behind it.

Real store (torch's HashStore) and the trainer's own heartbeat code (``Context``); the
trainers are stand-ins that only say they are alive."""

import json
import time
from types import SimpleNamespace

import torch.distributed as dist

from leto.job import keys
from leto.job.config import RunConfig
from leto.launch.monitor import FailureKind, Monitor
from leto.trainer.api import Context

HANG_S, TIMEOUT_S = 0.3, 1.5


class _Alive:
    def poll(self):
        return None


def _cells(n):
    return [SimpleNamespace(rank=r, active=_Alive(), active_error=lambda: None) for r in range(n)]


def _trainer(store, rank, gen=0):
    env = SimpleNamespace(preinit=None)
    return Context("active", rank, 2, rank, gen, "L2", None, None, {}, store=store, env=env)


def _hangs_after(monitor, gen, within_s):
    """Seconds until the monitor reports a hang (None: none within ``within_s``), and whom."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        hung = [f.rank for f in monitor.failures(gen) if f.kind is FailureKind.HANG]
        if hung:
            return time.monotonic() - t0, hung
        time.sleep(0.02)
    return None, []


def _monitor(store, n=2):
    cfg = RunConfig(nproc_per_node=n, beat_poll_s=0.0, hang_timeout_s=HANG_S, timeout_s=TIMEOUT_S)
    return Monitor(cfg, _cells(n), store)


def test_a_first_iteration_is_held_to_the_general_timeout_on_every_rank():
    store = dist.HashStore()
    ranks = [_trainer(store, r) for r in range(2)]
    for c in ranks:
        c.heartbeat(0)  # both in their first iteration (rank 1 compiling, rank 0 waiting)
    m = _monitor(store)
    took, hung = _hangs_after(m, 0, TIMEOUT_S + 1.0)
    # Not after the hang timeout: only after the general one (a first iteration that
    # truly hangs is still caught).
    assert took is not None and took >= TIMEOUT_S - 0.1, (took, hung)


def test_after_the_first_iteration_the_hang_timeout_applies_again():
    store = dist.HashStore()
    ranks = [_trainer(store, r) for r in range(2)]
    for t in (0, 1):
        for c in ranks:
            c.heartbeat(t)
    assert int(store.add(keys.warming(0), 0)) == 0
    m = _monitor(store)
    ranks[0].heartbeat(2)  # rank 1 stalls in iteration 1; rank 0 waits in 2
    took, hung = _hangs_after(m, 0, TIMEOUT_S)
    assert took is not None and took < TIMEOUT_S - 0.3, took
    assert hung == [1], hung  # the rank with the oldest beat, not the one waiting for it


def test_a_promoted_trainers_first_iteration_holds_its_survivors_too():
    # Generation 1 after a recovery: rank 0 survived (long past its first iteration),
    # rank 1 is a promoted shadow compiling its model: rank 0 waits for it, unblamed.
    store = dist.HashStore()
    survivor = _trainer(store, 0, gen=0)
    survivor.heartbeat(0)
    survivor.heartbeat(1)
    survivor.generation = 1
    survivor.heartbeat(2)
    promoted = _trainer(store, 1, gen=1)
    promoted.heartbeat(2)
    assert int(store.add(keys.warming(1), 0)) == 1
    m = _monitor(store)
    took, _ = _hangs_after(m, 1, HANG_S * 3)
    assert took is None, took
    promoted.heartbeat(3)  # its first iteration is over: the hang timeout is back
    assert int(store.add(keys.warming(1), 0)) == 0
    took, hung = _hangs_after(m, 1, TIMEOUT_S)
    assert took is not None and took < TIMEOUT_S - 0.3 and hung == [0], (took, hung)


def test_a_recoverable_failure_on_every_rank_is_recovered_not_a_script_error(tmp_path):
    """A replay mismatch is raised on every rank at once: each trainer exits
    EXIT_RECOVERABLE with its error file, and no such exit reads as a script error (two
    identical ones in one generation used to stop the job "again at the same place")."""
    import json
    import subprocess
    import sys

    from leto.errors import EXIT_RECOVERABLE
    from leto.launch.monitor import Failure

    err = tmp_path / "rank0.error.json"
    code = (
        "from leto.trainer.exit_hook import record_uncaught\n"
        "from leto.integrity.replay import ReplayMismatch\n"
        f"record_uncaught({str(err)!r})\n"
        "raise ReplayMismatch('iteration 2: rank 0 computed wrong', iteration=2, named=[0])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == EXIT_RECOVERABLE, proc.stderr.decode()
    record = json.loads(err.read_text())
    assert record["exception"] == "ReplayMismatch"
    assert record["iteration"] == 2 and record["named"] == [0]  # the agent's tally reads them
    dead = [Failure(r, FailureKind.EXIT, EXIT_RECOVERABLE, record) for r in (0, 1)]
    assert not any(f.script_error for f in dead)
    assert Failure(0, FailureKind.EXIT, 1, record).script_error  # any other exit code is
    # The agent recovers it in place; the same one in a later generation (a device that
    # computes wrong every time) stops the job instead of looping.
    from leto.launch.agent import Agent

    agent = Agent(RunConfig(nproc_per_node=2, log_dir=str(tmp_path)), ["train.py"])
    assert agent._script_error(0, dead) is None
    why = agent._script_error(1, dead[:1])
    assert why is not None and "again at the same place after a recovery in place" in why, why
    assert "generations 0 and 1" in why, why


def test_peers_broken_collectives_wait_for_the_rank_that_broke_them(tmp_path, monkeypatch):
    # Seen in CI: rank 1 calls sys.exit(3); its connections close before its process is
    # gone, so rank 0's "Connection closed by peer" was seen a poll earlier and a
    # recovery began — the job should have stopped with rank 1's code 3 instead.
    from leto.job.config import RunConfig as Cfg
    from leto.launch import agent as agent_module
    from leto.launch.agent import Agent
    from leto.launch.monitor import Failure

    gloo = {"exception": "RuntimeError", "message": "[gloo/transport/tcp/pair.cc:553] "
            "Connection closed by peer [127.0.0.1]:10159. This is typically caused by a "
            "remote worker crashing."}  # fmt: skip
    broken = Failure(0, FailureKind.EXIT, 1, gloo)
    assert broken.collateral
    assert not Failure(1, FailureKind.EXIT, 3).collateral  # the script's own exit
    assert not Failure(1, FailureKind.EXIT, -9).collateral  # a crash
    other = {"exception": "ValueError", "message": "a batch of shape (4, 5)"}
    assert not Failure(0, FailureKind.EXIT, 1, other).collateral
    assert not Failure(0, FailureKind.HANG).collateral

    store = dist.HashStore()
    agent = Agent(Cfg(nproc_per_node=2, log_dir=str(tmp_path)), ["train.py"])
    now = [100.0]
    monkeypatch.setattr(agent_module.time, "monotonic", lambda: now[0])
    assert agent._hold([broken], store, 0)  # held: its cause not seen yet
    now[0] += agent_module.PEER_GRACE_S - 0.1
    assert agent._hold([broken], store, 0)
    assert not agent._hold([broken, Failure(1, FailureKind.EXIT, 3)], store, 0)  # there
    assert agent._hold([broken], store, 1)  # a new generation, a new wait
    now[0] += agent_module.PEER_GRACE_S
    assert not agent._hold([broken], store, 1)  # never seen: on without it, bounded
    store.add(keys.failures(2), 1)  # another node reported this generation's failure
    assert not agent._hold([broken], store, 2)
    # A promoted trainer's fatal exit (pages beyond parity) before training began, and its
    # peer's collective broken by it: the checkpoint fallback, not a script error (seen in
    # CI: the peer's RuntimeError stopped the job).
    from leto.errors import EXIT_FATAL

    fatal = {"exception": "TooManyErasures", "message": "protection group 0: 5 pages lost"}
    agent.store = store
    dead = [Failure(0, FailureKind.EXIT, EXIT_FATAL, fatal), Failure(1, FailureKind.EXIT, 1, gloo)]
    assert agent._script_error(3, dead) is None
    assert "before it began training" in agent._script_error(
        3, [Failure(1, FailureKind.EXIT, 1, other)]
    )


def test_the_iteration_count_is_the_trainers_not_the_beats_the_monitor_saw():
    # A fast loop: the monitor polls at iterations 0-2 only, the trainer runs 30. The
    # count comes from the trainer's last pace (what the agent's summary reads).
    store = dist.HashStore()
    trainer = _trainer(store, 0)
    m = _monitor(store)
    for it in range(30):
        trainer.heartbeat(it)
        if it < 3:
            time.sleep(0.01)
            m.failures(0)
    assert m.ettr()["iterations"] == 3  # what the polled beats alone say
    last = json.loads(store.get(keys.pace(0, 0)))["iteration"]
    assert m.ettr(last + 1)["iterations"] == 30


def test_a_trainer_started_under_an_earlier_ones_name_does_not_inherit_its_error(tmp_path):
    # Seen in a run-ahead job: a parked shadow whose set-up raised was replaced in its
    # generation; the replacement, promoted and later killed by the fault plan, was
    # reported as "exited with -9: RuntimeError ..." from the first one's error file (and
    # a kill before its training began would have stopped the job as a script error).
    import json

    from leto.launch.cell import Cell
    from tests.pool_helpers import small_config

    cell = Cell(RunConfig(nproc_per_node=1, log_dir=str(tmp_path)), 0, 0, ["-c", "pass"],
                small_config())  # fmt: skip
    try:
        stale = cell.error_file(1, "shadow")
        stale.write_text(json.dumps({"exception": "RuntimeError", "message": "the first one's"}))
        cell.start_shadow(1, "L1")
        cell.shadow.wait(timeout=60)
        cell.active, cell.active_generation, cell.active_role = cell.shadow, 1, "shadow"
        assert cell.active_error() is None  # the new trainer raised nothing
        kept = tmp_path / "rank0.gen1.shadow.error.1.json"
        assert json.loads(kept.read_text())["message"] == "the first one's"
        stale.write_text("{}")
        cell.start_shadow(1, "L1")  # again: numbered on
        cell.shadow.wait(timeout=60)
        assert (tmp_path / "rank0.gen1.shadow.error.2.json").exists() and not stale.exists()
    finally:
        cell.active = None
        cell.stop()
