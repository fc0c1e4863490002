"""The loss guard under ``leto run``: rank 1 records a NaN loss once, in iteration 3 of
the job's first generation (a transient fault). The ranks fail that iteration (a fatal
failure naming rank 1), the job falls back to its last verified checkpoint (iteration 2) and redoes the
iterations from there, and the run ends bit-identical to its fault-free run; with
``--no-loss-guard`` the NaN is logged and nothing is rolled back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faultkit.job import first_difference, run_job
from leto.workload.train import TrainConfig

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "nan_once.py"
ITERS = 6


def _job(out: Path, nan_at: int, extra=()) -> dict:
    return run_job(
        2, TrainConfig(), out, shadow_level="off",
        extra=("--checkpoint-interval", "2", *extra), script=SCRIPT,
        script_args=["--iterations", str(ITERS), "--nan-at", str(nan_at),
                     "--out", str(out / "train")],
    )  # fmt: skip


def test_a_transient_nan_loss_is_rolled_back_on_every_rank_and_the_run_ends_exact(tmp_path):
    ref = _job(tmp_path / "ref", -1)
    got = _job(tmp_path / "nan", 3)
    (rec,) = got["recoveries"]
    # (Whichever rank exits first is the failure the agent saw; it fences the others.)
    assert rec["class"] == "FF" and rec["failed_ranks"], rec
    errors = [
        json.loads(p.read_text())
        for p in sorted((tmp_path / "nan" / "logs").glob("rank*.gen0.*error.json"))
    ]
    said = " ".join(str(e) for e in errors)
    assert "iteration 3: the loss is not finite on rank(s) [1]" in said, said
    assert (why := first_difference(ref, got)) is None, why
    # Without the guard the NaN is only logged: the run goes on, nothing is redone.
    off = _job(tmp_path / "off", 3, extra=("--no-loss-guard",))
    assert off["recoveries"] == [], off["recoveries"]
    lines = (tmp_path / "off" / "train" / "rank1.losses.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in lines][3] == float("nan").hex()
