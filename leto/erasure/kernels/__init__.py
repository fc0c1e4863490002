"""Bulk page arithmetic: ``out[r] (⊕)= Σ_k M[r][k] · (in[k] ⊕ in2[k])`` over GF(2^16).

Three implementations of one contract (``api.GFKernel``), producing identical bytes:
``reference`` (per-symbol Python, obviously correct, tiny inputs only), ``cpu``
(NumPy, 8-bit split tables), ``cuda`` (CUDA C++ through CuPy/NVRTC, 4-bit tables in
shared memory, tensors stay on the GPU). ``for_device`` picks the fast one.
"""

from __future__ import annotations

import torch

from leto.erasure.kernels.api import Coefficients, GFKernel
from leto.erasure.kernels.cpu import CpuKernel
from leto.erasure.kernels.reference import ReferenceKernel

__all__ = ["Coefficients", "GFKernel", "CpuKernel", "ReferenceKernel", "for_device", "by_name"]

_KERNELS: dict[str, GFKernel] = {}


def by_name(name: str) -> GFKernel:
    """The kernel called ``name`` ("reference", "cpu" or "cuda"), created once."""
    if name not in _KERNELS:
        if name == "reference":
            _KERNELS[name] = ReferenceKernel()
        elif name == "cpu":
            _KERNELS[name] = CpuKernel()
        elif name == "cuda":
            from leto.erasure.kernels.cuda import CudaKernel

            _KERNELS[name] = CudaKernel()
        else:
            raise ValueError(f"unknown codec kernel {name!r}; choose reference, cpu or cuda")
    return _KERNELS[name]


def for_device(device: torch.device) -> GFKernel:
    return by_name("cuda" if device.type == "cuda" else "cpu")
