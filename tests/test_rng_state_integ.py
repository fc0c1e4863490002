"""A script that draws from the global generators inside its loop (batches from
``torch.randn``, dropout masks, Python's ``random``) ends bit-identical to its
fault-free run after kills — in a backward (the iteration redone from the previous
one's record) and mid-update with pages lost (finished) — because ``leto.Run`` retains
the generators' states with each commit (``leto.trainer.rng_state``). Without that, a
promoted trainer draws from generators its start-up seeded afresh."""

from __future__ import annotations

from pathlib import Path

import pytest

from faultkit.job import JobFault, first_difference, run_job
from leto.workload.train import TrainConfig

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "global_rng_loop.py"
ITERS = 6
LOSE = (("data", "param", (0,)), ("data", "exp_avg", (1,)))


def _job(out: Path, faults=()) -> dict:
    return run_job(
        2, TrainConfig(), out, faults, shadow_level="L2" if faults else "off",
        script=SCRIPT, script_args=["--iterations", str(ITERS), "--out", str(out / "train")],
    )  # fmt: skip


def test_draws_from_the_global_generators_are_the_same_after_recoveries(tmp_path):
    ref = _job(tmp_path / "ref")
    faults = [
        JobFault(1, "compute.backward@2#2"),  # the second micro-batch's backward: 2 redone
        JobFault(0, "update.optimizer@4#1", inject=LOSE),  # 4 finished by the recovery
    ]
    got = _job(tmp_path / "faulted", faults)
    assert got["injections"] == 2, got["recoveries"]
    assert (why := first_difference(ref, got)) is None, why
