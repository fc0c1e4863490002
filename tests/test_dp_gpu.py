"""The example job on the GPU under ``leto run``, killed for real (SIGKILL with kernels
and stream-ordered marker writes in flight), or stopped mid-kernel by the trip-wire,
recovered by a promoted shadow, compared byte for byte with a fault-free run.

Runs on a CUDA machine (``bench/gpu_suite.sh rmu``); skipped with a reason without CUDA.
One GPU, so one rank (NCCL); the multi-rank logic is the CPU tests' job.
"""

from __future__ import annotations

import pytest

from faultkit import hooks
from faultkit.job import JobFault, first_difference, run_job
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig

pytestmark = pytest.mark.gpu
CFG = TrainConfig(iterations=4, n_embd=256, n_layer=4, n_head=4, chunk_units=1)
POOL = PoolConfig.for_cuda(0, data_pages=6, tier1_pages=2, allow_fault_injection=True)
# H1 = 2 HBM pages of group 0 and a host parity page of group 1, on every rank
LOSE = (("data", "param", (0,)), ("data", "exp_avg", (0,)), ("tier1", 1, (0,)))


def run(world, out, cfg=CFG, faults=(), pool=POOL):
    return run_job(world, cfg, out, faults, pool=pool, device="cuda", save_state=True)


POINTS = [p for p in hooks.POINTS if p not in ("gather", "compute.forward", "allreduce")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(1, tmp_path_factory.mktemp("gpuref"))


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_anywhere_on_the_gpu_then_exact(reference, tmp_path, point):
    nth = 1 if point in hooks.ONCE_PER_ITERATION else 2
    got = run(1, tmp_path, faults=[JobFault(0, f"{point}@2#{nth}", inject=LOSE)])
    assert first_difference(reference, got) is None, first_difference(reference, got)


@pytest.mark.parametrize("point", ["update.optimizer", "update.parity"])
def test_kernel_abort_in_each_of_letos_kernels_then_exact(reference, tmp_path, point):
    got = run(1, tmp_path, faults=[JobFault(0, f"{point}@2#1", "kernel-abort", inject=LOSE)])
    assert first_difference(reference, got) is None, first_difference(reference, got)
    (abort,) = got["aborts"]
    assert abort["partial"] and "CUDA" in abort["mechanism"], abort
