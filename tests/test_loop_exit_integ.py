"""Leaving ``run.iterations()`` early (``break``, as llm.c's loop does at its last step)
runs what the end of training runs — every check settled, the full scrub, ZeRO-1's
gather — and the model equals the torchrun run's that broke at the same place. Before,
the end-of-training steps silently did not run."""

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
def test_a_loop_left_by_break_runs_the_end_of_training(tmp_path):
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
    assert "the loop was left at iteration 3 of 4: the end of training runs now" in log, log
    assert "the loop ran" in log and "for 3 iteration(s)" in log, log  # the end ran
    want = torch.load(ref / "rank0.state.pt")
    have = torch.load(out / "train" / "rank0.state.pt")
    for name, p in want["params"].items():
        assert torch.equal(p.view(torch.uint8), have["params"][name].view(torch.uint8)), name
