"""Leaving ``run.iterations()`` early (``break``, as llm.c's loop does at its last step):
the model equals the torchrun run's that broke at the same place, and the rank's log
says that the end of training (the last checks settled, the full scrub, ZeRO-1's final
gather) did not run and how to have it — before, it silently did not run. (It cannot
run there: a loop left by an exception unwinding through it looks the same, and the
end of training is collective.)"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from bench.zoo.__main__ import SCRIPT, torchrun
from faultkit.job import POOL, run_job
from leto.workload.train import TrainConfig


@pytest.mark.integ
@pytest.mark.timeout(300)
def test_a_loop_left_by_break_says_the_end_of_training_did_not_run(tmp_path):
    args = argparse.Namespace(nproc_per_node=1, size="tiny", iterations=4, timeout_s=240)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    ref = tmp_path / "ref"
    subprocess_args = ["--leave-at", "3"]
    torchrun(args, "two-optimizers", ref, env, extra=subprocess_args)
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
    want = torch.load(ref / "rank0.state.pt")
    have = torch.load(out / "train" / "rank0.state.pt")
    for name, p in want["params"].items():
        assert torch.equal(p.view(torch.uint8), have["params"][name].view(torch.uint8)), name
