"""bench.recovery_speed's reading of a run's traces: the first iteration after a
recovery against the steady ones before it (issue 17, item 2)."""

from __future__ import annotations

import torch

from bench.recovery_speed import first_iteration, regained_s
from verifiers.recorder import Recorder


def _trace(out, times: list[tuple[int, float]]) -> None:
    clock = iter(t for _, t in times)
    with Recorder(out, 0, clock=lambda: next(clock)) as rec:
        for it, _ in times:
            rec.record(it, 1.0, {"w": torch.zeros(2)})


def test_the_first_iteration_after_recovery_is_compared_with_the_median_steady_one(tmp_path):
    # Iterations 0-3 before the failure (0 carries start-up: 10 s; steady 1.0, 1.2, 3.0 s),
    # detection at 20, iteration 3 regained at 21.5, iteration 4 at 23.5 (2 s).
    _trace(tmp_path, [(0, 10.0), (1, 11.0), (2, 12.2), (3, 15.2), (3, 21.5), (4, 23.5)])
    got = first_iteration(tmp_path, 0, detected_at=20.0, fail_at=3)
    assert got["first_s"] == 23.5 - 21.5
    assert got["steady_s"] == 12.2 - 11.0  # the median of 1.0, 1.2 and 3.0, not the mean
    assert got["ratio"] == (23.5 - 21.5) / (12.2 - 11.0)
    assert regained_s(tmp_path, 0, 20.0, 3) == 1.5


def test_no_figure_when_the_run_ends_at_the_failed_iteration(tmp_path):
    _trace(tmp_path, [(0, 10.0), (1, 11.0), (2, 12.0), (2, 21.0)])
    assert first_iteration(tmp_path, 0, detected_at=20.0, fail_at=2) is None
