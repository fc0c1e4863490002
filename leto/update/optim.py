"""AdamW on a piece of retained state, bit-identical to torch's own AdamW.

Runs in the trainer on whatever device the state lives. Two implementations, chosen by
``AdamWConfig.impl``, each calling torch's own kernel so the arithmetic is exactly
torch's:

* ``"fused"`` (default; what users run): ``torch._fused_adamw_`` — the kernel behind
  ``torch.optim.AdamW(fused=True)`` — on every parameter piece of a chunk at once, one
  launch on CUDA. AdamW is element-wise, but the CPU kernel is not position-blind (its
  vector body and scalar tail round differently), so pieces are cut per parameter at
  multiples of ``CUT_ELEMS`` from its start; tests cut at random such offsets, odd
  sizes included, on CPU and CUDA.
* ``"single"``: torch's single-tensor AdamW (``foreach=False``) per parameter piece.

The step count the whole run has reached is passed in (as the float32 step tensor the
fused optimizer keeps). Gradient clipping multiplies the gradient piece by the
coefficient, as ``clip_grad_norm_`` does in place; the coefficient comes from
``clip_coefficient`` with the same ``foreach`` choice as the user's
``clip_grad_norm_`` (``_foreach_norm`` and the per-tensor norm reduce in different
orders). For bf16 parameters the update runs on the fp32 master piece (the clipped
bf16 gradient cast to fp32), then the parameter piece is the master rounded to bf16.

``muon_layer`` is the layer-wise optimizer: Muon (orthogonalized momentum, Newton–Schulz)
on a whole 2-D weight through torch's own single-tensor Muon, bit-identical to
``torch.optim.Muon``; its chunk is the whole layer.

Not covered: amsgrad, maximize, the ``foreach=True`` AdamW kernel (it rounds
differently from both), per-parameter-group hyperparameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim._muon import muon
from torch.optim.adamw import adamw

IMPLS = ("fused", "single")
# Pieces of a parameter given to the fused kernel start at multiples of this many
# elements from the parameter's start (CPU: whole 16-lane vectors, with room to spare).
CUT_ELEMS = 64


@dataclass(frozen=True)
class AdamWConfig:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    # "fused": bit-identical to AdamW(fused=True) with clip_grad_norm_(foreach=True);
    # "single": to AdamW(foreach=False) with clip_grad_norm_(foreach=False).
    impl: str = "fused"

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"AdamWConfig.impl={self.impl!r}: choose one of {IMPLS}")

    @property
    def clip_foreach(self) -> bool:
        return self.impl == "fused"


def clip_coefficient(
    grads: list[torch.Tensor], max_norm: float, foreach: bool = False
) -> torch.Tensor:
    """The coefficient ``clip_grad_norm_(foreach=foreach)`` multiplies gradients by.

    With ``foreach`` the per-tensor norms come from ``torch._foreach_norm`` (on CUDA
    its vectorized path needs 16-byte aligned tensors: the retained layout aligns every
    parameter so, as the caching allocator does)."""
    if foreach:
        norms = list(torch._foreach_norm(grads, 2.0))
    else:
        norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def adamw_fused(
    cfg: AdamWConfig,
    *,
    lr: float,
    step: int,
    param: list[torch.Tensor],
    grad: list[torch.Tensor],
    exp_avg: list[torch.Tensor],
    exp_avg_sq: list[torch.Tensor],
    clip: torch.Tensor,
    master: list[torch.Tensor] | None = None,
) -> None:
    """One fused AdamW step (the ``step``-th, from 1), in place, on pieces of
    parameters: one ``torch._fused_adamw_`` call (one launch on CUDA) for them all.

    Each piece must start at a multiple of ``CUT_ELEMS`` elements of its parameter and
    must not span two parameters: the CPU kernel runs 16-lane vectors from a tensor's
    start and a scalar tail at its end, which round differently (CUDA's is per element)."""
    if not param:
        return
    # clip_grad_norm_'s _foreach_mul_, into scratch: the retained gradients stay intact.
    g = list(torch._foreach_mul(grad, clip))
    if master is not None:
        g = [x.float() for x in g]
    target = param if master is None else master
    # AdamW(fused=True) keeps the step as a float32 tensor on the parameter's device and
    # increments it before the kernel; the kernel reads the incremented value.
    steps = [torch.full((), float(step), dtype=torch.float32, device=target[0].device)] * len(
        target
    )
    torch._fused_adamw_(
        target,
        g,
        exp_avg,
        exp_avg_sq,
        [],
        steps,
        amsgrad=False,
        lr=lr,
        beta1=cfg.beta1,
        beta2=cfg.beta2,
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        maximize=False,
    )
    if master is not None:
        torch._foreach_copy_(param, master)


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
