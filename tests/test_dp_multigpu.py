"""Two ranks on two GPUs (NCCL), each with its own state manager on its own GPU: a rank
is SIGKILLed, every rank restarts cold, and the run equals the fault-free one bit for
bit. Runs where two GPUs are lent (``nvidia-h200-x2``); skipped with a reason elsewhere."""

from __future__ import annotations

import pytest
import torch

from faultkit.job import first_difference, run_job
from leto.memory.config import PoolConfig
from tests.test_dp_gpu import CFG, lose

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)"
    ),
]


def pool_of(rank: int) -> PoolConfig:
    return PoolConfig.for_cuda(rank, data_pages=6, tier1_pages=2, allow_fault_injection=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_job(2, CFG, tmp_path_factory.mktemp("mgref"), pool=pool_of)


@pytest.mark.parametrize(
    "victim,point", [(1, "update.optimizer@2#2"), (0, "grad_parity@2#2"), (1, "update.store@1#1")]
)
def test_kill_one_of_two_gpu_ranks_then_exact(reference, tmp_path, victim, point):
    got = run_job(2, CFG, tmp_path, fault=(victim, point), lose=lose, pool=pool_of)
    assert first_difference(reference, got) is None, first_difference(reference, got)


def test_zero1_on_two_gpus_equals_replicated(reference, tmp_path):
    import dataclasses

    z = run_job(2, dataclasses.replace(CFG, zero1=True), tmp_path, pool=pool_of)
    assert z["losses"] == reference["losses"]
    assert torch.equal(
        z["states"][1]["param"].view(torch.uint8), reference["states"][0]["param"].view(torch.uint8)
    )
