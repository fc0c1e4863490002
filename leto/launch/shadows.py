"""The parked shadows of one node's cells: which level they park at, replacing those that
die, and (``--shadow-level auto``) the preinitialization controller choosing the level.

Runs in the agent. ``level`` is the level the next shadows park at; ``None`` or "off"
means none (``on`` is False): a failed rank's successor then starts cold.

A parked shadow that dies is replaced. At L1/L2 alone; at L3 its process group is gone
with it, so every node restarts all shadows of the next generation in a fresh
process-group namespace (a counter in the store tells the other nodes). Under the
controller a shadow the trainer's allocation hook reclaimed is not a crash: its rank's
level goes down, and every node restarts its shadows at the new job level (the same
counter).
"""

from __future__ import annotations

import json
import time

from leto.job import keys
from leto.job import store as job_store
from leto.job.config import ENV_PREINIT, RunConfig
from leto.launch.cell import Cell

# The longest a recovery's successor shadows wait for the recovered trainers' first
# iteration (seconds).
DEFER_MAX_S = 30.0


class Shadows:
    def __init__(self, cfg: RunConfig, cells: list[Cell]):
        self.cfg, self.cells = cfg, cells
        self.level: str | None = cfg.level()
        self.levels = None  # preinit.levels.Levels under --shadow-level auto (controlled)
        self.restarts = 0
        self.store = None
        self.monitor = None  # for the trainers' last beats (set by the agent)
        self._reshadows: dict[int, int] = {}  # generation -> L3 shadow restarts seen
        self._reclaims_seen: dict[tuple[int, int], int] = {}  # (generation, rank) -> count
        self._memory_seen: dict[int, bytes] = {}  # rank -> its trainer's last memory report
        self._dead_since: dict[int, tuple] = {}  # shadow pid -> (trainer beat, monotonic)
        # after_recovery's held-back start: (generation, monotonic, rank -> first beat)
        self._due: tuple[int, float, dict] | None = None
        self._wanted_checked = 0.0  # when the store was last asked for shadows_wanted

    @property
    def on(self) -> bool:
        """Whether shadows park (the level is one of L1–L3)."""
        return self.level not in ("off", None)

    def setup(self, store) -> None:
        """``--shadow-level auto``: the controller's per-rank state and the guard
        configuration every trainer gets (on a GPU or an emulated CPU device)."""
        self.store = store
        c = self.cfg
        if not c.controlled:
            return
        from leto.preinit.guard import GuardConfig
        from leto.preinit.levels import Levels
        from leto.preinit.policy import for_run

        emulated = c.device == "cpu"
        capacity = c.device_memory_bytes or device_total_bytes(self.cells[0].local_rank)
        pcfg = for_run(c, capacity)
        ranks = [cl.rank for cl in self.cells]
        self.levels = Levels(store, ranks, c.world_size, pcfg, emulated)
        guard = GuardConfig(pcfg.footprints, c.reclaim_below_bytes, capacity, emulated).to_json()
        for cl in self.cells:
            cl.extra_env[ENV_PREINIT] = guard

    def start_first(self) -> None:
        """The shadows of generation 1, once generation 0's trainers started: beside
        them, not held back as after a recovery. Held back until the first iteration,
        a failure in a job's first seconds met a cold successor (the CPU's ETTR bench:
        Leto's I 0.85 s against torchrun's 0.70 s), for a fresh start 0.5 s faster on
        two cores (docs/benchmarks.md#fresh-start-2026-12-05)."""
        if self.levels is not None:
            self.level = self.levels.start(1, self.cfg.timeout_s)
        self.start(1)

    def start(self, generation: int) -> None:
        """Park a shadow for ``generation`` in every cell (if shadows are on)."""
        if self.on:
            for cl in self.cells:
                cl.start_shadow(generation, self.level)

    def after_recovery(self, new: int) -> None:
        """After a recovery into generation ``new``: the level of its successors'
        shadows (the controller may raise it). They start once every local trainer of
        ``new`` has finished its first iteration after the recovery (``start_due``):
        started at once, their imports and device set-up competed with the recovered
        trainers for CPU time (measured on the 2-core CI machine: the next iteration
        took 3.5-5x a steady one; 2x without shadows). A failure before then promotes
        a shadow started on the spot, as one that died would be."""
        if self.levels is not None:
            self.level = self.levels.on_recovery(new + 1, self.cfg.timeout_s)
            self._dead_since.clear()
        self._due = (new, time.monotonic(), {})

    def start_due(self) -> None:
        """Start the shadows ``after_recovery`` held back, once every local trainer of
        the new generation beat a second iteration (its first one after regaining is
        done) or finished, or a trainer asked for them (``shadows_wanted``), or after
        ``DEFER_MAX_S`` (a slow iteration must not leave the job without shadows for
        long)."""
        if self._due is None:
            return
        new, since, first = self._due
        ready = True
        for cl in self.cells:
            gen, beat = self.monitor.last_beat(cl.rank)
            if gen != new or beat is None:
                ready = False
            elif beat != b"done" and first.setdefault(cl.rank, beat) == beat:
                ready = False
        if not ready and self.store is not None and time.monotonic() - self._wanted_checked > 0.25:
            # (a store request at most every 0.25 s, as the heartbeats are read)
            self._wanted_checked = time.monotonic()
            ready = self.store.check([keys.shadows_wanted(new)])
        if ready or time.monotonic() - since > DEFER_MAX_S:
            self._due = None
            self.start(new + 1)

    def observe_memory(self, gen: int, cl: Cell) -> None:
        """A trainer's memory report (the monitor calls this as it reads beats)."""
        from leto.preinit.guard import memory_key

        key = memory_key(gen, cl.rank)
        if self.store.check([key]):
            raw = self.store.get(key)
            if self._memory_seen.get(cl.rank) != raw:  # each report once
                self._memory_seen[cl.rank] = raw
                self.levels.observe(cl.rank, json.loads(raw))

    def replace_dead(self, gen: int) -> None:
        dead = [cl for cl in self.cells if cl.shadow is not None and cl.shadow.poll() is not None]
        key = keys.reshadow(gen + 1)
        if self.levels is not None:
            crashed, reclaimed = self._classify_dead(gen, dead)
            if reclaimed:
                self.store.add(key, 1)
            dead = crashed
        if self.level != "L3" and self.levels is None:
            for cl in dead:
                self._restart(cl, cl.shadow_generation)
            return
        if dead and self.level == "L3":
            self.store.add(key, 1)
        elif dead:  # below L3 a crashed shadow is replaced alone
            for cl in dead:
                self._restart(cl, cl.shadow_generation)
        self.restart_if_asked(gen)

    def ask_before_promotion(self, gen: int) -> None:
        """A recovery of ``gen``, before the nodes' fence barrier: at L3 a shadow that
        died since the agent last looked asks every node to restart all of theirs, in a
        fresh process-group namespace — a fresh shadow cannot join the group the others
        formed with the dead one. (Shadows not started yet, held back after a recovery,
        start now and meet in the group the others are still forming.)"""
        if self.level == "L3" and any(
            cl.shadow is not None and cl.shadow.poll() is not None for cl in self.cells
        ):
            self.store.add(keys.reshadow(gen + 1), 1)

    def restart_if_asked(self, gen: int) -> None:
        """Restart every local shadow of ``gen + 1`` in a fresh namespace if some node
        asked since this one last did (after a recovery's barrier, every node sees the
        same count: their shadows meet in the same namespace)."""
        key = keys.reshadow(gen + 1)
        n = job_store.counter(self.store, key)
        if n > self._reshadows.get(gen + 1, 0):
            self._reshadows[gen + 1] = n
            if self.levels is not None:
                self.level = self.levels.relaunch(gen + 1)
            for cl in self.cells:
                cl.drop_shadow()
            if not self.on:
                return  # the controller found no level that fits: none until a recovery
            for cl in self.cells:
                cl.pg_attempt = f"{cl.fallbacks}.{n}"
                self._restart(cl, gen + 1)

    def _restart(self, cl: Cell, generation: int) -> None:
        """A shadow in place of one that was dropped or died: its parked and run-ahead
        records go first, so whoever waits for this rank's shadow to park and settle (a
        fault plan's ``when: parked``, the preinitialization guard) waits for the new one
        (a set-up that failed ahead had settled: a fault then struck while the
        replacements were still starting)."""
        self.restarts += 1
        if self.store is not None:
            self.store.delete_key(keys.parked(generation, cl.rank))
            self.store.delete_key(keys.ahead_settled(generation, cl.rank))
        cl.start_shadow(generation, self.level)

    def _classify_dead(self, gen: int, dead: list[Cell]) -> tuple[list[Cell], list[Cell]]:
        """(crashed, reclaimed) among dead shadows; one not yet known either way (its
        trainer reports reclamations before its next beat) is in neither."""
        from leto.preinit.guard import reclaims_key

        crashed, reclaimed = [], []
        for cl in dead:
            key = reclaims_key(gen, cl.rank)
            n = job_store.counter(self.store, key)
            seen = self._reclaims_seen.get((gen, cl.rank), 0)
            events = [json.loads(self.store.get(f"{key}/{k}")) for k in range(seen + 1, n + 1)]
            self._reclaims_seen[(gen, cl.rank)] = n
            mine = [e for e in events if e["pid"] == cl.shadow.pid]
            if mine:
                for e in mine:
                    self.levels.on_reclaim(cl.rank, gen + 1, e)
                self._dead_since.pop(cl.shadow.pid, None)
                cl.drop_shadow()  # reaped; the restart replaces it
                reclaimed.append(cl)
                continue
            beat = self.monitor.last_beat(cl.rank)
            first = self._dead_since.setdefault(cl.shadow.pid, (beat, time.monotonic()))
            if beat != first[0] or time.monotonic() - first[1] > self.cfg.hang_timeout_s:
                self._dead_since.pop(cl.shadow.pid, None)
                crashed.append(cl)  # the trainer moved on without reporting it: a crash
        return crashed, reclaimed

    def summary(self):
        return self.levels.summary() if self.levels is not None else None


def device_total_bytes(index: int) -> int:
    """The GPU's memory through the driver API: no CUDA context in the agent."""
    from leto.memory.backends.cuda import _call, _driver

    d = _driver()
    _call("cuInit", d.cuInit, 0)
    dev = _call(f"cuDeviceGet({index})", d.cuDeviceGet, index)
    return int(_call("cuDeviceTotalMem", d.cuDeviceTotalMem, dev))
