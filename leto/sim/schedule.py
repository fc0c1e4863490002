"""Failure schedules as data: what fails, when, where, and how.

Owns the ``Failure`` and ``Schedule`` value objects, their JSON form (``"version": 1``),
their validation, and the generators that build them: ``every`` (fixed spacing),
``poisson`` (exponential inter-arrivals at an MTTF) and ``trace_window`` (preemptions
of a public spot-instance trace). One schedule feeds two consumers: faultkit replays it
against a real job (``Schedule.at_iteration`` maps wall-clock times onto iterations),
and the simulator (``leto.sim.events``) replays it against a modelled job.

Runs in whatever process builds or reads a plan (the faultkit CLI, the simulator, a
test); it starts nothing and touches no job. Failure classes use the paper's words:
a **HOF** (hardware-operable failure) stops trainers but leaves the nodes and GPUs usable
without reset, repair or replacement, so Leto recovers in place; an **FF** (fatal
failure) needs remediation first, so recovery moves to a spare and rolls back to a
checkpoint.

Not covered: replaying a schedule against a job (``faultkit run-plan``), correlated or
multi-rank failures at one instant beyond listing several ``Failure`` rows, and failure
rates that change over time other than by replaying a trace.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path

from leto.errors import InvalidInput

SCHEDULE_VERSION = 1
KINDS = ("HOF", "FF")
MODES = ("kill", "kernel-abort", "copy-corrupt")
# The in-repo copy of the public traces (data/traces/SOURCES.md says where they come from).
TRACES_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"
GCP_TRACE = TRACES_DIR / "bamboo_gcp_a100x1-east1b.txt"
EC2_TRACE = TRACES_DIR / "bamboo_ec2_p3-trace.csv"


@cache
def phase_names() -> tuple[str, ...]:
    """Injection phases a failure may name: ``leto.plugins.PHASES`` plus ``"any"``."""
    from leto.plugins import PHASES

    return (*sorted(PHASES), "any")


def _fail(where: str, what: str) -> InvalidInput:
    return InvalidInput(f"{where}: {what}; nothing was built")


@dataclass(frozen=True)
class Failure:
    """One failure: at ``at_s`` seconds after job start, rank ``rank`` fails as ``kind``.

    ``mode`` is how faultkit makes it happen (SIGKILL, an aborted kernel, a corrupted
    copy), ``phase`` where in the iteration (a ``faultkit.inject.PHASES`` name, or
    ``"any"`` to let the replayer draw it), ``pages`` the device pages lost per
    protection group and ``host_parity_pages`` the tier-1 host parity pages lost with
    it. The rank is checked against a world size only inside a ``Schedule``.
    """

    at_s: float
    rank: int
    kind: str
    mode: str = "kill"
    phase: str = "any"
    pages: int = 0
    host_parity_pages: int = 0

    def __post_init__(self) -> None:
        where = "failure"
        if isinstance(self.at_s, bool) or not isinstance(self.at_s, (int, float)):
            raise _fail(where, f"at_s={self.at_s!r} is not a number of seconds")
        if not math.isfinite(self.at_s) or self.at_s < 0:
            raise _fail(where, f"at_s={self.at_s!r}: expected a finite time >= 0 s")
        for name in ("rank", "pages", "host_parity_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _fail(where, f"{name}={v!r}: expected an integer >= 0")
        if self.kind not in KINDS:
            raise _fail(where, f"kind={self.kind!r}: expected one of {list(KINDS)}")
        if self.mode not in MODES:
            raise _fail(where, f"mode={self.mode!r}: expected one of {list(MODES)}")
        if self.phase not in phase_names():
            raise _fail(where, f"phase={self.phase!r}: expected one of {list(phase_names())}")


@dataclass(frozen=True)
class IterationFailure:
    """A failure placed on a real job's timeline: it strikes during ``iteration``
    (0-based, the iteration in flight at ``failure.at_s``)."""

    iteration: int
    failure: Failure


@dataclass(frozen=True)
class Schedule:
    """Failures sorted by time over a run of ``duration_s`` seconds on ``world_size``
    ranks. ``source`` records how the schedule was made (generator and parameters) as a
    JSON-compatible dict; it is carried, not interpreted. Holds a dict, so not hashable.
    """

    failures: tuple[Failure, ...]
    duration_s: float
    world_size: int
    source: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise _fail("schedule", f"world_size={self.world_size!r}: expected an integer >= 1")
        if self.world_size < 1:
            raise _fail("schedule", f"world_size={self.world_size}: expected an integer >= 1")
        d = self.duration_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d <= 0:
            raise _fail("schedule", f"duration_s={d!r}: expected a finite time > 0 s")
        if not isinstance(self.source, dict) or not all(isinstance(k, str) for k in self.source):
            raise _fail("schedule", "source: expected a dict with string keys")
        object.__setattr__(self, "failures", tuple(self.failures))
        prev = 0.0
        for i, f in enumerate(self.failures):
            where = f"failure #{i}"
            if not isinstance(f, Failure):
                raise _fail(where, f"expected a Failure, got {type(f).__name__}")
            if f.rank >= self.world_size:
                raise _fail(where, f"rank={f.rank} outside 0..{self.world_size - 1}")
            if f.at_s > d:
                raise _fail(where, f"at_s={f.at_s} is after the schedule's end ({d} s)")
            if f.at_s < prev:
                raise _fail(
                    where,
                    f"at_s={f.at_s} is before failure #{i - 1} ({prev}); "
                    "failures must be sorted by time",
                )
            prev = f.at_s

    # -- views -------------------------------------------------------------------------

    @property
    def hof_count(self) -> int:
        return sum(f.kind == "HOF" for f in self.failures)

    @property
    def ff_count(self) -> int:
        return sum(f.kind == "FF" for f in self.failures)

    def mean_interarrival_s(self) -> float:
        """Mean gap between consecutive failures, the first measured from job start;
        NaN for an empty schedule."""
        if not self.failures:
            return math.nan
        return self.failures[-1].at_s / len(self.failures)

    def at_iteration(self, iter_s: float) -> tuple[IterationFailure, ...]:
        """Place each failure in the iteration in flight at its time, for a job whose
        measured iteration takes ``iter_s`` seconds (``floor(at_s / iter_s)``).

        Several failures may share an iteration; the replayer decides whether the later
        ones strike the recovery. Does not model recovery stretching the timeline: a
        replayer that wants wall-clock fidelity injects by time, not by iteration.
        """
        if not (isinstance(iter_s, (int, float)) and math.isfinite(iter_s) and iter_s > 0):
            raise InvalidInput(f"iter_s={iter_s!r}: expected a finite iteration time > 0 s")
        return tuple(IterationFailure(int(f.at_s // iter_s), f) for f in self.failures)

    # -- JSON --------------------------------------------------------------------------

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(
            {
                "version": SCHEDULE_VERSION,
                "duration_s": self.duration_s,
                "world_size": self.world_size,
                "source": self.source,
                "failures": [asdict(f) for f in self.failures],
            },
            indent=indent,
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Parse and validate; every error names the failure index and field at fault."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"schedule: not JSON ({e}); nothing was built") from e
        if not isinstance(doc, dict):
            raise _fail("schedule", "expected a JSON object at the top level")
        if doc.get("version") != SCHEDULE_VERSION:
            raise _fail("schedule", f"version={doc.get('version')!r}: expected {SCHEDULE_VERSION}")
        missing = {"duration_s", "world_size", "failures"} - doc.keys()
        if missing:
            raise _fail("schedule", f"missing fields {sorted(missing)}")
        if not isinstance(doc["failures"], list):
            raise _fail("schedule", "failures: expected a list")
        names = set(Failure.__dataclass_fields__)
        failures = []
        for i, row in enumerate(doc["failures"]):
            where = f"failures[{i}]"
            if not isinstance(row, dict):
                raise _fail(where, "expected an object")
            unknown = row.keys() - names
            if unknown:
                raise _fail(where, f"unknown fields {sorted(unknown)}; expected {sorted(names)}")
            try:
                failures.append(Failure(**row))
            except TypeError as e:
                raise _fail(where, f"{e}") from e
            except InvalidInput as e:
                raise InvalidInput(f"{where}: {e}") from e
        return cls(tuple(failures), doc["duration_s"], doc["world_size"], doc.get("source", {}))


# -- generators --------------------------------------------------------------------------


def _check_common(duration_s: float, world_size: int, hof_ratio: float) -> None:
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise InvalidInput(f"duration_s={duration_s!r}: expected a finite time > 0 s")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise InvalidInput(f"world_size={world_size!r}: expected an integer >= 1")
    if not 0.0 <= hof_ratio <= 1.0:
        raise InvalidInput(f"hof_ratio={hof_ratio!r}: expected a fraction in [0, 1]")


def _classify(
    times: Sequence[float], world_size: int, hof_ratio: float, seed: int, mode: str, phase: str
) -> tuple[Failure, ...]:
    """Kinds and ranks for failures at ``times``.

    Kinds are stratified, not Bernoulli: exactly ``round(hof_ratio * n)`` of the n
    failures are HOFs, the positions drawn uniformly without replacement with the seed.
    The realised HOF fraction is therefore within ``1 / (2n)`` of the ratio for every
    schedule, which is what the paper's trace run does (four of eight as HOFs, §8.2).
    Ranks are drawn uniformly from ``0..world_size-1``, independently, with the seed.
    """
    rng = random.Random(seed)
    n = len(times)
    hof_positions = set(rng.sample(range(n), round(hof_ratio * n)))
    return tuple(
        Failure(
            at_s=t,
            rank=rng.randrange(world_size),
            kind="HOF" if i in hof_positions else "FF",
            mode=mode,
            phase=phase,
        )
        for i, t in enumerate(times)
    )


def every(
    interval_s: float,
    duration_s: float,
    world_size: int,
    hof_ratio: float = 1.0,
    seed: int = 0,
    first_s: float | None = None,
    mode: str = "kill",
    phase: str = "any",
) -> Schedule:
    """One failure every ``interval_s`` seconds, the first at ``first_s`` (default:
    ``interval_s``), up to and including ``duration_s``.

    Statistics: spacing exactly ``interval_s`` (times are ``first_s + k * interval_s``,
    computed by multiplication so they do not drift); count
    ``floor((duration_s - first_s) / interval_s) + 1``; kinds and ranks as ``_classify``.
    This is the paper's "one HOF every 10 minutes" (§8.2) with ``hof_ratio=1``.
    """
    _check_common(duration_s, world_size, hof_ratio)
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise InvalidInput(f"interval_s={interval_s!r}: expected a finite interval > 0 s")
    first = interval_s if first_s is None else first_s
    if not (math.isfinite(first) and first >= 0):
        raise InvalidInput(f"first_s={first_s!r}: expected a finite time >= 0 s")
    times = []
    k = 0
    while first + k * interval_s <= duration_s:
        times.append(first + k * interval_s)
        k += 1
    source = {
        "generator": "every",
        "interval_s": interval_s,
        "first_s": first,
        "hof_ratio": hof_ratio,
        "seed": seed,
    }
    return Schedule(
        _classify(times, world_size, hof_ratio, seed, mode, phase), duration_s, world_size, source
    )


def poisson(
    mttf_s: float,
    duration_s: float,
    world_size: int,
    hof_ratio: float = 1.0,
    seed: int = 0,
    mode: str = "kill",
    phase: str = "any",
) -> Schedule:
    """Failures as a Poisson process of rate ``1 / mttf_s`` over wall-clock time.

    Statistics: inter-arrival gaps are i.i.d. exponential with mean ``mttf_s`` (drawn with
    ``random.Random(seed).expovariate``), so the count over ``duration_s`` is Poisson
    with mean ``duration_s / mttf_s`` and the sample mean gap of n failures has standard
    error ``mttf_s / sqrt(n)``. Times are wall-clock, recovery included, as the paper's
    ETTR model assumes (Appendix C.3). Kinds and ranks as ``_classify`` (a stream
    seeded separately from the arrival times, so changing the HOF ratio keeps the times).
    """
    _check_common(duration_s, world_size, hof_ratio)
    if not (math.isfinite(mttf_s) and mttf_s > 0):
        raise InvalidInput(f"mttf_s={mttf_s!r}: expected a finite MTTF > 0 s")
    rng = random.Random(seed)
    times = []
    t = rng.expovariate(1.0 / mttf_s)
    while t <= duration_s:
        times.append(t)
        t += rng.expovariate(1.0 / mttf_s)
    source = {"generator": "poisson", "mttf_s": mttf_s, "hof_ratio": hof_ratio, "seed": seed}
    return Schedule(
        _classify(times, world_size, hof_ratio, seed + 1, mode, phase),
        duration_s,
        world_size,
        source,
    )


@dataclass(frozen=True)
class Preemption:
    """One preemption event of a trace: ``instances`` lost at ``at_s`` seconds after the
    trace's first sample; ``nodes`` names them where the trace does (EC2), else empty."""

    at_s: float
    instances: int
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Trace:
    """A parsed trace: its preemption events in time order and its length in seconds."""

    path: str
    format: str
    length_s: float
    preemptions: tuple[Preemption, ...]


