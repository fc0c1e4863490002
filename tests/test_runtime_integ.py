"""``leto run`` end to end on the CPU build (world size 2): faults at random phases with
shadows at each level, two agents as two nodes over loopback, a shadow that dies while
parked — every run compared with a fault-free one by the verifiers, byte for byte."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from faultkit.hooks import POINTS
from faultkit.job import finish_job, shadow_pids, start_job
from leto.trainer.checkpoint import latest
from leto.trainer.first_iteration import STAGES
from leto.workload.train import TrainConfig
from verifiers import compare

ITERS = 5
CFG = TrainConfig(iterations=ITERS)
pytestmark = pytest.mark.integ


def leto_run(
    work: Path,
    level: str,
    faults=(),
    nnodes: int = 1,
    nproc: int = 2,
    wait: bool = True,
    extra: tuple[str, ...] = (),
    iters: int = ITERS,
):
    """The job (``faultkit.job``, the one way jobs start) with a raw fault plan; the
    agents' summaries, or their processes with ``wait=False``."""
    cfg = TrainConfig(iterations=iters)
    procs = start_job(nproc * nnodes, cfg, work, list(faults), shadow_level=level,
                      extra=extra, nnodes=nnodes)  # fmt: skip
    if not wait:
        return procs
    return finish(procs)


def finish(procs) -> list[dict]:
    outs = []
    for code, summary in finish_job(procs, timeout_s=240):
        assert code == 0, f"leto run exited {code}: {summary}"
        outs.append(summary)
    return outs


@pytest.fixture(scope="module")
def reference(job_reference):
    return Path(job_reference(2, CFG)["out"])


def plan(seed: int, n: int = 2) -> list[dict]:
    """n failures in successive generations at random ranks, phases and iterations."""
    rng = random.Random(seed)
    points = [p for p in POINTS if p != "gather"]
    its = sorted(rng.sample(range(1, ITERS), n))
    return [
        {"generation": g, "rank": rng.randrange(2), "at": f"{rng.choice(points)}@{it}#1"}
        for g, it in enumerate(its)
    ]


# (L3, leto run's default, is the CI matrix's level: every one of its 40 cases recovers
# through an L3 shadow.)
@pytest.mark.parametrize("level,seed", [("L1", 1), ("L2", 3), ("off", 4)])
def test_two_failures_recover_exactly_at_each_shadow_level(reference, tmp_path, level, seed):
    faults = plan(seed)
    if level == "L2":  # lost pages at a promotion of premapped shadows
        faults[0].update(lose_pages=1, host_parity_pages=1)
    (summary,) = leto_run(tmp_path, level, faults)
    v = compare(reference, tmp_path / "train")
    assert v.exact, f"{faults}: {v.describe()}"
    assert summary["failures"] == 2, summary
    for rec, f in zip(summary["recoveries"], faults, strict=True):
        assert rec["failed_ranks"] == [f["rank"]], (rec, f)
        assert set(rec["trainers"]) == {"0", "1"}, rec  # both ranks resumed and said so
        steps = {"map_retained_s", "reconstruct_s", "agree_s", "finish_update_s"}
        assert all(steps <= set(t) for t in rec["trainers"].values()), rec["trainers"]
        roles = {t["role"] for t in rec["trainers"].values()}
        assert roles == ({"active"} if level == "off" else {"promoted"}), roles
        # A promoted trainer whose pool held its state did not initialize the model
        # the state overwrote (leto.trainer.skip_init) — and the run is still EXACT.
        if level != "off":
            g = rec["generation"] + 1
            for r in (0, 1):
                log = (tmp_path / "logs" / f"rank{r}.gen{g}.shadow.log").read_text()
                assert "model set-up:" in log and "skipped" in log, (r, g, log[-2000:])
        # Recovery as the paper measures it: I (to the loop), R (to the interrupted
        # iteration done again, less what was still ahead of it), every stage timed.
        if all("loop_at" in t for t in rec["trainers"].values()):
            assert rec["init_s"] > 0 and rec["recompute_s"] >= 0, rec
            assert rec["regained_s"] == pytest.approx(rec["init_s"] + rec["recompute_s"])
            assert rec["regained_s"] >= rec["recovery_s"] - 0.05, rec  # ends later
            assert rec["first_iteration_s"] > 0, rec
            # (unknown where the failed generation ran fewer than three iterations)
            assert rec.get("steady_iteration_s", 1.0) > 0, rec
            for t in rec["trainers"].values():
                assert set(t["stages"]) == set(STAGES), t["stages"]
                if t["resumed_by"] == "finish":
                    assert rec["recompute_s"] == 0 or len(rec["trainers"]) > 1, rec
        # The fault plan's emulated page loss timed on its own, inside the promotion
        # (a real loss costs no such time); none when nothing was lost.
        if sum(rec.get("pages_lost", {}).get(k, 0) for k in ("device", "host")):
            assert 0 < rec["losing_s"] <= rec["promotion_s"], rec
        else:
            assert "losing_s" not in rec, rec
        # The script's warm-up (one block's step) ran in each L2/L3 shadow while it
        # parked, and cleanly; an L1 shadow parks before the device is up: none.
        # So did the tools' (the verifiers' digest: hashing threads, staging buffers).
        warmed = [
            ("warmup_s" in t, "tools_warmup_s" in t, t.get("warmup_failed"),
             t.get("tools_warmup_failed"))
            for t in rec["trainers"].values()
        ]  # fmt: skip
        on = level in ("L2", "L3")
        assert warmed == [(on, on, None, None)] * 2, rec["trainers"]
        if level == "L3":
            # Each shadow mapped the pool while parked, and remapped exactly the pages
            # the fault plan lost (on every rank's pool) before anything read them.
            assert all(t["premapped"] for t in rec["trainers"].values()), rec["trainers"]
            lost = rec["pages_lost"]["device"] + rec["pages_lost"]["host"]
            assert lost > 0 or "lose_pages" not in f, rec["pages_lost"]
            assert sum(t["remapped_pages"] for t in rec["trainers"].values()) == lost, rec


