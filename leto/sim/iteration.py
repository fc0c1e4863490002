"""The iteration-time model of the paper's Appendix C.1: ``T_iter = T_pipeline + T_sync +
T_update`` from single-stage profile numbers.

Owns the arithmetic; the numbers come from a profile (``leto.sim.profiles``, fields in
docs/sim.md):

* ``T_pipeline = (M + (S - 1) / v) * max_s stage(s)``, stage(s) = the stage's bracket
  times plus its inter-stage transfers, plus the embedding on the first stage and the
  output head and loss on the last (C.1.1);
* gradient synchronisation as Megatron's bucket queue (C.1.3): buckets of
  ``max(40M, 1M * dp)`` parameters, bucket i ready at ``r_i = ρ_i W`` (ρ_i the
  fraction of the stage's parameters in buckets 1..i, W the backward window), one
  collective in flight, ``f_i = max(r_i, f_{i-1}) + w_i`` with ``f_0 = 0``; exposure
  ``E = max(0, f_n - W)``; ``w_i`` from an alpha-beta collective fit times a concurrency
  penalty;
* interference: dense models ``T_sync = E + c (Σw - E)``; MoE whose expert all-to-all
  crosses nodes ``T_sync = E' + f min(G, A)`` with ``E'`` evaluated against the
  stretched window ``W + f min(G, A)``; intra-node MoE uses ``T_sync = E``;
* ``T_update``: optimizer step over this rank's share of the parameters at a memory
  bandwidth, a scalar reduction, and for sharded optimizers the parameter all-gather.

Runs in any process. Not covered: the paper's fitted send/receive curve (a profile gives
the transfer time directly), per-layer bracket heterogeneity inside a stage beyond what
the profile lists, and overlap of the parameter all-gather with the next forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leto.errors import InvalidInput

MILLION = 1_000_000


@dataclass(frozen=True)
class Collective:
    """Alpha-beta fit of a ring collective: ``alpha_s + factor * bytes / bus_bytes_per_s``
    with factor ``2 (n-1)/n`` for all-reduce, ``(n-1)/n`` for reduce-scatter/all-gather."""

    alpha_s: float
    bus_bytes_per_s: float

    def time_s(self, nbytes: float, ranks: int, op: str) -> float:
        if ranks <= 1:
            return 0.0
        factor = {"all-reduce": 2.0, "reduce-scatter": 1.0, "all-gather": 1.0}[op]
        return self.alpha_s + factor * (ranks - 1) / ranks * nbytes / self.bus_bytes_per_s


@dataclass(frozen=True)
class IterationProfile:
    """Single-stage profile of a deployment; see docs/sim.md for each field."""

    microbatches: int  # M per data-parallel replica
    pp: int  # S
    virtual_stages: int  # v
    dp: int
    stage_brackets_s: tuple[float, ...]  # per-stage sum of bracket fwd+bwd times per microbatch
    p2p_s: float  # inter-stage transfer per microbatch (both directions)
    embedding_s: float  # first stage only, per microbatch
    head_loss_s: float  # last stage only, per microbatch
    backward_window_s: float  # W: the last microbatch's backward on a stage
    stage_params: int  # parameters of the bottleneck stage held by this rank's DP group
    grad_bytes_per_param: float
    grad_collective: Collective
    concurrency_penalty: float  # multiplies w_i (two collectives sharing the fabric)
    interference: str  # "dense", "moe-cross-node" or "none"
    interference_c: float  # dense: c = R / (T_sync - E)
    interference_f: float  # MoE cross-node: f = R / min(G, A)
    a2a_backward_s: float  # A: MoE all-to-all time inside the backward window
    optimizer_sharded: bool
    rank_params: int  # parameters this rank updates before sharding
    optimizer_bytes_per_param: float  # bytes the optimizer step moves per parameter
    hbm_bytes_per_s: float
    scalar_reduce_s: float
    param_bytes_per_param: float  # all-gathered after a sharded update

    def __post_init__(self) -> None:
        if len(self.stage_brackets_s) != self.pp:
            raise InvalidInput(
                f"stage_brackets_s has {len(self.stage_brackets_s)} stages, pp={self.pp}"
            )
        if self.interference not in ("dense", "moe-cross-node", "none"):
            raise InvalidInput(f"interference={self.interference!r}: dense, moe-cross-node, none")
        for name in ("microbatches", "pp", "virtual_stages", "dp", "stage_params"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name}={getattr(self, name)!r}: expected >= 1")


@dataclass(frozen=True)
class IterationBreakdown:
    t_pipeline_s: float
    t_sync_serial_s: float  # Σ w_i: all buckets back to back
    exposed_s: float  # E (or E' for MoE cross-node)
    t_sync_s: float  # what the iteration pays with overlap on
    t_update_s: float
    buckets: int

    @property
    def t_iter_s(self) -> float:
        return self.t_pipeline_s + self.t_sync_s + self.t_update_s


def stage_times_s(p: IterationProfile) -> list[float]:
    """stage(s): brackets plus transfers, plus embedding (first) and head + loss (last)."""
    out = []
    for s, brackets in enumerate(p.stage_brackets_s):
        t = brackets + (p.p2p_s if p.pp > 1 else 0.0)
        if s == 0:
            t += p.embedding_s
        if s == p.pp - 1:
            t += p.head_loss_s
        out.append(t)
    return out


def pipeline_s(p: IterationProfile) -> float:
    """``(M + (S - 1) / v) * max_s stage(s)`` (C.1.1)."""
    return (p.microbatches + (p.pp - 1) / p.virtual_stages) * max(stage_times_s(p))


def bucket_params(stage_params: int, dp: int) -> list[int]:
    """Megatron's gradient buckets: ``max(40M, 1M * dp)`` parameters each, the last partial."""
    size = max(40 * MILLION, MILLION * dp)
    full, rest = divmod(stage_params, size)
    return [size] * full + ([rest] if rest else [])