def parse_trace(path: str | Path) -> Trace:
    """Parse either public trace format (see data/traces/SOURCES.md).

    * GCP samples ``YYYY-MM-DD, HH:MM:SS, N``: N live instances at each sample. A drop
      from one sample to the next is one preemption event of ``N_prev - N`` instances at
      the later sample's time (the first time the loss is visible). Rises are new
      instances and are ignored.
    * EC2 event log ``t_ms,add|remove,nodeK``: every ``remove`` is a preempted node;
      removes with the same timestamp form one event.

    Times are seconds from the trace's first line; the length is the last line's time.
    """
    p = Path(path)
    try:
        lines = [ln.strip() for ln in p.read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise InvalidInput(f"trace {p}: cannot read it ({e})") from e
    if not lines:
        raise InvalidInput(f"trace {p}: empty file")
    if "," in lines[0] and lines[0].split(",")[1].strip() in ("add", "remove"):
        return _parse_ec2(p, lines)
    return _parse_gcp(p, lines)


def _parse_gcp(p: Path, lines: list[str]) -> Trace:
    stamps, counts = [], []
    for n, ln in enumerate(lines, 1):
        parts = [x.strip() for x in ln.split(",")]
        try:
            stamps.append(datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S"))
            counts.append(int(parts[2]))
        except (ValueError, IndexError) as e:
            raise InvalidInput(
                f"trace {p} line {n}: {ln!r} is neither 'YYYY-MM-DD, HH:MM:SS, N' "
                "nor 't_ms,add|remove,nodeK'"
            ) from e
    t0 = stamps[0]
    secs = [(s - t0).total_seconds() for s in stamps]
    events = tuple(
        Preemption(secs[i], counts[i - 1] - counts[i])
        for i in range(1, len(counts))
        if counts[i] < counts[i - 1]
    )
    return Trace(str(p), "gcp-samples", secs[-1], events)


def _parse_ec2(p: Path, lines: list[str]) -> Trace:
    removed: dict[float, list[str]] = {}
    last = 0.0
    for n, ln in enumerate(lines, 1):
        parts = [x.strip() for x in ln.split(",")]
        if len(parts) != 3 or parts[1] not in ("add", "remove"):
            raise InvalidInput(f"trace {p} line {n}: {ln!r} is not 't_ms,add|remove,nodeK'")
        try:
            t = int(parts[0]) / 1000.0
        except ValueError as e:
            raise InvalidInput(f"trace {p} line {n}: time {parts[0]!r} is not milliseconds") from e
        last = max(last, t)
        if parts[1] == "remove":
            removed.setdefault(t, []).append(parts[2])
    events = tuple(Preemption(t, len(nodes), tuple(nodes)) for t, nodes in sorted(removed.items()))
    return Trace(str(p), "ec2-events", last, events)


def trace_window(
    path: str | Path,
    start_s: float,
    length_s: float,
    world_size: int,
    hof_ratio: float = 0.5,
    seed: int = 0,
    mode: str = "kill",
    phase: str = "any",
) -> Schedule:
    """The preemptions of a trace window ``[start_s, start_s + length_s)`` as a schedule.

    Mapping: **one failure per preemption event**, whatever the number of instances it
    took, at the event's time minus ``start_s``. A training job loses its trainers at
    the first preempted instance, and every instance lost at that instant is recovered
    by the same recovery, so one event is one failure — the paper does the same (its
    80-minute GCP segment has "eight eviction events", one failure injected per event,
    §8.2). Instance counts are kept in ``source["instances"]``. Ranks and kinds are drawn
    as in ``_classify``; the trace does not say which node hosted which rank.

    Errors: a window starting at or past the trace's end, or running past it, and a
    window with no preemptions, say so with the trace's length.
    """
    _check_common(length_s, world_size, hof_ratio)
    tr = parse_trace(path)
    if not (math.isfinite(start_s) and start_s >= 0):
        raise InvalidInput(f"start_s={start_s!r}: expected a finite time >= 0 s")
    if start_s + length_s > tr.length_s:
        raise InvalidInput(
            f"trace {tr.path}: window [{start_s:g}, {start_s + length_s:g}) s runs past the "
            f"trace's end; the trace is {tr.length_s:g} s ({tr.length_s / 3600:.2f} h) long"
        )
    inside = [e for e in tr.preemptions if start_s <= e.at_s < start_s + length_s]
    if not inside:
        raise InvalidInput(
            f"trace {tr.path}: no preemptions in window [{start_s:g}, {start_s + length_s:g}) s "
            f"of a {tr.length_s:g} s trace with {len(tr.preemptions)} preemption events; "
            "move or widen the window"
        )
    times = [e.at_s - start_s for e in inside]
    source = {
        "generator": "trace",
        "path": Path(path).name,
        "format": tr.format,
        "start_s": start_s,
        "length_s": length_s,
        "hof_ratio": hof_ratio,
        "seed": seed,
        "instances": [e.instances for e in inside],
    }
    return Schedule(
        _classify(times, world_size, hof_ratio, seed, mode, phase), length_s, world_size, source
    )