def test_two_agents_as_two_nodes_over_loopback(reference, tmp_path):
    faults = [{"generation": 0, "rank": 1, "at": "update.optimizer@2#1"}]
    summaries = leto_run(tmp_path, "L2", faults, nnodes=2, nproc=1)
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()
    assert [s["failures"] for s in summaries] == [1, 1], summaries  # both nodes recovered


# At L3 a dead shadow takes its generation's process group with it: every node restarts
# all its shadows (below L3 one is replaced alone, a subset of that path).
@pytest.mark.parametrize("level", ["L3"])
def test_a_shadow_that_dies_while_parked_is_replaced(reference, tmp_path, level):
    """At L3 the dead shadow's process group is gone with it: every shadow of that
    generation restarts in a fresh namespace, and the promotion still works."""
    faults = [{"generation": 0, "rank": 0, "at": "update.commit@4#1"}]
    (p,) = leto_run(tmp_path, level, faults, wait=False)
    deadline = time.monotonic() + 60
    while not (pids := shadow_pids(tmp_path, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids, "no parked shadow appeared within 60 s"
    os.kill(pids[0], signal.SIGKILL)
    (summary,) = finish([p])
    assert summary["shadow_restarts"] >= 1, summary
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()


def test_a_hung_trainer_is_detected_by_its_heartbeat_and_recovered(reference, tmp_path):
    faults = [{"generation": 0, "rank": 1, "at": "update.optimizer@2#1", "mode": "hang"}]
    t0 = time.monotonic()
    (summary,) = leto_run(tmp_path, "L2", faults, extra=("--hang-timeout-s", "3"))
    took = time.monotonic() - t0
    # Rank 1 hangs inside iteration 2's update. Rank 0, its update done, waits for it in
    # that iteration's replica agreement (leto.integrity.replica) at the same heartbeat, so
    # the monitor cannot tell them apart and reports both (it reports only the ranks
    # with the oldest beat); rank 1 must be among them, and one recovery clears it.
    failed = summary["recoveries"][0]["failed_ranks"] if summary["recoveries"] else []
    assert summary["failures"] == 1 and 1 in failed, summary
    assert took < 60, (
        f"the hang took {took:.0f} s to clear: the collective timeout, not the monitor"
    )
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()


def test_a_fatal_failure_falls_back_to_the_newest_checkpoint_exactly(reference, tmp_path):
    """A HOF whose page loss exceeds parity: the promoted trainers cannot rebuild, exit
    fatal, and every rank restarts cold on a fresh pool from the DCP checkpoint."""
    faults = [{"generation": 0, "rank": 1, "at": "update.optimizer@3#1", "lose_pages": 5}]
    extra = ("--allow-fault-injection", "--checkpoint-interval", "2")
    (summary,) = leto_run(tmp_path, "L2", faults, extra=extra)
    classes = [r["class"] for r in summary["recoveries"]]
    assert classes == ["HOF", "FF"], summary["recoveries"]
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()


def _state_manager_pids(root: Path) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if b"leto.memory.state_manager" in cmd and cwd.startswith(str(root)):
            found.append(int(d.name))
    return found


def test_a_state_manager_that_dies_falls_back_to_the_checkpoint_exactly(tmp_path):
    iters = 16  # enough left after the first checkpoint for the kill to land mid-run
    leto_run(tmp_path / "ref", "off", iters=iters)
    work = tmp_path / "run"
    (p,) = leto_run(work, "L1", extra=("--checkpoint-interval", "1"), iters=iters, wait=False)
    # Any complete checkpoint: saves are put off while the last one is still written
    # (or its staging buffers are made), so which iterations save depends on the disk.
    ckpts = work / "logs" / "checkpoints"
    deadline = time.monotonic() + 90
    while latest(ckpts) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert latest(ckpts) is not None, "no complete checkpoint within 90 s"
    pids = _state_manager_pids(work)
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    (summary,) = finish([p])
    assert [r["class"] for r in summary["recoveries"]] == ["FF"], summary["recoveries"]
    v = compare(tmp_path / "ref" / "train", work / "train")
    assert v.exact, v.describe()


def test_a_second_failure_during_the_recovery_is_recovered_exactly(reference, tmp_path):
    """Rank 1's promoted trainer dies while recovering (pages rebuilt, the job-wide rule
    not yet agreed); the next shadows take over and the run is still exact."""
    faults = [
        {"generation": 0, "rank": 0, "at": "update.optimizer@2#1"},
        {"generation": 1, "rank": 1, "at": "resume@0#1"},
    ]
    (summary,) = leto_run(tmp_path, "L2", faults)
    assert summary["failures"] == 2, summary
    assert [r["failed_ranks"] for r in summary["recoveries"]] == [[0], [1]], summary
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()
