"""Vectorized host kernel: NumPy gathers from 8-bit split multiplication tables.

For a coefficient c, ``c·d = LO_c[d & 0xFF] ⊕ HI_c[d >> 8]`` (multiplication is linear
over GF(2), so the two byte halves multiply separately). One gather of shape (R, n)
per input page covers all R output rows at once. Runs in the calling process on CPU
tensors (zero-copy through ``Tensor.numpy()``). Throughput is tens of MB/s per core
for 16 parities: enough for host-side tier-2 parity and the CPU build's small pages,
not for gigabytes of HBM (that is the CUDA kernel's job).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from leto.erasure.field import mul_vec
from leto.erasure.kernels.api import Coefficients, GFKernel
from nvbit_tools import tripwire

_BYTES = np.arange(256, dtype=np.int64)


def split_tables(coeffs: Coefficients) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), each K × R × 256 uint16: products with the low and the high byte."""
    tables = coeffs.derived.get("cpu")
    if tables is None:
        m = coeffs.matrix.T[:, :, None]  # K × R × 1
        lo = mul_vec(m, _BYTES[None, None, :]).astype(np.uint16)
        hi = mul_vec(m, (_BYTES << 8)[None, None, :]).astype(np.uint16)
        tables = (lo, hi)
        coeffs.derived["cpu"] = tables
    return tables


class CpuKernel(GFKernel):
    name = "cpu"

    def matmul(
        self,
        coeffs: Coefficients,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        *,
        col_offset: int = 0,
        xor_with: Sequence[torch.Tensor] | None = None,
        accumulate: bool = False,
    ) -> None:
        if tripwire.armed():  # faultkit kernel-abort: emulate a kernel stopped mid-way
            tmp = [o.clone() for o in outputs]
            self._matmul(coeffs, inputs, tmp, col_offset, xor_with, accumulate)
            tripwire.land(outputs, tmp, columns=True)
        self._matmul(coeffs, inputs, outputs, col_offset, xor_with, accumulate)

    @staticmethod
    def _matmul(coeffs, inputs, outputs, col_offset, xor_with, accumulate) -> None:
        lo, hi = split_tables(coeffs)
        n_sym = outputs[0].numel() // 2
        rows = len(outputs)
        if accumulate:
            acc = np.stack([o.numpy().view("<u2") for o in outputs])
        else:
            acc = np.zeros((rows, n_sym), dtype="<u2")
        for k, page in enumerate(inputs):
            d = page.numpy().view("<u2")
            if xor_with is not None:
                d = d ^ xor_with[k].numpy().view("<u2")
            col = col_offset + k
            acc ^= lo[col, :rows][:, d & 0xFF]
            acc ^= hi[col, :rows][:, d >> 8]
        for r, o in enumerate(outputs):
            o.numpy().view("<u2")[:] = acc[r]
