"""The preinitialization controller's policy: which level a shadow runs at (paper §6).

Pure and deterministic: no torch, no CUDA, no clock. It runs wherever the caller runs it
(the agent: ``levels.py``); every input is an argument and every output a ``Decision``
appended to ``Controller.decisions``, so a memory trace replayed through it gives the
same decisions on any machine.

Levels (paper §6): L1 — no GPU state; L2 — + CUDA context and library workspaces;
L3 — + process-group (NCCL) buffers. ``Footprints`` holds each level's device bytes
(the defaults are the paper's OLMoE/A100 figures; feed in values measured on the
machine, ``bench/preinit_footprint.py``).

Rules:

* headroom = capacity − observed active peak − margin; a level *fits* when its
  footprint ≤ headroom, or it holds no device memory (L1); "highest fitting level" is
  capped by ``max_level``.
* Reclaim now: at a sample (standing for an allocator cache miss) where device free
  memory, capacity − active − shadow footprint, is below ``reclaim_below_bytes`` and the
  shadow holds device memory. This is the same gate the allocator hook applies
  (``reclaim.py``), so a simulated trace and a real run take the same decisions.
* After a reclamation: relaunch at the highest fitting level *strictly below* the
  reclaimed one (or none), so a generation's level only goes down and a state is never
  rebuilt just to be reclaimed again.
* After a recovery (a new generation): the next shadow gets the highest fitting level
  for the peak observed during the generation that just ended — it may go up.

Use (``levels.py`` in the agent; ``simulate`` below)::

    ctl = Controller(PolicyConfig(capacity_bytes=total, footprints=measured))
    d = ctl.start(t)                      # level of the first shadow: d.level_to
    ctl.observe(t, active_bytes)          # simulation: a RECLAIM decision means "kill it"
    ctl.sample(t, active_bytes)           # live: the hook applies the gate; track the peak
    d = ctl.on_reclaim(t, free_before_bytes=..., free_after_bytes=..., latency_s=...)
    d = ctl.on_recovery(t, generation)    # level of the next generation's shadow
    ctl.level                             # what ``leto run`` shows

Not covered: several ranks per device, memory of other processes on the device
(capacity is what the active and its shadow may share), and predicting demand: the
policy reacts to observed peaks only.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Protocol

from leto.errors import InvalidInput

LEVELS = ("L1", "L2", "L3")  # lowest first: an index compares levels
MiB = 1 << 20
GiB = 1 << 30


def level_index(level: str | None) -> int:
    """-1 for no shadow, else the position in LEVELS."""
    if level is None:
        return -1
    if level not in LEVELS:
        raise InvalidInput(f"unknown preinitialization level {level!r}: use one of {LEVELS}")
    return LEVELS.index(level)


@dataclass(frozen=True)
class Footprints:
    """Device bytes a parked shadow holds at each level (cumulative: L3 includes L2)."""

    l1_bytes: int = 0  # no GPU state
    l2_bytes: int = (494 + 196) * MiB  # CUDA context + runtime-loaded modules (paper Fig. 7)
    l3_bytes: int = (494 + 196 + 1512) * MiB  # + NCCL communicator buffers (Fig. 7: 2.2 GiB)

    def __post_init__(self) -> None:
        b = (self.l1_bytes, self.l2_bytes, self.l3_bytes)
        if min(b) < 0 or list(b) != sorted(b):
            raise InvalidInput(
                f"footprints must be non-negative and non-decreasing L1 <= L2 <= L3, got {b}"
            )

    def of(self, level: str | None) -> int:
        if level is None:
            return 0
        return (self.l1_bytes, self.l2_bytes, self.l3_bytes)[level_index(level)]

    @classmethod
    def from_dict(cls, d: dict) -> Footprints:
        return cls(**{k: int(d[k]) for k in ("l1_bytes", "l2_bytes", "l3_bytes")})


@dataclass(frozen=True)
class PolicyConfig:
    capacity_bytes: int  # device memory the active trainer and its shadow share
    footprints: Footprints = field(default_factory=Footprints)
    # Kept free above the observed active peak when a level is chosen. Must be at least
    # reclaim_below_bytes: otherwise a shadow launched at the peak would already sit below
    # the reclamation gate and be killed at the next cache miss.
    margin_bytes: int = 2 * GiB
    # The allocation-path gate: reclaim when device free memory is below this at a cache
    # miss. The allocator hook does not see the request's size, so this should exceed the
    # largest single allocation the trainer makes (reclaim.py, docs/preinit.md).
    reclaim_below_bytes: int = 1 * GiB
    max_level: str = "L3"

    def __post_init__(self) -> None:
        level_index(self.max_level)
        if self.capacity_bytes <= 0:
            raise InvalidInput(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if not 0 <= self.reclaim_below_bytes <= self.margin_bytes:
            raise InvalidInput(
                f"need 0 <= reclaim_below_bytes ({self.reclaim_below_bytes}) <= margin_bytes "
                f"({self.margin_bytes}): a shadow launched with less margin than the "
                "reclamation gate would be reclaimed again at once"
            )


class Action(str, enum.Enum):
    LAUNCH = "launch"  # the first shadow of the job
    RECLAIM = "reclaim"  # kill the shadow now (device free memory below the gate)
    RELAUNCH = "relaunch"  # after a reclamation: the replacement's level (None: no shadow)
    RECOVERY = "recovery"  # after a recovery: the next generation's shadow level


@dataclass(frozen=True)
class Decision:
    t_s: float
    generation: int
    action: Action
    level_from: str | None
    level_to: str | None  # None: no shadow (nothing fits)
    reason: str
    capacity_bytes: int
    active_bytes: int  # the sample that led here (the peak for launches)
    active_peak_bytes: int  # peak the level was chosen for (this generation's so far)
    shadow_bytes: int  # footprint of level_to (RECLAIM: of the reclaimed level)
    headroom_bytes: int  # capacity - active peak - margin (RECLAIM: device free memory)
    margin_bytes: int
    free_before_bytes: int | None = None  # reclamations: device free memory observed
    free_after_bytes: int | None = None
    latency_s: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["action"] = self.action.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Decision:
        return cls(**{**d, "action": Action(d["action"])})


class Controller:
    """One rank's controller. Call in time order; every call returns its Decision."""

    def __init__(self, cfg: PolicyConfig, generation: int = 0):
        self.cfg = cfg
        self.generation = generation
        self.level: str | None = None  # the live (or launching) shadow's level
        self.peak_bytes = 0  # active peak of the current generation
        self.last_active_bytes = 0
        self.decisions: list[Decision] = []

    # -- the rule everything uses -------------------------------------------------
    def headroom(self, peak_bytes: int) -> int:
        return self.cfg.capacity_bytes - peak_bytes - self.cfg.margin_bytes

    def fitting_level(self, peak_bytes: int, below: str | None = None) -> str | None:
        """Highest level ≤ max_level (and < ``below`` when given) whose footprint fits
        the headroom left by ``peak_bytes``; None when none does."""
        top = level_index(self.cfg.max_level)
        if below is not None:
            top = min(top, level_index(below) - 1)
        room = self.headroom(peak_bytes)
        for i in range(top, -1, -1):
            fp = self.cfg.footprints.of(LEVELS[i])
            # A level without device memory (L1) fits even when the active peak already
            # eats into the margin: it costs the device nothing and saves a cold start.
            if fp == 0 or fp <= room:
                return LEVELS[i]
        return None

    def _decide(self, t_s: float, action: Action, level_to: str | None, reason: str, **kw):
        d = Decision(
            t_s=t_s,
            generation=self.generation,
            action=action,
            level_from=self.level,
            level_to=level_to,
            reason=reason,
            capacity_bytes=self.cfg.capacity_bytes,
            active_bytes=kw.pop("active_bytes", self.last_active_bytes),
            active_peak_bytes=self.peak_bytes,
            shadow_bytes=kw.pop("shadow_bytes", self.cfg.footprints.of(level_to)),
            headroom_bytes=kw.pop("headroom_bytes", self.headroom(self.peak_bytes)),
            margin_bytes=self.cfg.margin_bytes,
            **kw,
        )
        self.decisions.append(d)
        return d

    def _why(self, level: str | None) -> str:
        fp, room = self.cfg.footprints, self.headroom(self.peak_bytes)
        if level is None:
            return f"no level fits: L1 needs {fp.of('L1')} B, headroom {room} B"
        return f"{level} ({fp.of(level)} B) is the highest level within headroom {room} B"

    # -- events ---------------------------------------------------------------------
    def start(self, t_s: float, active_bytes: int = 0) -> Decision:
        """The first shadow of the job (nothing observed yet unless ``active_bytes``)."""
        self.peak_bytes = max(self.peak_bytes, active_bytes)
        self.last_active_bytes = active_bytes
        level = self.fitting_level(self.peak_bytes)
        d = self._decide(t_s, Action.LAUNCH, level, self._why(level))
        self.level = level
        return d

    def observe(self, t_s: float, active_bytes: int) -> Decision | None:
        """One sample of the active trainer's device memory (reserved bytes). Returns a
        RECLAIM decision when the shadow must go (the caller kills it, then calls
        ``on_reclaim``); None otherwise."""
        if active_bytes < 0:
            raise InvalidInput(f"active_bytes must be >= 0, got {active_bytes}")
        self.last_active_bytes = active_bytes
        self.peak_bytes = max(self.peak_bytes, active_bytes)
        shadow = self.cfg.footprints.of(self.level)
        free = self.cfg.capacity_bytes - active_bytes - shadow
        if shadow > 0 and free < self.cfg.reclaim_below_bytes:
            return self._decide(
                t_s,
                Action.RECLAIM,
                None,
                f"device free memory {free} B is below the gate {self.cfg.reclaim_below_bytes} B"
                f" with a {self.level} shadow of {shadow} B",
                shadow_bytes=shadow,
                headroom_bytes=free,
                free_before_bytes=free,
            )
        return None

    def sample(self, t_s: float, active_bytes: int) -> None:
        """A sample that only moves the peak: in a live run the allocation hook applies
        the reclamation gate itself (``reclaim.py``), so the agent tracks, not decides."""
        if active_bytes < 0:
            raise InvalidInput(f"active_bytes must be >= 0, got {active_bytes}")
        self.last_active_bytes = active_bytes
        self.peak_bytes = max(self.peak_bytes, active_bytes)

    def on_reclaim(
        self,
        t_s: float,
        free_before_bytes: int | None = None,
        free_after_bytes: int | None = None,
        latency_s: float | None = None,
        active_bytes: int | None = None,
    ) -> Decision:
        """The shadow was killed and its memory released: the replacement's level (strictly
        lower than the reclaimed one; None means no shadow until the next recovery).
        ``active_bytes``: the demand that caused it, if newer than the last sample."""
        if active_bytes is not None:
            self.sample(t_s, active_bytes)
        level = None if self.level is None else self.fitting_level(self.peak_bytes, self.level)
        if self.level is None:
            why = "a reclamation with no shadow: nothing to relaunch"
        elif level is None:
            why = f"nothing below {self.level} fits: no shadow until the next recovery"
        else:
            why = f"below the reclaimed {self.level}: " + self._why(level)
        d = self._decide(
            t_s,
            Action.RELAUNCH,
            level,
            why,
            free_before_bytes=free_before_bytes,
            free_after_bytes=free_after_bytes,
            latency_s=latency_s,
        )
        self.level = level
        return d

    def on_recovery(self, t_s: float, generation: int) -> Decision:
        """A recovery promoted the shadow; choose the next generation's shadow level from
        the peak of the generation that just ended (it may be higher than before)."""
        if generation <= self.generation:
            raise InvalidInput(
                f"recovery into generation {generation} after generation {self.generation}: "
                "generations only increase"
            )
        level = self.fitting_level(self.peak_bytes)
        d = self._decide(t_s, Action.RECOVERY, level, "after recovery: " + self._why(level))
        self.generation = generation
        self.level = level
        self.peak_bytes = 0  # the new generation's peak starts with its own samples
        return d

    def decisions_json(self) -> str:
        return json.dumps([d.to_dict() for d in self.decisions], indent=2)


