"""The CUDA kernel produces the CPU kernel's bytes; the codec works on GPU tensors.

Runs on a CUDA machine (``bench/gpu_suite.sh``); skipped with a reason without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leto.erasure import ReedSolomon, TwoTierCode
from leto.erasure.kernels import Coefficients, CpuKernel, by_name

pytestmark = pytest.mark.gpu

EVERY_BYTE = np.concatenate([np.arange(256), np.arange(256) << 8, [0xFFFF, 0x8001]])


def sym_page(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype("<u2").view(np.uint8).copy())


def test_cuda_kernel_equals_cpu_kernel_for_every_multiplier_constant():
    cuda = by_name("cuda")
    page = sym_page(EVERY_BYTE)
    for start in range(0, 1 << 16, 16384):
        consts = Coefficients(np.arange(start, start + 16384)[:, None])
        want = torch.empty((consts.rows, page.numel()), dtype=torch.uint8)
        CpuKernel().matmul(consts, [page], list(want))
        got = torch.empty_like(want, device="cuda")
        cuda.matmul(consts, [page.cuda()], list(got))
        assert torch.equal(got.cpu(), want), f"constants from {start:#x} differ"


@pytest.mark.parametrize("n_bytes", [16, 2, 6, 30, 4096 + 16, 4096 + 6])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 33])  # every row-pair variant
@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_cuda_kernel_equals_cpu_kernel_on_random_data(n_bytes, rows, misaligned, prefetch):
    rng = np.random.default_rng(n_bytes * 100 + rows)
    cols, offset = 19, 3  # 19 inputs: two full table stages and a partial one
    m = Coefficients(rng.integers(0, 1 << 16, (rows, cols + offset)))
    shift = 2 if misaligned else 0  # 2-byte aligned pages take the one-symbol path

    def pages(count):
        raw = torch.from_numpy(rng.integers(0, 256, (count, n_bytes + shift), dtype=np.uint8))
        return [raw[i, shift:] for i in range(count)]

    ins, xs, start = pages(cols), pages(cols), pages(rows)
    for accumulate in (False, True):
        want = [p.clone() for p in start]
        CpuKernel().matmul(m, ins, want, col_offset=offset, xor_with=xs, accumulate=accumulate)
        gbuf = torch.stack(start).cuda()
        got_outs = [gbuf[i] for i in range(rows)]
        kernel = by_name("cuda")
        kernel.prefetch, chosen = prefetch, kernel.prefetch
        try:
            kernel.matmul(
                m,
                [p.cuda() for p in ins],
                got_outs,
                col_offset=offset,
                xor_with=[p.cuda() for p in xs],
                accumulate=accumulate,
            )
        finally:
            kernel.prefetch = chosen
        for r in range(rows):
            assert torch.equal(got_outs[r].cpu(), want[r]), f"row {r} (accumulate={accumulate})"


def test_gpu_encode_equals_cpu_encode_with_odd_pages():
    rs = ReedSolomon(37, 16)
    data = torch.randint(0, 256, (37, 1001), dtype=torch.uint8)
    assert torch.equal(rs.encode(data.cuda()).cpu(), rs.encode(data))


def test_full_group_of_2mib_pages_rebuilds_16_pages_and_updates_on_gpu():
    D, S = 1024, 2 << 20
    code = TwoTierCode(D, 16, 1)
    data = torch.randint(-(2**31), 2**31 - 1, (D, S // 4), dtype=torch.int32, device="cuda").view(
        torch.float32
    )
    t1, t2 = code.encode(data)
    want = data.clone()
    # A chunk of 64 pages changes: the incremental update must equal re-encoding.
    new = torch.randn(64, S // 4, device="cuda")
    old = data[128:192].clone()
    data[128:192] = new
    want[128:192] = new
    code.update(t1, t2, 128, old, new)
    assert code.verify(data, t1, t2)
    lost = list(range(500, 516))
    data[lost] = float("nan")
    t1[3].fill_(0)
    code.reconstruct(data, t1, t2, lost_data=lost, lost_tier1=[3])
    assert torch.equal(data.view(torch.int32), want.view(torch.int32))
    assert code.verify(data, t1, t2)
