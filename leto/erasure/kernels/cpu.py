"""Host kernel: lookups in 8-bit split multiplication tables.

For a coefficient c, ``c·d = LO_c[d & 0xFF] ⊕ HI_c[d >> 8]`` (multiplication is linear
over GF(2), so the two byte halves multiply separately). Runs in the calling process
on CPU tensors. Two implementations of the same arithmetic on the same tables:

* ``gf_cpu.c`` (built once per machine with the C compiler, ``leto.native``): one call
  per matmul, blocks of symbols kept in cache — what runs when a compiler is there;
* NumPy gathers (one of shape (R, n) per input page, zero-copy through
  ``Tensor.numpy()``; tens of MB/s per core for 16 parities): the fallback without a
  compiler (``LETO_CPU_CODEC=numpy`` forces it), and the twin the tests compare the C
  kernel with.

Either is enough for host-side tier-2 parity and the CPU build's small pages, not for
gigabytes of HBM (that is the CUDA kernel's job).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from leto.erasure.field import mul_vec
from leto.erasure.kernels.api import Coefficients, GFKernel
from nvbit_tools import tripwire

_BYTES = np.arange(256, dtype=np.int64)
ENV_CPU_CODEC = "LETO_CPU_CODEC"  # "numpy": the NumPy gathers even where C builds
SOURCE = Path(__file__).with_name("gf_cpu.c")


@functools.cache
def native():
    """The C kernel's function, or None (no compiler, or ``LETO_CPU_CODEC=numpy``)."""
    if os.environ.get(ENV_CPU_CODEC) == "numpy":
        return None
    from leto.errors import InvalidInput
    from leto.native import build_shared, compiler

    try:
        cc = compiler("CC", ("cc", "gcc"), f"the host codec kernel ({SOURCE.name})")
        lib = ctypes.CDLL(str(build_shared(SOURCE, "gf_cpu", cc, ["-O3", "-fPIC"])))
    except InvalidInput:
        return None  # the NumPy gathers compute the same
    fn = lib.leto_gf_matmul
    p = ctypes.c_void_p
    fn.argtypes = [p, p, ctypes.c_int64, p, p, p, ctypes.c_int64, p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int]  # fmt: skip
    fn.restype = None
    return fn


def split_tables(coeffs: Coefficients) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), each K × R × 256 uint16: products with the low and the high byte."""
    tables = coeffs.derived.get("cpu")
    if tables is None:
        m = coeffs.matrix.T[:, :, None]  # K × R × 1
        # C order: the C kernel indexes [col][row][byte] (the transposed matrix would
        # otherwise leave the tables in its memory order).
        lo = mul_vec(m, _BYTES[None, None, :]).astype(np.uint16, order="C")
        hi = mul_vec(m, (_BYTES << 8)[None, None, :]).astype(np.uint16, order="C")
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
        fn = native()
        if fn is not None and len(inputs):
            _matmul_c(fn, coeffs, inputs, outputs, col_offset, xor_with, accumulate)
        else:
            _matmul_numpy(coeffs, inputs, outputs, col_offset, xor_with, accumulate)


def _ptrs(tensors) -> np.ndarray:
    return np.fromiter((t.data_ptr() for t in tensors), dtype=np.int64, count=len(tensors))


def _matmul_c(fn, coeffs, inputs, outputs, col_offset, xor_with, accumulate) -> None:
    lo, hi = split_tables(coeffs)
    for t in (*inputs, *outputs, *(xor_with or ())):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the host codec kernel takes contiguous CPU pages")
    ins, outs = _ptrs(inputs), _ptrs(outputs)
    xors = _ptrs(xor_with) if xor_with is not None else np.zeros(len(inputs), dtype=np.int64)
    cols = np.arange(col_offset, col_offset + len(inputs), dtype=np.int64)
    fn(lo.ctypes.data, hi.ctypes.data, lo.shape[1], ins.ctypes.data, xors.ctypes.data,
       cols.ctypes.data, len(inputs), outs.ctypes.data, len(outputs),
       outputs[0].numel() * outputs[0].element_size() // 2, int(accumulate))  # fmt: skip


def _matmul_numpy(coeffs, inputs, outputs, col_offset, xor_with, accumulate) -> None:
    """The NumPy twin of gf_cpu.c (the fallback, and what the tests compare it with)."""
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