# -- simulation: a trace through the controller (tests, docs figures) ----------------


@dataclass(frozen=True)
class Sample:
    t_s: float
    active_bytes: int


@dataclass(frozen=True)
class Recovery:
    t_s: float


@dataclass
class SimResult:
    decisions: list[Decision]
    # (t_s, active_bytes, shadow_bytes, level) after the sample's decisions were applied
    samples: list[tuple[float, int, int, str | None]]
    # samples where active + shadow exceeded capacity (an OOM the shadow caused) — the
    # controller's contract is that this stays empty
    shadow_ooms: list[float]
    # samples where the active trainer alone exceeded capacity (no shadow can help)
    active_ooms: list[float]


class Recorder(Protocol):
    """What ``simulate`` fills (``leto.preinit.timeline.Timeline``; named here so this
    module, which the timeline imports, imports nothing back)."""

    def record(self, decision: Decision) -> None: ...

    def sample(self, t_s: float, active_bytes: int, shadow_bytes: int, level: str) -> None: ...


def simulate(
    cfg: PolicyConfig, trace: list[Sample | Recovery], timeline: Recorder | None = None
) -> SimResult:
    """Run ``trace`` through a fresh Controller; a reclamation releases the shadow's
    footprint at once (the emulated device). Fills ``timeline`` when given."""
    ctl = Controller(cfg)
    t0 = trace[0].t_s if trace else 0.0
    first = ctl.start(t0)
    res = SimResult(ctl.decisions, [], [], [])
    if timeline is not None:
        timeline.record(first)
    for ev in trace:
        n = len(ctl.decisions)
        if isinstance(ev, Recovery):
            ctl.on_recovery(ev.t_s, ctl.generation + 1)
        else:
            d = ctl.observe(ev.t_s, ev.active_bytes)
            if d is not None:
                shadow = cfg.footprints.of(ctl.level)
                ctl.on_reclaim(
                    ev.t_s, d.free_before_bytes, d.free_before_bytes + shadow, latency_s=0.0
                )
            shadow = cfg.footprints.of(ctl.level)
            if ev.active_bytes > cfg.capacity_bytes:
                res.active_ooms.append(ev.t_s)
            elif ev.active_bytes + shadow > cfg.capacity_bytes:
                res.shadow_ooms.append(ev.t_s)
            res.samples.append((ev.t_s, ev.active_bytes, shadow, ctl.level))
            if timeline is not None:
                timeline.sample(ev.t_s, ev.active_bytes, shadow, ctl.level)
        if timeline is not None:
            for d in ctl.decisions[n:]:
                timeline.record(d)
    return res


def for_run(cfg, capacity_bytes: int) -> PolicyConfig:
    """The controller's configuration of a ``leto run`` job (``leto.job.config.RunConfig``)
    for a device of ``capacity_bytes``: each level's device bytes from
    ``--preinit-footprints`` (a JSON object, or ``bench/preinit_footprint.py``'s output with
    it under "footprints"; none: the paper's figures), its margin and reclaim threshold.
    ValueError names a footprints file that cannot be read."""
    footprints = Footprints()
    if cfg.preinit_footprints:
        try:
            with open(cfg.preinit_footprints) as f:
                d = json.load(f)
            footprints = Footprints.from_dict(d.get("footprints", d))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"--preinit-footprints {cfg.preinit_footprints}: {type(e).__name__}: {e} "
                "(want JSON with l1_bytes, l2_bytes, l3_bytes)"
            ) from None
    return PolicyConfig(
        capacity_bytes=capacity_bytes,
        footprints=footprints,
        margin_bytes=cfg.preinit_margin_bytes,
        reclaim_below_bytes=cfg.reclaim_below_bytes,
    )
