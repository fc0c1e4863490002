"""AdamW on a piece of retained state, bit-identical to ``torch.optim.AdamW(foreach=False)``.

Runs in the trainer on whatever device the state lives. It calls torch's own
single-tensor AdamW (``torch.optim.adamw.adamw`` with ``foreach=False``) on views of
the piece, with the step count the whole run has reached, so the arithmetic is exactly
torch's; element-wise ops do not depend on where a tensor is cut (checked in tests).
Gradient clipping multiplies the gradient piece by the clipping coefficient, as
``clip_grad_norm_`` does in place. For bf16 parameters the update runs on the fp32
master piece (the clipped bf16 gradient cast to fp32), then the parameter piece is the
master rounded to bf16.

``muon_layer`` is the layer-wise optimizer: Muon (orthogonalized momentum, Newton–Schulz)
on a whole 2-D weight through torch's own single-tensor Muon, bit-identical to
``torch.optim.Muon``; its chunk is the whole layer.

Not covered: amsgrad, maximize, fused/foreach kernels (they round differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim._muon import muon
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


@dataclass(frozen=True)
class MuonConfig:
    """torch.optim.Muon's hyperparameters for 2-D weights (others use AdamW)."""

    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.1
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    ns_steps: int = 5
    eps: float = 1e-7
    adjust_lr_fn: str | None = None
    lr_scale: float = 1.0  # Muon's learning rate = the schedule's times this
    exclude: tuple[str, ...] = ()  # parameter-name prefixes kept on AdamW (e.g. embeddings)


def muon_layer(
    cfg: MuonConfig,
    *,
    lr: float,
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    clip: torch.Tensor,
    master: torch.Tensor | None = None,
) -> None:
    """One Muon step on a whole 2-D layer, through torch's own single-tensor Muon
    (``torch.optim.Muon``'s arithmetic); the momentum buffer is the retained state."""
    g = grad * clip
    if master is not None:
        g = g.float()
    target = param if master is None else master
    muon(
        [target],
        [g],
        [momentum],
        lr=lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_coefficients=cfg.ns_coefficients,
        ns_steps=cfg.ns_steps,
        eps=cfg.eps,
        adjust_lr_fn=cfg.adjust_lr_fn,
        has_complex=False,
    )
    if master is not None:
        param.copy_(master)
