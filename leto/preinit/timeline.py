"""A memory timeline of one rank: active and active + shadow device memory over time,
with level changes and reclamations marked (the paper's Fig. 13).

Runs wherever samples are taken (the agent: ``levels.py``; ``simulate`` in
``policy.py`` on the CPU). Owns the JSON format (versioned) and the PNG plot (matplotlib's
``Figure`` with the Agg canvas, never pyplot: no global backend state, no display).
Sampling itself is the caller's: this module stores what it is given and checks that time
only moves forward. Not covered: several ranks in one figure (write one file per rank).

API::

    tl = Timeline(capacity_bytes=total, rank=0)
    tl.sample(t_s, active_bytes, shadow_bytes, level)   # e.g. once per iteration
    tl.record(decision)                                 # a policy.Decision -> marks
    tl.mark(t_s, "reclamation", level_from="L3", level_to=None, free_before_bytes=...)
    tl.write_json(path); Timeline.read_json(path); tl.plot_png(path)
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from leto.errors import InvalidInput
from leto.preinit.policy import Action, Decision, GiB

FORMAT_VERSION = 1
MARK_KINDS = ("launch", "reclamation", "level", "recovery")


@dataclass(frozen=True)
class MemorySample:
    t_s: float
    active_bytes: int
    shadow_bytes: int
    level: str | None


@dataclass(frozen=True)
class Mark:
    t_s: float
    kind: str  # one of MARK_KINDS
    level_from: str | None = None
    level_to: str | None = None
    detail: dict = field(default_factory=dict)  # figures: free before/after, latency, reason


@dataclass
class Timeline:
    capacity_bytes: int
    rank: int = 0
    samples: list[MemorySample] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    def sample(self, t_s: float, active_bytes: int, shadow_bytes: int, level: str | None):
        if self.samples and t_s < self.samples[-1].t_s:
            raise InvalidInput(
                f"sample at t={t_s} s is earlier than the last one ({self.samples[-1].t_s} s)"
            )
        self.samples.append(MemorySample(t_s, int(active_bytes), int(shadow_bytes), level))

    def mark(self, t_s: float, kind: str, level_from=None, level_to=None, **detail) -> None:
        if kind not in MARK_KINDS:
            raise InvalidInput(f"mark kind {kind!r}: use one of {MARK_KINDS}")
        self.marks.append(Mark(t_s, kind, level_from, level_to, detail))

    def record(self, d: Decision) -> None:
        """A controller decision as marks: a RECLAIM decision is the reclamation, a
        RELAUNCH the level change that follows; launches and recoveries mark themselves."""
        figures = {
            "generation": d.generation,
            "reason": d.reason,
            "active_bytes": d.active_bytes,
            "active_peak_bytes": d.active_peak_bytes,
            "shadow_bytes": d.shadow_bytes,
            "headroom_bytes": d.headroom_bytes,
        }
        for k in ("free_before_bytes", "free_after_bytes", "latency_s"):
            if getattr(d, k) is not None:
                figures[k] = getattr(d, k)
        kind = {
            Action.LAUNCH: "launch",
            Action.RECLAIM: "reclamation",
            Action.RELAUNCH: "level",
            Action.RECOVERY: "recovery",
        }[d.action]
        self.mark(d.t_s, kind, d.level_from, d.level_to, **figures)

    # -- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": FORMAT_VERSION,
            "capacity_bytes": self.capacity_bytes,
            "rank": self.rank,
            "samples": [asdict(s) for s in self.samples],
            "marks": [asdict(m) for m in self.marks],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Timeline:
        if d.get("version") != FORMAT_VERSION:
            raise InvalidInput(
                f"memory timeline version {d.get('version')!r}; this Leto reads {FORMAT_VERSION}"
            )
        return cls(
            capacity_bytes=d["capacity_bytes"],
            rank=d.get("rank", 0),
            samples=[MemorySample(**s) for s in d["samples"]],
            marks=[Mark(**m) for m in d["marks"]],
        )

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def read_json(cls, path: str | Path) -> Timeline:
        return cls.from_dict(json.loads(Path(path).read_text()))

    # -- PNG -------------------------------------------------------------------------
    def plot_png(self, path: str | Path, title: str | None = None) -> Path:
        """Active and active + shadow memory (GiB) over time; the band between them is the
        shadow's footprint. Reclamations are red crosses on the active + shadow curve with
        a dotted line; recoveries black dashed lines; the level in force is written along
        the top at every change."""
        if not self.samples:
            raise InvalidInput("no memory samples to plot")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        t = [s.t_s for s in self.samples]
        t0 = min([t[0], *(m.t_s for m in self.marks)])  # a launch precedes the first sample
        xs = [x - t0 for x in t]
        active = [s.active_bytes / GiB for s in self.samples]
        both = [(s.active_bytes + s.shadow_bytes) / GiB for s in self.samples]
        fig = Figure(figsize=(8, 3.6))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.step(xs, both, where="post", color="tab:orange", label="active + shadow")
        ax.step(xs, active, where="post", color="tab:blue", label="active")
        ax.fill_between(xs, active, both, step="post", color="tab:orange", alpha=0.25)
        cap = self.capacity_bytes / GiB
        ax.axhline(cap, color="grey", linestyle="--", linewidth=0.8, label="capacity")
        top = max(cap, max(both)) * 1.06
        ax.set_ylim(0, top * 1.06)
        first = True
        for m in self.marks:
            x = m.t_s - t0
            if m.kind == "reclamation":
                y = _at(self.samples, m)
                ax.axvline(x, color="tab:red", linestyle=":", linewidth=0.8)
                ax.plot([x], [y], "x", color="tab:red", label="reclamation" if first else None)
                first = False
            elif m.kind == "recovery":
                ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
                ax.text(x, top * 0.94, " recovery", fontsize=7, rotation=90, va="top")
            if m.kind in ("launch", "level", "recovery"):
                ax.text(x, top, f" {m.level_to or 'none'}", fontsize=8, va="bottom")
        # Every mark inside the axes: a launch before the first sample would otherwise
        # put its label outside and squeeze the plot.
        ax.set_xlim(0, max([*xs, *(m.t_s - t0 for m in self.marks)]) * 1.03 + 1e-3)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("device memory (GiB)")
        ax.set_title(title or f"rank {self.rank}: memory and shadow levels")
        ax.legend(loc="lower right", fontsize=7)
        with warnings.catch_warnings():
            # Labels near the edges can defeat tight_layout; the figure is still complete.
            warnings.simplefilter("ignore", UserWarning)
            fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        return path


def _at(samples: list[MemorySample], m: Mark) -> float:
    """Active + shadow (GiB) when reclamation ``m`` fired: its own figures when it has
    them, else the last sample before it."""
    if "active_bytes" in m.detail and "shadow_bytes" in m.detail:
        return (m.detail["active_bytes"] + m.detail["shadow_bytes"]) / GiB
    before = [s for s in samples if s.t_s < m.t_s] or samples[:1]
    return (before[-1].active_bytes + before[-1].shadow_bytes) / GiB
