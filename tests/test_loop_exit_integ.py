"""Leaving ``run.iterations()`` early (``break``, as llm.c's loop does at its last step):
the committed iterations stand, the script goes on, and the rank's log says that the
end of training (the last checks settled, the full scrub, ZeRO-1's final gather) did
not run and how to have it — before, it silently did not run. (It cannot run there: a
loop left by an exception unwinding through it looks the same, and the end of training
is collective.)"""

from __future__ import annotations

import os

import pytest

from bench.zoo.__main__ import SCRIPT
from faultkit.job import POOL, run_job
from leto.workload.train import TrainConfig


@pytest.mark.integ
@pytest.mark.timeout(300)
def test_a_loop_left_by_break_says_the_end_of_training_did_not_run(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess_args = ["--leave-at", "3"]
    out = tmp_path / "leto"
    got = run_job(
        1, TrainConfig(), out, pool=POOL, shadow_level="off", timeout_s=240, env=env,
        script=SCRIPT, script_args=["--leto", "--case", "two-optimizers", "--iterations", "4",
                                    *subprocess_args, "--out", str(out / "train")],
    )  # fmt: skip
    assert got["code"] == 0
    log = (out / "logs" / "rank0.gen0.active.log").read_text()
    assert (
        "the loop was left at iteration 3 of 4 before run.iterations() ended: the end "
        "of training did not run" in log
    ), log
    # The script went on after the loop (it saved its state): three iterations committed.
    assert (out / "train" / "rank0.state.pt").exists()
    assert sorted(got["losses"][0]) == [0, 1, 2], got["losses"]
