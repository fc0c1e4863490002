"""bench.recovery_speed's reading of a run's traces (the first iteration after a
recovery against the steady ones before it: issue 17, item 2) and its reuse of a kept
fault-free reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import bench.recovery_speed as rs
from bench.recovery_speed import first_iteration, reference_out, regained_s
from verifiers.recorder import Recorder


def _trace(out, times: list[tuple[int, float]], rank: int = 0) -> None:
    clock = iter(t for _, t in times)
    with Recorder(out, rank, clock=lambda: next(clock)) as rec:
        for it, _ in times:
            rec.record(it, 1.0, {"w": torch.zeros(2)})


def test_the_first_iteration_after_recovery_is_compared_with_the_median_steady_one(tmp_path):
    # Iterations 0-4 before the failure (0 carries start-up: 10 s; iterations 1-3 take 1.0,
    # 1.2 and 3.0 s; 4 saves a checkpoint: 5 s), detection at 30, iteration 4 regained at
    # 31.5, iteration 5 at 33.5 (2 s).
    times = [(0, 10.0), (1, 11.0), (2, 12.2), (3, 15.2), (4, 20.2), (4, 31.5), (5, 33.5)]
    _trace(tmp_path, times)
    got = first_iteration(tmp_path, 0, detected_at=30.0, fail_at=4, checkpoint_interval=4)
    assert got["first_s"] == 33.5 - 31.5
    # The median of 1.0, 1.2 and 3.0 — not the mean, and not the checkpoint iteration 4.
    assert got["steady_s"] == 12.2 - 11.0
    assert got["ratio"] == (33.5 - 31.5) / (12.2 - 11.0)
    assert got["checkpoint_iteration"] is False
    assert regained_s(tmp_path, 0, 30.0, 4) == 1.5


def test_a_checkpoint_iteration_is_compared_with_checkpoint_iterations(tmp_path):
    times = [(0, 10.0), (1, 11.0), (2, 12.0), (3, 13.0), (4, 18.0), (3, 31.0), (4, 37.0)]
    _trace(tmp_path, times)
    got = first_iteration(tmp_path, 0, detected_at=30.0, fail_at=3, checkpoint_interval=4)
    assert (got["first_s"], got["steady_s"], got["checkpoint_iteration"]) == (6.0, 5.0, True)


def test_no_figure_when_the_run_ends_at_the_failed_iteration(tmp_path):
    _trace(tmp_path, [(0, 10.0), (1, 11.0), (2, 12.0), (2, 21.0)])
    assert first_iteration(tmp_path, 0, detected_at=20.0, fail_at=2, checkpoint_interval=4) is None


def test_without_checkpoints_every_iteration_is_of_one_kind(tmp_path):
    # --checkpoints baseline: the in-place variants save nothing, so iteration 4 (a
    # checkpoint iteration at interval 4) is a steady one like the others.
    _trace(tmp_path, [(0, 10.0), (1, 11.0), (2, 12.2), (3, 15.2), (4, 20.2), (5, 31.0), (6, 32.5)])
    got = first_iteration(tmp_path, 0, detected_at=30.0, fail_at=5, checkpoint_interval=None)
    assert got["checkpoint_iteration"] is False
    # The median of 1.0, 1.2, 3.0 and 5.0: iteration 4 counts (with saves it would not).
    assert (got["first_s"], got["steady_s"]) == pytest.approx((1.5, 2.1))


def test_a_two_rank_failure_reports_the_slowest_failed_rank(tmp_path):
    # Issue 17 item 4: both ranks fail at once. Rank 0 regains iteration 4 at 31.5 and runs
    # iteration 5 in 2.0 s against steady 1.0 s; rank 1 regains at 31.8 (it waited for the
    # collective) and runs iteration 5 in 1.7 s against steady 1.2 s.
    _trace(tmp_path, [(1, 11.0), (2, 12.0), (3, 13.0), (4, 31.5), (5, 33.5)], rank=0)
    _trace(tmp_path, [(1, 11.0), (2, 12.2), (3, 13.4), (4, 31.8), (5, 33.5)], rank=1)
    got = rs.slowest_first_iteration(tmp_path, [0, 1], 30.0, 4, None)
    assert (got["rank"], got["first_s"], got["steady_s"]) == (0, 2.0, 1.0)
    assert max(regained_s(tmp_path, r, 30.0, 4) for r in (0, 1)) == pytest.approx(1.8)
    ended = tmp_path / "ended"  # rank 1's run ended at the struck iteration
    _trace(ended, [(1, 11.0), (2, 12.0), (3, 13.0), (4, 31.5), (5, 33.5)], rank=0)
    _trace(ended, [(1, 11.0), (2, 12.2), (3, 13.4), (4, 31.8)], rank=1)
    assert rs.slowest_first_iteration(ended, [0, 1], 30.0, 4, None) is None


def test_failing_ranks_are_parsed_and_checked_against_the_job():
    assert rs._ranks("1,0,1") == [0, 1]
    with pytest.raises(SystemExit):
        rs.main(["--nproc-per-node", "2", "--ranks", "0,2"])
    with pytest.raises(SystemExit):
        rs.main(["--ranks", "a"])


def _args(keep, **over):
    flags = dict(device="cpu", nproc_per_node=1, iterations=5, checkpoints="baseline",
                 pool_flags=["--page-bytes", "16384"], model=["--n-layer", "2"])  # fmt: skip
    return SimpleNamespace(**{**flags, **over}, reference_dir=str(keep))


def test_a_kept_reference_is_reused_for_the_same_flags_and_refused_for_others(
    tmp_path, monkeypatch
):
    runs = []

    def fake_run(work, *a):  # the reference run: a verifiers output with one file
        runs.append(work)
        (work / "out").mkdir(parents=True)
        (work / "out" / "rank0.trace.jsonl").write_text("{}\n")

    monkeypatch.setattr(rs, "run_variant", fake_run)
    keep = tmp_path / "kept"
    first = reference_out(tmp_path / "a", _args(keep), True)
    assert len(runs) == 1 and (first / "rank0.trace.jsonl").read_text() == "{}\n"
    assert first == keep / "out"
    again = reference_out(tmp_path / "b", _args(keep), True)
    assert again == first and len(runs) == 1, "the kept reference was run again"
    with pytest.raises(SystemExit, match=r"kept for other job flags.*'iterations': \(5, 6\)"):
        reference_out(tmp_path / "c", _args(keep, iterations=6), True)
    assert len(runs) == 1, "a refused reference ran anyway"


def test_to_training_leaves_out_each_ranks_verifier_record_and_takes_the_slowest():
    from bench.recovery_speed import to_training_s

    rec = {
        "detected_at": 100.0,
        "recovery_s": 3.0,  # rank 1 at 103.0, 1.5 s of it hashing its record
        "trainers": {
            "0": {"time": 102.4, "observer_s": 0.2},  # 2.2 s without its record
            "1": {"time": 103.0, "observer_s": 1.5},  # 1.5 s without
        },
    }
    assert to_training_s(rec) == pytest.approx(2.2)
    # A record without the observer's time (a restarted baseline) is taken as measured.
    assert to_training_s({**rec, "trainers": {"0": {"time": 103.0}}}) == pytest.approx(3.0)
    assert to_training_s({"detected_at": 1.0, "recovery_s": None, "trainers": {}}) is None


def test_checkpoints_that_would_not_fit_are_refused_before_anything_runs(tmp_path, monkeypatch):
    # One 5 B save is 60 GB: a baseline that dies of ENOSPC mid-save would spend a device
    # call on its reference run first. The need is per variant (folders are removed after
    # each): one save for --checkpoints baseline, two kept plus one in flight for all.
    args = SimpleNamespace(checkpoints="baseline", checkpoint_dir=str(tmp_path / "new" / "ck"),
                           nproc_per_node=2)  # fmt: skip
    n = 5_000_000_000
    need = n * rs.CHECKPOINT_BYTES_PER_PARAMETER * 2
    seen = []

    def usage(path, free):
        seen.append(path)
        return SimpleNamespace(total=2 * need, used=0, free=free)

    monkeypatch.setattr(rs.shutil, "disk_usage", lambda p: usage(p, need - 1))
    why = rs.checkpoint_room(args, ["L3", rs.BASE], n)
    assert seen[-1] == tmp_path  # the nearest folder that exists
    assert "120.0 GB" in why and rs.BASE in why and "L3" not in why.split(" need")[0]
    assert rs.checkpoint_room(args, ["L3", "L2"], n) is None  # in-place variants save none
    monkeypatch.setattr(rs.shutil, "disk_usage", lambda p: usage(p, need))
    assert rs.checkpoint_room(args, [rs.BASE], n) is None
    args.checkpoints = "all"  # three saves in flight at most, in every variant
    why = rs.checkpoint_room(args, ["L3"], n)
    assert why is not None and "3 saves" in why and "360.0 GB" in why
    with pytest.raises(SystemExit):  # main refuses before its reference run
        monkeypatch.setattr(rs, "reference_out", lambda *a: pytest.fail("ran the reference"))
        monkeypatch.setattr(rs.shutil, "disk_usage", lambda p: usage(p, 0))
        rs.main(["--variants", rs.BASE, "--checkpoints", "baseline"])


@pytest.mark.integ
@pytest.mark.timeout(240)
def test_plain_recovery_times_a_script_that_gives_prepare_and_warmup(tmp_path):
    # The preset for the "where the script gives them": the example job (its
    # prepare= and warmup=) killed in the update with pages lost, I + R from its record.
    import json

    import bench.plain_recovery as pr

    out = tmp_path / "trials.json"
    argv = ["--preset", "cpu-prepared", "--trials", "1", "--iterations", "5",
            "--at", "update.optimizer@3#1", "--lose-pages", "2", "--work-dir",
            str(tmp_path / "jobs"), "--json-out", str(out)]  # fmt: skip
    assert pr.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["args"]["script"].endswith("examples/train_gpt.py"), got["args"]
    (row,) = got["trials"]
    assert row["resumed_by"] == "finish" and row["pages_lost"] > 0, row
    assert 0 < row["init_s"] <= row["regained_s"], row
    assert "script set-up" in row["stages"] and "forward/backward" in row["stages"], row
    assert {"reconstruct_s", "finish_update_s"} <= set(row["resume_steps"]), row
