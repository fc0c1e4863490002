"""torchtitan under Leto (``leto.titan``): a torchtitan job Leto cannot retain exactly is
refused before anything starts, naming the flag; the Llama 3 debug model under
``leto run`` with ``LetoTrainer`` ends with the bytes plain torchtitan under torchrun ends
with — parameters, optimizer state, LR schedulers, data loader position, train state —
and logs the same losses, gradient norms and token counts (torchtitan's own checkpoint
and TensorBoard log, ``examples/titan/compare.py``). On the CPU at world 1
(``examples/titan/cpu.py``: torchtitan runs on accelerators only); killed at every
phase with pages lost by the CI gate (``faultkit certify``), on the H200 by
``bash bench/gpu_suite.sh titan``. Skipped where torchtitan is not installed
(``pip install -e ".[titan]"``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import torchrun_reference

pytest.importorskip("torchtitan", reason="torchtitan is not installed (the [titan] extra)")

TITAN = Path(__file__).resolve().parents[1] / "examples" / "titan"
sys.path.insert(0, str(TITAN))


def _config(*flags: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(list(flags))


def test_what_leto_cannot_retain_is_refused_naming_the_flag():
    from leto.titan.trainer import refusals

    assert refusals(_config()) == []
    assert refusals(_config("--parallelism.data_parallel_shard_degree", "-1")) == []
    cases = {
        "--parallelism.pipeline_parallel_degree": ("2", "pipeline parallelism"),
        "--parallelism.data_parallel_replicate_degree": ("2", "replicate() reduces"),
        "--model.converters": ("float8", "model converters ['float8']"),
        "--optimizer.name": ("SGD", "--optimizer.name SGD"),
    }
    for flag, (value, says) in cases.items():
        got = refusals(_config(flag, value))
        assert len(got) == 1 and says in got[0] and flag.split(".")[-1] in got[0], (flag, got)
    got = refusals(_config("--training.enable_cpu_offload", "--optimizer.early_step_in_backward"))
    assert [g.split(":")[0] for g in got] == [
        "--training.enable_cpu_offload",
        "--optimizer.early_step_in_backward",
    ], got


def test_torchtitan_with_ranks_sharing_a_gpu_is_refused_naming_the_collective():
    # leto run --ranks-per-gpu 2 -m leto.titan.train: gloo on CUDA has no PREMUL_SUM,
    # which torchtitan's FSDP2 reduce-scatter uses.
    from leto.titan.trainer import shared_gpu_refusal

    why = shared_gpu_refusal(torch.device("cuda", 0), "gloo")
    assert "torchtitan" in why and "PREMUL_SUM" in why and "Nothing was retained" in why
    assert shared_gpu_refusal(torch.device("cuda", 0), "nccl") is None
    assert shared_gpu_refusal(torch.device("cpu"), "gloo") is None


@pytest.mark.integ
@pytest.mark.timeout(400)
def test_the_debug_model_under_leto_is_bit_identical_to_torchtitan(tmp_path):
    from compare import compare

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    job = [str(TITAN / "debug_job.py"), "--iterations", "4"]
    plains = [tmp_path / "plain", tmp_path / "plain-again", tmp_path / "plain-third"]
    plain = plains[torchrun_reference.run(
        "torchtitan's debug job",
        lambda a: ["--standalone", "--nproc-per-node", "1", *job, "--plain", "--out", str(plains[a])],
        env=env, timeout=180,
    )]  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "leto.cli", "run", "--nproc-per-node", "1", "--shadow-level",
         "off", "--log-dir", str(tmp_path / "logs"), *job, "--out", str(tmp_path / "leto")],
        env=env, check=True, timeout=180, capture_output=True,
    )  # fmt: skip
    assert compare(plain / "titan", tmp_path / "leto" / "titan") is None
