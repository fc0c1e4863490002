"""The Horner scheme of the code's parity checks: parity changes by shifts, not tables.

Runs wherever parity of a run of pages is computed with few parity pages: the codec's
CUDA kernel (``gf_horner_h*`` in ``kernels/gf_matmul.cu``), the fused chunk pass
(``leto.update.chunk_pass``) and, as their twin, NumPy on the CPU.

With the code's checks at α^b .. α^(b+H-1) (``field.rs_generator``), the parity of data
columns c0 .. c0+k-1 holding ``Δ_0 .. Δ_(k-1)`` is ``C_P⁻¹ · σ`` with
``σ_r = Σ_j α^((b+r)·(c0+j)) · Δ_j``. Walking the columns in order,
``t_r <- t_r · α^-(b+r) ⊕ Δ_j`` ends with ``t_r = Σ_j α^(-(b+r)·(k-1-j)) · Δ_j``, so
``σ_r = α^((b+r)·(c0+k-1)) · t_r`` and the parity is ``M · t`` with
``M = C_P⁻¹ · diag(α^((b+r)·(c0+k-1)))`` (``horner_matrix``, built on the host once per
run shape). Each step multiplies two 16-bit symbols of a 32-bit word by α^±1 or α^±2:
a shift, a mask and a conditional XOR of the field polynomial — no table lookups, which
is what bounded the table kernels (issue 46). The multiply by M, H² table products a
symbol, happens once per run, not once per column.

Not covered: more than ``HORNER_ROWS`` parity pages (steps of α^±3 and beyond cost as
much as a table multiply: the table kernels run there).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from leto.erasure import field

HORNER_ROWS = 4
ENV = "LETO_HORNER"  # "0": the table kernels everywhere (benchmarks compare both)


def applies(parity_pages: int) -> bool:
    """Whether parity of a code with this many parity pages takes the Horner scheme."""
    return parity_pages <= HORNER_ROWS and os.environ.get(ENV, "1") != "0"


@functools.cache
def _checks_inverse(data_pages: int, parity_pages: int) -> np.ndarray:
    c = field.check_matrix(data_pages + parity_pages, parity_pages)
    return field.mat_inv(c[:, data_pages:])


def horner_matrix(data_pages: int, parity_pages: int, col0: int, k: int) -> np.ndarray:
    """``M`` (H × H) of the run of ``k`` data columns from ``col0``: parity = ``M · t``."""
    e = np.arange(parity_pages, dtype=np.int64) + field.first_root(parity_pages)
    scale = field.power(e * (col0 + k - 1))
    return field.mul_vec(_checks_inverse(data_pages, parity_pages), scale[None, :])


def mul_a(w: np.ndarray) -> np.ndarray:
    """x · α for the two 16-bit symbols of each uint32 word (gf_horner.cuh's mul_a)."""
    return ((w << 1) & 0xFFFEFFFE) ^ (((w >> 15) & 0x00010001) * 0x2D)


def mul_a_inv(w: np.ndarray) -> np.ndarray:
    """x · α^-1 (gf_horner.cuh's mul_a_inv): odd x is (x ⊕ 0x1002D) >> 1."""
    return ((w >> 1) & 0x7FFF7FFF) ^ ((w & 0x00010001) * 0x8016)


def mul_a_pow(w: np.ndarray, e: int) -> np.ndarray:
    """x · α^e (gf_horner.cuh's mul_a_pow): ``e`` steps of ``mul_a`` or ``mul_a_inv``."""
    for _ in range(max(e, 0)):
        w = mul_a(w)
    for _ in range(max(-e, 0)):
        w = mul_a_inv(w)
    return w


def horner_sums(h: int, old: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sums ``t_r`` (r < h) of the changes ``old[j] ⊕ new[j]`` of a run of columns
    (CPU byte pages of one length, a multiple of 4), as the CUDA kernels compute them:
    the same shift steps on two symbols a word."""
    b = field.first_root(h)
    t = [np.zeros(old[0].numel() // 4, dtype=np.uint32) for _ in range(h)]
    for o, n in zip(old, new, strict=True):
        d = o.numpy().view(np.uint32) ^ n.numpy().view(np.uint32)
        for r in range(h):
            t[r] = mul_a_pow(t[r], -(b + r)) ^ d
    return [torch.from_numpy(x.view(np.uint8)) for x in t]
