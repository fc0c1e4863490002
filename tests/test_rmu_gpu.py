"""The updater on a GPU: CUDA VMM pool, CUDA codec, torch's CUDA AdamW as the reference.

Runs on a CUDA machine (``bench/gpu_suite.sh rmu``); skipped with a reason without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager
from leto.update.optim import AdamWConfig
from leto.update.rmu import UpdaterConfig
from tests.rmu_harness import POINTS, reference, run

pytestmark = pytest.mark.gpu
DIMS = (1024, 2048, 1024, 16)  # 4.2 M parameters: 9 units of 2 MiB, 3 groups
ITERS = 4


@pytest.fixture
def pool():
    sm = start_state_manager(
        PoolConfig.for_cuda(0, data_pages=12, tier1_pages=2, allow_fault_injection=True)
    )
    yield sm
    sm.stop()


def assert_same(got, want):
    for k, w in want.items():
        d = (got[k][: w.numel()].view(torch.uint8) != w.view(torch.uint8)).nonzero()
        assert d.numel() == 0, f"{k} differs from CUDA torch.optim.AdamW at byte {int(d[0])}"


@pytest.mark.parametrize("impl", ["fused", "single"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fault_free_equals_cuda_adamw(pool, dtype, impl):
    cfg = UpdaterConfig(chunk_units=1, adamw=AdamWConfig(impl=impl))
    got = run(pool, ITERS, cfg, dtype, dims=DIMS)
    assert_same(got, reference(ITERS, dtype, "cuda", DIMS, impl=impl))


def lose_pages(f):
    f.inject_loss("data", "param", [0])
    f.inject_loss("data", "exp_avg", [1])  # H1 = 2 pages of group 0
    f.inject_loss("tier1", "1", [0])
    f.inject_loss("data", "grad", [1])


@pytest.mark.parametrize("point", POINTS)
def test_crash_and_lost_hbm_pages_resume_exactly(pool, point):
    got = run(
        pool, ITERS, UpdaterConfig(chunk_units=1), crash=(point, 2, 1), lose=lose_pages, dims=DIMS
    )
    assert_same(got, reference(ITERS, torch.float32, "cuda", DIMS))
