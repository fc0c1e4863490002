"""The slow, obviously correct kernel: one symbol at a time with shift-and-add multiply.

Runs on the host only (pages on other devices are copied to the host and back). It
shares no table with the fast kernels, so agreeing with it means something. Use it on
pages of a few hundred bytes: it does ~10^5 multiplies a second.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leto.erasure.field import mul_slow
from leto.erasure.kernels.api import Coefficients, GFKernel


def _symbols(page: torch.Tensor) -> list[int]:
    b = page.cpu().tolist()
    return [b[2 * s] | (b[2 * s + 1] << 8) for s in range(len(b) // 2)]


class ReferenceKernel(GFKernel):
    name = "reference"

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
        ins = [_symbols(p) for p in inputs]
        if xor_with is not None:
            ins = [
                [a ^ b for a, b in zip(x, _symbols(y), strict=True)]
                for x, y in zip(ins, xor_with, strict=True)
            ]
        for r, out in enumerate(outputs):
            acc = _symbols(out) if accumulate else [0] * (out.numel() // 2)
            for k, sym in enumerate(ins):
                c = int(coeffs.matrix[r, col_offset + k])
                for s, d in enumerate(sym):
                    acc[s] ^= mul_slow(c, d)
            raw = []
            for v in acc:
                raw += [v & 0xFF, v >> 8]
            out.copy_(torch.tensor(raw, dtype=torch.uint8))
