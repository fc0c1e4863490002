"""The contract every codec kernel implements, and the coefficient matrix it consumes.

Contract (checked by tests against the reference on random data)::

    for every symbol position s and output row r:
        out[r][s] = (out[r][s] if accumulate else 0)
                    ⊕ Σ_k M[r][col_offset + k] · (inputs[k][s] ⊕ xor_with[k][s])

Pages are 1-D uint8 tensors of one even length (whole little-endian 16-bit symbols);
the codec pads odd pages before calling. Outputs must not alias inputs. A kernel does
not validate its arguments beyond what it needs to stay memory-safe: the codec does.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
import torch


class Coefficients:
    """An immutable R × K coefficient matrix plus per-kernel derived tables.

    Kernels cache what they derive (multiplication tables, device copies) in
    ``derived`` so that a constant matrix such as the generator is prepared once.
    """

    __slots__ = ("matrix", "derived")

    def __init__(self, matrix: np.ndarray):
        m = np.array(matrix, dtype=np.int64)
        if m.ndim != 2 or (m < 0).any() or (m >= 1 << 16).any():
            raise ValueError("coefficients must be a 2-D matrix of 16-bit field elements")
        m.setflags(write=False)
        self.matrix = m
        self.derived: dict[object, object] = {}

    @property
    def rows(self) -> int:
        return self.matrix.shape[0]

    @property
    def cols(self) -> int:
        return self.matrix.shape[1]


class GFKernel(abc.ABC):
    name: str

    @abc.abstractmethod
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
        """Apply the contract above in place on ``outputs``."""