def exposure_s(transfer_s: list[float], sizes: list[int], window_s: float) -> float:
    """The bucket queue of C.1.3: ``E = max(0, f_n - W)`` with ``r_i = ρ_i W`` and
    ``f_i = max(r_i, f_{i-1}) + w_i``, one collective in flight."""
    total = sum(sizes)
    f, acc = 0.0, 0
    for w, n in zip(transfer_s, sizes, strict=True):
        acc += n
        f = max(acc / total * window_s, f) + w
    return max(0.0, f - window_s)


def exposure_reference_s(
    transfer_s: list[float], sizes: list[int], window_s: float, tick_s: float
) -> float:
    """Slow twin of ``exposure_s``: a clock ticking ``tick_s`` at a time; at each tick the
    next bucket launches if backward has produced all its parameters and the channel is
    free. Each launch lands at most one tick late, so it differs from ``exposure_s`` by at
    most ``len(sizes) * tick_s``. For tests."""
    total = sum(sizes)
    ready = [sum(sizes[: i + 1]) / total * window_s for i in range(len(sizes))]
    t, i, free_at = 0.0, 0, 0.0
    while i < len(sizes):
        if t >= ready[i] and t >= free_at:
            free_at = t + transfer_s[i]
            i += 1
        else:
            t += tick_s
    return max(0.0, free_at - window_s)


def breakdown(p: IterationProfile) -> IterationBreakdown:
    """Every term of ``T_iter`` for profile ``p``."""
    sizes = bucket_params(p.stage_params, p.dp)
    op = "reduce-scatter" if p.optimizer_sharded else "all-reduce"
    w = [
        p.grad_collective.time_s(n * p.grad_bytes_per_param, p.dp, op) * p.concurrency_penalty
        for n in sizes
    ]
    serial = sum(w)
    if p.interference == "moe-cross-node":
        stretch = p.interference_f * min(serial, p.a2a_backward_s)
        exposed = exposure_s(w, sizes, p.backward_window_s + stretch)
        sync = exposed + stretch
    elif p.interference == "dense":
        exposed = exposure_s(w, sizes, p.backward_window_s)
        sync = exposed + p.interference_c * (serial - exposed)
    else:
        exposed = exposure_s(w, sizes, p.backward_window_s)
        sync = exposed
    share = p.rank_params / (p.dp if p.optimizer_sharded else 1)
    update = share * p.optimizer_bytes_per_param / p.hbm_bytes_per_s + p.scalar_reduce_s
    if p.optimizer_sharded:
        update += p.grad_collective.time_s(
            p.rank_params * p.param_bytes_per_param, p.dp, "all-gather"
        )
    return IterationBreakdown(pipeline_s(p), serial, exposed, sync, update, len(sizes))


def t_iter_s(p: IterationProfile) -> float:
    t = breakdown(p).t_iter_s
    if not (math.isfinite(t) and t > 0):
        raise InvalidInput(f"profile gives T_iter={t!r}; check its fields")
    return t
