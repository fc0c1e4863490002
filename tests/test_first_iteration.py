"""Recovery as the paper measures it: the stage clock and the pace a generation leaves
for the next (leto.trainer.first_iteration), and I, R and their sum the agent takes from
them (leto.launch.recovery.regained)."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

from leto.launch.recovery import regained
from leto.trainer.first_iteration import Pace, StageClock


def test_stages_add_up_to_the_way_and_name_the_loop_start():
    t0 = time.time()
    clock = StageClock(0, torch.device("cpu"), t0)
    for name in ("init", "bind", "loop start", "forward/backward", "update"):
        time.sleep(0.01)
        clock.mark(name)
    out = clock.close()
    assert list(out["stages"]) == ["init", "bind", "loop start", "forward/backward", "update"]
    total = out["first_iteration_end"] - t0
    assert sum(out["stages"].values()) == pytest.approx(total, abs=1e-6)
    assert out["loop_at"] == clock.at["loop start"]
    assert out["first_iteration_s"] == pytest.approx(
        out["first_iteration_end"] - out["loop_at"], abs=1e-9
    )
    clock.mark("after step")  # closed: nothing more is counted
    assert "after step" not in clock.stages


def test_pace_reports_the_median_of_iterations_after_the_first():
    pace = Pace()
    recs = []
    for it, gap in enumerate([0.0, 0.05, 0.01, 0.01, 0.01]):
        time.sleep(gap)
        recs.append(json.loads(pace.began(it)))
    assert recs[0]["steady_s"] is None and recs[1]["steady_s"] is None
    # iteration 0 (the first: left out of the median) took longest; the median is that
    # of the others' times, as they were recorded
    took = [b["began_at"] - a["began_at"] for a, b in zip(recs, recs[1:], strict=False)]
    assert took[0] > max(took[1:])
    assert recs[-1]["steady_s"] == pytest.approx(statistics.median(took[1:]), rel=1e-9)
    assert recs[-1]["iteration"] == 4


def test_a_finished_update_costs_only_the_way_to_the_loop():
    pace = {"iteration": 6, "began_at": 100.0, "steady_s": 0.3}
    got = regained(pace, detected_at=100.25, loop_at=101.0, redone_end=101.0)
    assert got["init_s"] == pytest.approx(0.75)
    assert got["recompute_s"] == 0.0
    assert got["regained_s"] == pytest.approx(0.75)


def test_a_redone_iteration_counts_less_what_was_still_ahead_of_it():
    # Failed 0.1 s into a 0.3 s iteration: a fault-free run still had 0.2 s ahead.
    pace = {"iteration": 6, "began_at": 100.0, "steady_s": 0.3}
    got = regained(pace, detected_at=100.1, loop_at=100.6, redone_end=101.0)
    assert got["fault_free_remainder_s"] == pytest.approx(0.2)
    assert got["init_s"] == pytest.approx(0.5)
    assert got["recompute_s"] == pytest.approx(0.2)  # 0.4 s redone, 0.2 s of it was due
    assert got["regained_s"] == pytest.approx(0.7)


def test_without_a_pace_the_whole_redone_iteration_counts():
    got = regained(None, detected_at=10.0, loop_at=10.5, redone_end=10.9)
    assert got["fault_free_remainder_s"] is None
    assert got["recompute_s"] == pytest.approx(0.4)
