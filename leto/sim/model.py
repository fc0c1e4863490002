"""The analytic ETTR model of the paper's Appendix C.3 (Eq. 6–8) and Young's interval.

Owns the closed forms: ``ETTR = (T_iter / T_eff) * (1 - T_rec / MTTF)`` with
``T_rec = T_det + T_init + L * T_eff``, per system:

* interval checkpointing (Gemini+, torchrun + disk): ``T_eff = T_iter + T_ckpt / I`` and
  ``L = I / 2 + 1`` for every failure (Eq. 7);
* Leto: a HOF costs ``T_det + T_init_hof + T_eff / 2`` (``L = 1/2``, Eq. 8); an FF falls
  back to the Gemini+ path, ``T_det + T_init_ff + (I / 2 + 1) * T_eff``, with checkpoints
  taken every ``I`` iterations, ``I`` from Young's formula at the FF-only MTTF
  ``M / (1 - h)`` (§8.1).

How Leto's two classes combine (our derivation; the paper states the parts, not the sum).
Failures arrive at rate ``1/M``; a fraction ``h`` are HOFs, so HOFs arrive at ``h/M`` and
FFs at ``(1-h)/M``. Repeating Eq. 2–5 with two classes, a run of ``T_eval`` seconds spends
``T_eval * (h/M) * T_rec_hof + T_eval * ((1-h)/M) * T_rec_ff`` in recovery, so Eq. 6 holds
with the rate-weighted mean ``E[T_rec] = h * T_rec_hof + (1 - h) * T_rec_ff``. The steady
cost is paid by every iteration: ``T_eff = (1 + ω) * T_iter + T_ckpt / I``. Eq. 8 prints
``T_eff = (1 + ω) T_iter``; the text beside it says Leto's steady cost is "T_ckpt / I plus
the per-iteration overhead of RMU ω", so we keep the checkpoint term (it vanishes as
``I → ∞`` at ``h = 1``). At ``h = 1`` Young's formula has no finite answer and the paper
uses "the largest interval tested"; callers pass that as ``max_interval``.

Runs in any process (pure arithmetic). Not covered: failures that overlap a recovery
(Eq. 6's assumption (2); ``leto.sim.events`` simulates them), checkpoint windows of
sparse systems (MoEvement) and JIT checkpointing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leto.errors import InvalidInput

INTERVAL = "interval"  # checkpoint every I iterations, roll back on every failure
LETO = "leto"  # in-place HOF recovery, interval checkpoints for FFs only


@dataclass(frozen=True)
class Job:
    """The training job and its failure process.

    ``t_iter_s`` is the uncheckpointed iteration time, ``ckpt_p`` the normalised
    per-checkpoint cost p (excess time of a checkpointing iteration / ``t_iter_s``,
    Appendix C.2), ``mttf_s`` the overall MTTF M and ``hof_ratio`` h.
    """

    t_iter_s: float
    ckpt_p: float
    mttf_s: float
    hof_ratio: float = 1.0

    def __post_init__(self) -> None:
        for name in ("t_iter_s", "mttf_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise InvalidInput(f"Job.{name}={v!r}: expected a finite value > 0")
        if not (math.isfinite(self.ckpt_p) and self.ckpt_p >= 0):
            raise InvalidInput(f"Job.ckpt_p={self.ckpt_p!r}: expected a finite value >= 0")
        if not 0.0 <= self.hof_ratio <= 1.0:
            raise InvalidInput(f"Job.hof_ratio={self.hof_ratio!r}: expected a fraction in [0, 1]")

    @property
    def t_ckpt_s(self) -> float:
        return self.ckpt_p * self.t_iter_s

    @property
    def ff_mttf_s(self) -> float:
        """Mean time between FFs, ``M / (1 - h)``; infinite when every failure is a HOF."""
        return math.inf if self.hof_ratio >= 1.0 else self.mttf_s / (1.0 - self.hof_ratio)


@dataclass(frozen=True)
class System:
    """A recovery system's costs. ``kind`` is ``INTERVAL`` or ``LETO``.

    ``t_det_s``: failure detection; ``t_init_s``: preparing a replacement trainer on the
    checkpoint path (spare promotion plus checkpoint load; every failure of an interval
    system, FFs under Leto); ``t_init_hof_s``: Leto's in-place takeover by the shadow
    (ignored for interval systems); ``omega``: Leto's RMU steady-state overhead as a
    fraction of ``T_iter`` (0 for interval systems).
    """

    name: str
    kind: str
    t_det_s: float
    t_init_s: float
    t_init_hof_s: float = 0.0
    omega: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in (INTERVAL, LETO):
            raise InvalidInput(f"System.kind={self.kind!r}: expected {INTERVAL!r} or {LETO!r}")
        for name in ("t_det_s", "t_init_s", "t_init_hof_s", "omega"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise InvalidInput(f"System({self.name}).{name}={v!r}: expected finite >= 0")

    def init_s(self, kind: str) -> float:
        """Initialisation time of a recovery from a failure of class ``kind``."""
        return self.t_init_hof_s if (self.kind == LETO and kind == "HOF") else self.t_init_s

    def rolls_back(self, kind: str) -> bool:
        """Whether a failure of class ``kind`` rolls back to the last usable checkpoint."""
        return not (self.kind == LETO and kind == "HOF")


def young_interval(ckpt_p: float, mttf_s: float, t_iter_s: float) -> float:
    """Young's first-order optimum in iterations, ``I = sqrt(2 p MTTF / t_iter)``
    (Appendix C.2). It minimises ``first_order_overhead``; infinite when MTTF is."""
    if math.isinf(mttf_s):
        return math.inf
    return math.sqrt(2.0 * ckpt_p * mttf_s / t_iter_s)


def first_order_overhead(interval: float, ckpt_p: float, mttf_s: float, t_iter_s: float) -> float:
    """The fraction of time Young's derivation trades off: checkpoint cost ``p / I`` plus
    the expected rollback of ``I / 2`` iterations per failure, ``I * t_iter / (2 MTTF)``."""
    return ckpt_p / interval + interval * t_iter_s / (2.0 * mttf_s)


def exact_optimal_interval(job: Job, system: System) -> float:
    """The interval (real-valued) that maximises Eq. 6 for an interval system.

    With ``T_eff = t (1 + p/I)`` and ``T_rec = c + (I/2 + 1) T_eff`` (c = T_det + T_init),
    Eq. 6 reads ``ETTR(I) = (1 - c/M) I / (I + p) - (I/2 + 1) t / M``; setting the
    derivative to zero gives ``(I + p)^2 = 2 p (M - c) / t``, i.e.
    ``I* = sqrt(2 p (M - c) / t) - p``. Young's ``sqrt(2 p M / t)`` is its leading term.
    """
    c = system.t_det_s + system.t_init_s
    m = job.mttf_s
    return max(math.sqrt(2.0 * job.ckpt_p * max(m - c, 0.0) / job.t_iter_s) - job.ckpt_p, 0.0)


def choose_interval(job: Job, system: System, max_interval: int) -> int:
    """The checkpoint interval the paper uses (§8.1, Appendix C.2): Young's formula at the
    overall MTTF (interval systems) or at the FF MTTF ``M / (1 - h)`` (Leto), rounded to
    a whole number of iterations, at least 1, at most ``max_interval`` (the "largest
    interval tested", used when Young's interval is infinite)."""
    mttf = job.mttf_s if system.kind == INTERVAL else job.ff_mttf_s
    i = young_interval(job.ckpt_p, mttf, job.t_iter_s)
    if math.isinf(i):
        return max_interval
    return int(min(max(round(i), 1), max_interval))


@dataclass(frozen=True)
class Prediction:
    """Eq. 6 for one system: steady factor ``T_iter / T_eff``, recovery factor
    ``1 - E[T_rec] / M`` and their product, with the parts of the recovery."""

    system: str
    interval: int
    t_eff_s: float
    t_rec_s: float  # rate-weighted mean over failure classes
    t_rec_hof_s: float
    t_rec_ff_s: float
    steady_factor: float
    recovery_factor: float
    ettr: float


def ettr(t_iter_s: float, t_eff_s: float, t_rec_s: float, mttf_s: float) -> float:
    """Eq. 6: ``(T_iter / T_eff) * (1 - T_rec / MTTF)``. Valid while T_rec < MTTF; the
    linear form goes negative beyond, and we clamp at 0 rather than report it."""
    return max((t_iter_s / t_eff_s) * (1.0 - t_rec_s / mttf_s), 0.0)


def predict(job: Job, system: System, interval: int) -> Prediction:
    """Eq. 6–8 for ``system`` checkpointing every ``interval`` iterations (FFs only, for
    Leto). ``interval`` may be ``math.inf``-like large for no checkpoints at all."""
    if interval < 1:
        raise InvalidInput(f"interval={interval!r}: expected >= 1 iteration")
    omega = system.omega if system.kind == LETO else 0.0
    t_eff = (1.0 + omega) * job.t_iter_s + job.t_ckpt_s / interval
    rollback_l = interval / 2.0 + 1.0
    t_rec_ckpt = system.t_det_s + system.t_init_s + rollback_l * t_eff
    if system.kind == LETO:
        t_rec_hof = system.t_det_s + system.t_init_hof_s + 0.5 * t_eff
        t_rec_ff = t_rec_ckpt
    else:
        t_rec_hof = t_rec_ff = t_rec_ckpt
    h = job.hof_ratio
    t_rec = h * t_rec_hof + (1.0 - h) * t_rec_ff
    steady = job.t_iter_s / t_eff
    recovery = 1.0 - t_rec / job.mttf_s
    return Prediction(
        system.name,
        interval,
        t_eff,
        t_rec,
        t_rec_hof,
        t_rec_ff,
        steady,
        recovery,
        ettr(job.t_iter_s, t_eff, t_rec, job.mttf_s),
    )
