"""Two ranks on two GPUs (NCCL) under ``leto run``, each with its own state manager on
its own GPU: a rank is SIGKILLed, the shadows are promoted, and the run equals the
fault-free one bit for bit. Runs on a machine with two GPUs (e.g. two H200s); skipped with a reason elsewhere."""

from __future__ import annotations

import pytest
import torch

from faultkit.job import JobFault, first_difference
from tests.test_dp_gpu import CFG, LOSE, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)"
    ),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(2, tmp_path_factory.mktemp("mgref"))  # leto run puts rank r's pool on GPU r


@pytest.mark.parametrize(
    "victim,point", [(1, "update.optimizer@2#2"), (0, "grad_parity@2#2"), (1, "update.store@1#1")]
)
def test_kill_one_of_two_gpu_ranks_then_exact(reference, tmp_path, victim, point):
    got = run(2, tmp_path, faults=[JobFault(victim, point, inject=LOSE)])
    assert first_difference(reference, got) is None, first_difference(reference, got)


def test_zero1_on_two_gpus_equals_replicated(reference, tmp_path):
    import dataclasses

    z = run(2, tmp_path, cfg=dataclasses.replace(CFG, zero1=True))
    assert z["losses"] == reference["losses"]
    assert torch.equal(
        z["states"][1]["param"].view(torch.uint8), reference["states"][0]["param"].view(torch.uint8)
    )
