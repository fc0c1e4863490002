"""The example job on the GPU, killed for real (SIGKILL with kernels and stream-ordered
marker writes in flight), restarted cold, compared byte for byte with a fault-free run.

Runs on the lent H200 (``bench/gpu_suite.sh rmu``); skipped with a reason without CUDA.
One GPU is lent, so one rank (NCCL); the multi-rank logic is the CPU tests' job.
"""

from __future__ import annotations

import pytest

from faultkit import hooks
from faultkit.job import first_difference, run_job
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig

pytestmark = pytest.mark.gpu
CFG = TrainConfig(iterations=4, device="cuda", n_embd=256, n_layer=4, n_head=4, chunk_units=1)
POOL = PoolConfig.for_cuda(0, data_pages=6, tier1_pages=2, allow_fault_injection=True)
POINTS = [p for p in hooks.POINTS if p not in ("gather", "compute.forward", "allreduce")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_job(1, CFG, tmp_path_factory.mktemp("gpuref"), pool=POOL)


def lose(rank, f):
    f.inject_loss("data", "param", [0])
    f.inject_loss("data", "exp_avg", [0])  # H1 = 2 HBM pages of group 0
    f.inject_loss("tier1", 1, [0])


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_anywhere_on_the_gpu_then_exact(reference, tmp_path, point):
    nth = 1 if point in hooks.ONCE_PER_ITERATION else 2
    got = run_job(1, CFG, tmp_path, fault=(0, f"{point}@2#{nth}"), lose=lose, pool=POOL)
    assert first_difference(reference, got) is None, first_difference(reference, got)
