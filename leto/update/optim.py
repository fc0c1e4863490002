"""AdamW on a piece of retained state, bit-identical to ``torch.optim.AdamW(foreach=False)``.

Runs in the trainer on whatever device the state lives. It calls torch's own
single-tensor AdamW (``torch.optim.adamw.adamw`` with ``foreach=False``) on views of
the piece, with the step count the whole run has reached, so the arithmetic is exactly
torch's; element-wise ops do not depend on where a tensor is cut (checked in tests).
Gradient clipping multiplies the gradient piece by the clipping coefficient, as
``clip_grad_norm_`` does in place. For bf16 parameters the update runs on the fp32
master piece (the clipped bf16 gradient cast to fp32), then the parameter piece is the
master rounded to bf16.

Not covered: amsgrad, maximize, fused/foreach kernels (they round differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw


@dataclass(frozen=True)
class AdamWConfig:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0


def clip_coefficient(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The coefficient ``clip_grad_norm_(foreach=False)`` multiplies gradients by."""
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def adamw_piece(
    cfg: AdamWConfig,
    *,
    lr: float,
    step: int,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    clip: torch.Tensor,
    master: torch.Tensor | None = None,
) -> None:
    """One AdamW step (the ``step``-th, from 1) on a piece, in place."""
    g = grad * clip  # clip_grad_norm_ scales in the gradient's dtype ...
    if master is not None:
        g = g.float()  # ... and the fp32 master takes the scaled gradient
    target = param if master is None else master
    adamw(
        [target],
        [g],
        [exp_avg],
        [exp_avg_sq],
        [],
        [torch.tensor(float(step - 1))],
        foreach=False,
        amsgrad=False,
        beta1=cfg.beta1,
        beta2=cfg.beta2,
        lr=lr,
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        maximize=False,
    )
    if master is not None:
        param.copy_(master)
