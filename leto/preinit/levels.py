"""The agent's side of the preinitialization controller: one ``Controller`` per local
rank, fed by its trainer's memory reports, and the job-wide level of each generation's
shadows.

Runs in the node agent under ``leto run --shadow-level auto``. A level is chosen per rank
(``policy.py``), but an L3 shadow forms its process group with every other rank's shadow,
so a generation's shadows all run at one level: the lowest any rank chose. Each agent
publishes its ranks' choices for a generation in the job store (``level_key``) and bumps
``levels_key``; the job level is the minimum over all ranks (a rank not yet published
counts as not chosen). Within a generation each rank's level only goes down, so the job
level does too; a recovery starts a new generation, where it may go up.

Also keeps one memory timeline per local rank (``timeline.py``), written as JSON + PNG
with the decision log at the end of the run.

Not covered: several ranks sharing one device (each rank's controller assumes the device
is its own, as ``leto run`` places them: local rank r on cuda:r).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from leto.job import keys
from leto.job import store as job_store
from leto.preinit.policy import Action, Controller, Decision, MiB, PolicyConfig, level_index
from leto.preinit.timeline import Timeline

NONE = "none"  # published for "no shadow fits"


def level_key(generation: int, rank: int) -> str:
    return keys.level(generation, rank)


def levels_key(generation: int) -> str:
    return keys.levels(generation)


class Levels:
    def __init__(self, store, ranks: list[int], world_size: int, cfg: PolicyConfig, emulated: bool):
        self.store, self.ranks, self.world = store, ranks, world_size
        self.cfg, self.emulated = cfg, emulated
        self.ctl = {r: Controller(cfg, generation=0) for r in ranks}
        self.timelines = {r: Timeline(cfg.capacity_bytes, rank=r) for r in ranks}
        self.t0 = time.time()
        self._cache: dict[int, tuple[int, str | None]] = {}  # generation -> (count, level)

    def _t(self) -> float:
        return time.time() - self.t0

    def _log(self, rank: int, d: Decision) -> Decision:
        self.timelines[rank].record(d)
        # Live, on the agent's stderr: what leto run's user sees as it happens.
        figures = ""
        if d.free_before_bytes is not None and d.free_after_bytes is not None:
            back = (d.free_after_bytes - d.free_before_bytes) / MiB
            figures = f"; {back:.0f} MiB back"
            if d.latency_s is not None:
                figures += f" in {d.latency_s * 1e3:.0f} ms"
        device = "emulated device" if self.emulated else "device"
        print(
            f"leto preinit: rank {rank} gen {d.generation} {d.action.value}: shadow "
            f"{d.level_from or '-'} -> {d.level_to or 'none'} ({d.reason}; {device} "
            f"{d.capacity_bytes / MiB:.0f} MiB, active peak {d.active_peak_bytes / MiB:.0f} "
            f"MiB{figures})",
            file=sys.stderr,
            flush=True,
        )
        return d

    # -- publishing ---------------------------------------------------------------
    def _publish(self, generation: int, rank: int, level: str | None) -> None:
        self.store.set(level_key(generation, rank), level or NONE)
        self.store.add(levels_key(generation), 1)

    def job_level(self, generation: int) -> str | None:
        """The lowest level any rank published for ``generation`` (None: no shadows).
        Re-read from the store only when its publication counter moved."""
        n = job_store.counter(self.store, levels_key(generation))
        cached = self._cache.get(generation)
        if cached is not None and cached[0] == n:
            return cached[1]
        keys = [level_key(generation, r) for r in range(self.world)]
        found = [self.store.get(k).decode() for k in keys if self.store.check([k])]
        low = min(found, key=lambda s: -1 if s == NONE else level_index(s)) if found else NONE
        level = None if low == NONE else low
        self._cache[generation] = (n, level)
        return level

    def _agree(self, generation: int, timeout_s: float) -> str | None:
        # Every rank publishes once per generation before anyone launches its shadows.
        job_store.wait_count(
            self.store, levels_key(generation), self.world, timeout_s, "every rank's shadow level"
        )
        return self.relaunch(generation)

    def relaunch(self, generation: int) -> str | None:
        """The job level, which every local shadow of ``generation`` is (re)started at:
        after agreeing on it, and after a reclamation anywhere in the job. A rank that
        chose higher now has a shadow at the job level: its controller's level follows,
        so its next reclamation goes below the level that was really reclaimed (not
        below its own choice, which could relaunch at the same level)."""
        level = self.job_level(generation)
        for r in self.ranks:
            c = self.ctl[r]
            if c.level != level:
                self.timelines[r].mark(
                    self._t(), "level", c.level, level, generation=generation,
                    reason="the job's level: the lowest any rank chose",
                )  # fmt: skip
                c.level = level
        return level

    # -- events -----------------------------------------------------------------------
    def start(self, generation: int, timeout_s: float) -> str | None:
        """The first shadows' level (nothing observed yet: the highest that fits)."""
        for r in self.ranks:
            d = self._log(r, self.ctl[r].start(self._t()))
            self._publish(generation, r, d.level_to)
        return self._agree(generation, timeout_s)

    def observe(self, rank: int, report: dict) -> None:
        """A trainer's memory report (``guard.Guard.memory``): moves the rank's peak and
        extends its timeline. The reclamation itself is the trainer's allocation hook."""
        # When the trainer measured (same node, same clock), not when the agent looked.
        t = report["t"] - self.t0 if "t" in report else self._t()
        seen = self.timelines[rank].samples
        t = max(t, seen[-1].t_s) if seen else t  # wall clocks may step back
        active = int(report["active_bytes"])
        self.ctl[rank].sample(t, active)
        level = report.get("shadow_level")
        self.timelines[rank].sample(t, active, self.cfg.footprints.of(level), level)

    def on_reclaim(self, rank: int, generation: int, event: dict | None = None) -> bool:
        """Rank ``rank``'s shadow (of ``generation``) was reclaimed: choose its
        replacement's level and publish it. True when the job level went down."""
        before = self.job_level(generation)
        ev = event or {}
        if event is not None:  # the allocation hook's report of the kill
            self.timelines[rank].mark(
                ev["wall_time_s"] - self.t0,
                "reclamation",
                self.ctl[rank].level,
                None,
                by="allocation hook",
                **{k: ev[k] for k in ("free_before_bytes", "free_after_bytes", "latency_s")},
            )
        after_free = ev.get("free_after_bytes")
        d = self.ctl[rank].on_reclaim(
            self._t(),
            free_before_bytes=ev.get("free_before_bytes"),
            free_after_bytes=after_free,
            latency_s=ev.get("latency_s"),
            # The demand that forced it: the trainer's next report may come an iteration
            # later, and the replacement's level must already account for it.
            active_bytes=None
            if after_free is None
            else max(0, self.cfg.capacity_bytes - after_free),
        )
        self._log(rank, d)
        self._publish(generation, rank, d.level_to)
        after = self.job_level(generation)
        return after != before

    def on_recovery(self, generation: int, timeout_s: float) -> str | None:
        """A recovery began ``generation - 1``'s successor: each rank's controller
        chooses the level of the shadows of ``generation`` (may go up); all agree."""
        for r in self.ranks:
            d = self._log(r, self.ctl[r].on_recovery(self._t(), generation - 1))
            self._publish(generation, r, d.level_to)
        return self._agree(generation, timeout_s)

    # -- output -----------------------------------------------------------------------
    def summary(self) -> dict:
        return {
            str(r): {
                # The rank's own last choice (its shadow runs at the job's level, which
                # may be lower: another rank chose lower).
                "level": c.decisions[-1].level_to if c.decisions else None,
                "emulated_device": self.emulated,
                "capacity_bytes": self.cfg.capacity_bytes,
                "reclamations": sum(d.action is Action.RELAUNCH for d in c.decisions),
                "decisions": [d.to_dict() for d in c.decisions],
            }
            for r, c in self.ctl.items()
        }

    def write(self, log_dir: Path) -> list[Path]:
        out = []
        for r, tl in self.timelines.items():
            out.append(tl.write_json(Path(log_dir) / f"rank{r}.memory.json"))
            if tl.samples:
                out.append(tl.plot_png(Path(log_dir) / f"rank{r}.memory.png"))
        return out


__all__ = ["Levels", "level_key", "levels_key", "NONE"]
