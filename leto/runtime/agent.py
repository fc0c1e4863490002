"""The node agent: what ``leto run`` runs on each node.

Runs in the agent process. Starts the job store (node 0) and one cell per local rank,
then monitors: every ``poll_s`` its ``Monitor`` (``leto.runtime.monitor``) reports the
local trainers that died or hang (typed ``Failure`` records), and the store's failure
counter of the current generation tells of a failure on another node. On a failure every agent fences its active trainers, waits until every node has
fenced, and promotes its shadows together into the next generation (or, with shadows
off, starts trainers cold as torchrun would); then it starts the next shadows. A
trainer that exits with ``EXIT_FATAL`` reports a fatal failure (its retained state is
beyond parity): the job stops and says so.

Hangs: a trainer's heartbeat (``Context.heartbeat``, once per iteration) that stalls
for ``hang_timeout_s`` is a failure like a death (fencing SIGKILLs a stopped process).

A fatal failure (a trainer exits ``EXIT_FATAL``: its retained state is beyond parity;
or a state manager dies) falls back to checkpoints: every rank restarts cold on a
fresh pool from the newest complete DCP checkpoint.

A failure during a recovery is one more failure of the new generation.

A parked shadow that dies is replaced; at L3 every node restarts all shadows of that
generation in a fresh process-group namespace (``_replace_dead_shadows``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from leto import plugins
from leto.errors import EXIT_FATAL, LetoError
from leto.memory.config import PoolConfig
from leto.runtime import keys
from leto.runtime import store as job_store
from leto.runtime.cell import Cell
from leto.runtime.config import ENV_FAULT_PLAN, ENV_PREINIT, RunConfig
from leto.runtime.monitor import Failure, FailureKind, Monitor

log = logging.getLogger("leto.agent")


class Agent:
    def __init__(self, cfg: RunConfig, command: list[str]):
        self.cfg, self.command = cfg, command
        self.level = cfg.level()
        self.faults = json.loads(os.environ.get(ENV_FAULT_PLAN, "[]"))
        # A fault plan is executed by the fault plugin (faultkit), in this agent (page
        # loss) and in the trainers (points); --verify's digest by the verifiers in the
        # trainers: named here for every process the agent starts.
        names = [n for n in os.environ.get(plugins.ENV_PLUGINS, "").split(",") if n]
        if self.faults:
            names.append(plugins.FAULT_PLUGIN)
        if cfg.verify:
            names.append(plugins.VERIFY_PLUGIN)
        if names:
            os.environ[plugins.ENV_PLUGINS] = ",".join(dict.fromkeys(names))
        plugins.load(",".join(n for n in names if n != plugins.VERIFY_PLUGIN))  # trainers' only
        self.records: list[dict] = []
        self._signatures: set[tuple] = set()  # script errors recovered from once
        self.stopped: str | None = None  # why the job stopped early (a script error)
        self.pools: list[dict] = []  # each local pool's final status
        self.shadow_restarts = 0
        self._reshadows: dict[int, int] = {}  # generation -> L3 shadow restarts seen
        self.monitor: Monitor | None = None
        self.store: job_store.CountingStore | None = None
        self.levels = None  # preinit.levels.Levels under --shadow-level auto (controlled)
        self._reclaims_seen: dict[tuple[int, int], int] = {}  # (generation, rank) -> count
        self._memory_seen: dict[int, bytes] = {}  # rank -> its trainer's last memory report
        self._dead_since: dict[int, tuple] = {}  # shadow pid -> (trainer beat, monotonic)

    def _fault(self, generation: int, rank: int) -> dict | None:
        for f in self.faults:
            if f["generation"] == generation and f["rank"] == rank:
                return f
        return None

    def _pool(self, local_rank: int) -> PoolConfig:
        c = self.cfg
        kw = dict(
            device="cpu" if c.device == "cpu" else f"cuda:{local_rank}",
            data_pages=c.data_pages,
            tier1_pages=c.tier1_pages,
            allow_fault_injection=c.allow_fault_injection,
        )
        if c.page_bytes:
            kw["page_bytes"] = c.page_bytes
        return PoolConfig(**kw)

    def run(self) -> int:
        c = self.cfg
        store = job_store.CountingStore(
            job_store.connect(c.master_addr, c.master_port, c.node_rank == 0, c.timeout_s)
        )
        self.store = store
        store.add(keys.AGENTS, 1)
        job_store.wait_count(store, keys.AGENTS, c.nnodes, c.timeout_s, "every node's agent")
        first = c.node_rank * c.nproc_per_node
        cells = [
            Cell(c, lr, first + lr, self.command, self._pool(lr)) for lr in range(c.nproc_per_node)
        ]
        self.cells = cells
        self.monitor = Monitor(
            c, cells, store, on_beat=self._observe_memory if c.controlled else None
        )
        gen = 0
        code = 0
        try:
            self._setup_levels()
            for cell in cells:
                cell.start_active(0, self._fault(0, cell.rank))
            log.info(
                "started ranks %s (world %d, %s), shadows %s",
                [cl.rank for cl in cells], c.world_size, c.device, c.shadow_level,
            )  # fmt: skip
            if self.levels is not None:
                self.level = self.levels.start(1, c.timeout_s)
            if self.level not in ("off", None):
                for cell in cells:
                    cell.start_shadow(1, self.level)
            reported = False
            while True:
                time.sleep(c.poll_s)
                dead = self.monitor.failures(gen)
                if dead and not reported:
                    reported = True
                    self._detected = time.time()
                    for f in dead:
                        store.set(keys.failure(gen, f.rank), json.dumps(f.as_record()))
                        log.warning("generation %d: rank %d %s", gen, f.rank, f.describe())
                    store.add(keys.failures(gen), 1)
                    stop = self._script_error(gen, dead)
                    if stop is not None:
                        log.error("%s", stop)
                        self.stopped = stop
                        code = 1
                        break
                if dead and c.recovery == "checkpoint":
                    store.add(keys.fatal(gen), 1)  # the baseline: no in-place recovery
                if any(f.code == EXIT_FATAL for f in dead):
                    store.add(keys.fatal(gen), 1)
                sm_dead = [cl for cl in cells if cl.sm.proc.poll() is not None]
                if sm_dead and not job_store.counter(store, keys.fatal(gen)):
                    for cl in sm_dead:
                        lost = Failure(cl.rank, FailureKind.STATE_MANAGER)
                        store.set(keys.failure(gen, cl.rank), json.dumps(lost.as_record()))
                        log.warning("generation %d: rank %d %s", gen, cl.rank, lost.describe())
                    store.add(keys.fatal(gen), 1)
                    store.add(keys.failures(gen), 1)
                    if not reported:
                        self._detected, reported = time.time(), True
                if job_store.counter(store, keys.fatal(gen)):
                    if not reported:
                        self._detected = time.time()
                    if len(self.records) >= c.max_failures:
                        code = EXIT_FATAL
                        break
                    log.warning("generation %d: fatal failure, falling back to the checkpoint", gen)
                    self._fallback(gen)
                    gen += 1
                    reported = False
                    continue
                if job_store.counter(store, keys.failures(gen)):
                    if not reported:
                        self._detected = time.time()
                    if len(self.records) >= c.max_failures:
                        code = 1
                        break
                    log.info("generation %d: HOF, recovering in place", gen)
                    self._recover(gen)
                    gen += 1
                    reported = False
                    continue
                self._replace_dead_shadows(gen)
                if all(cl.active.poll() == 0 for cl in cells):
                    log.info("generation %d: every local trainer finished", gen)
                    store.add(keys.DONE, 1)
                    job_store.wait_count(store, keys.DONE, c.nnodes, c.timeout_s, "every node")
                    break
        finally:
            if self.levels is not None:
                Path(c.log_dir).mkdir(parents=True, exist_ok=True)
                self.levels.write(Path(c.log_dir))
            self.pools = [self._pool_status(cl) for cl in cells]
            for cl in cells:
                cl.stop()
            try:
                self._collect()
            finally:
                # Node 0 hosts the store: it stays up until every agent has collected.
                store.add(keys.COLLECTED, 1)
                if c.node_rank == 0:
                    job_store.wait_count(
                        store, keys.COLLECTED, c.nnodes, c.timeout_s, "every agent to finish"
                    )
            Path(c.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(c.log_dir) / f"node{c.node_rank}.recovery.json").write_text(
                json.dumps(self.summary(gen), indent=2)
            )
        return code

    def _script_error(self, gen: int, dead: list[Failure]) -> str | None:
        """Why the job stops instead of recovering, or None. A Python exception is a
        script error, not a hardware failure: before its trainer began training (start-up,
        or a recovery's resume) it stops the job at once; the same exception at the same
        place as one already recovered from stops it too (a restart loop otherwise)."""
        for f in dead:
            if not f.script_error:
                continue
            exc, file = f.error["exception"], f.error.get("file", "?")
            where = f"full traceback in {file}; logs in {self.cfg.log_dir}"
            if not self.store.check([keys.resumed(gen, f.rank)]):
                return (
                    f"rank {f.rank} raised {exc} before it began training (generation {gen}): "
                    f"a script error, not a hardware failure — the job stops.\n"
                    f"{f.traceback_tail()}\n({where})"
                )
            sig = f.signature()
            if sig in self._signatures:
                return (
                    f"rank {f.rank} raised the same {exc} at the same place again after a "
                    f"recovery (generation {gen}): the job stops instead of looping.\n"
                    f"{f.traceback_tail()}\n({where})"
                )
            self._signatures.add(sig)
        return None

    def _replace_dead_shadows(self, gen: int) -> None:
        """A parked shadow that died is replaced. At L1/L2 alone; at L3 its process group
        is gone with it, so every node restarts all shadows of the next generation in a
        fresh process-group namespace (a counter in the store tells the other nodes).

        Under the controller a shadow the trainer's hook reclaimed is not a crash: its
        rank's level goes down, and every node restarts its shadows at the new job
        level (the same counter)."""
        dead = [cl for cl in self.cells if cl.shadow is not None and cl.shadow.poll() is not None]
        key = keys.reshadow(gen + 1)
        if self.levels is not None:
            crashed, reclaimed = self._classify_dead(gen, dead)
            if reclaimed:
                self.store.add(key, 1)
            dead = crashed
        if self.level != "L3" and self.levels is None:
            for cl in dead:
                self.shadow_restarts += 1
                cl.start_shadow(cl.shadow_generation, self.level)
            return
        if dead and self.level == "L3":
            self.store.add(key, 1)
        elif dead:  # below L3 a crashed shadow is replaced alone
            for cl in dead:
                self.shadow_restarts += 1
                cl.start_shadow(cl.shadow_generation, self.level)
        n = job_store.counter(self.store, key)
        if n > self._reshadows.get(gen + 1, 0):
            self._reshadows[gen + 1] = n
            if self.levels is not None:
                self.level = self.levels.relaunch(gen + 1)
            for cl in self.cells:
                cl.drop_shadow(grace_s=0)
            if self.level in ("off", None):
                return  # the controller found no level that fits: none until a recovery
            for cl in self.cells:
                self.shadow_restarts += 1
                cl.pg_attempt = f"{cl.fallbacks}.{n}"
                cl.start_shadow(gen + 1, self.level)

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
                cl.drop_shadow(grace_s=0)  # reaped; the restart below replaces it
                reclaimed.append(cl)
                continue
            beat = self.monitor.last_beat(cl.rank)
            first = self._dead_since.setdefault(cl.shadow.pid, (beat, time.monotonic()))
            if beat != first[0] or time.monotonic() - first[1] > self.cfg.hang_timeout_s:
                self._dead_since.pop(cl.shadow.pid, None)
                crashed.append(cl)  # the trainer moved on without reporting it: a crash
        return crashed, reclaimed

    def _setup_levels(self) -> None:
        """``--shadow-level auto``: the controller's per-rank state and the guard
        configuration every trainer gets (on a GPU or an emulated CPU device)."""
        c = self.cfg
        if not c.controlled:
            return
        from leto.preinit.guard import GuardConfig
        from leto.preinit.levels import Levels

        emulated = c.device == "cpu"
        capacity = c.device_memory_bytes or _device_total_bytes(self.cells[0].local_rank)
        pcfg = c.policy(capacity)
        fp = pcfg.footprints
        ranks = [cl.rank for cl in self.cells]
        self.levels = Levels(self.store, ranks, c.world_size, pcfg, emulated)
        guard = GuardConfig(fp, c.reclaim_below_bytes, capacity, emulated).to_json()
        for cl in self.cells:
            cl.extra_env[ENV_PREINIT] = guard

    def _pool_status(self, cl: Cell) -> dict:
        """The pool's final status (pages found lost, rebuilt, pending) for the summary;
        a dead state manager is reported, not waited for."""
        from leto.memory.client import PoolClient

        if cl.sm.proc.poll() is not None:
            return {"rank": cl.rank, "error": f"state manager exited {cl.sm.proc.poll()}"}
        try:
            with PoolClient.connect(
                cl.sm.socket_path, cl.sm.token, role="observer", timeout_s=10
            ) as c:
                return {"rank": cl.rank, **c.status()}
        except Exception as e:  # the summary reports it; the run's outcome stands
            return {"rank": cl.rank, "error": f"{type(e).__name__}: {e}"}

    def _observe_memory(self, gen: int, cl: Cell) -> None:
        from leto.preinit.guard import memory_key

        key = memory_key(gen, cl.rank)
        if self.store.check([key]):
            raw = self.store.get(key)
            if self._memory_seen.get(cl.rank) != raw:  # each report once
                self._memory_seen[cl.rank] = raw
                self.levels.observe(cl.rank, json.loads(raw))

    def _next_level(self, new: int) -> None:
        """After a recovery into generation ``new``: the level of its successors'
        shadows (the controller may raise it)."""
        if self.levels is not None:
            self.level = self.levels.on_recovery(new + 1, self.cfg.timeout_s)
            self._dead_since.clear()

    def _recover(self, gen: int) -> None:
        c, store = self.cfg, self.store
        t0 = time.time()
        for cl in self.cells:
            cl.fence()
        t_fenced = time.time()
        store.add(keys.fenced(gen), 1)
        job_store.wait_count(store, keys.fenced(gen), c.nnodes, c.timeout_s, "every node to fence")
        log.info("generation %d: fenced in %.3f s (every node: %.3f s)", gen,
                 t_fenced - t0, time.time() - t0)  # fmt: skip
        lost = self._lose(gen)
        if lost.get("device") or lost.get("host"):
            log.info("generation %d: fault plan lost %s", gen, lost)
        new = gen + 1
        promoted = self.level
        if self.level in ("off", None):
            for cl in self.cells:
                cl.drop_shadow(grace_s=0)
                cl.start_active(new, self._fault(new, cl.rank))
        else:
            for cl in self.cells:
                if cl.shadow is None or cl.shadow.poll() is not None:
                    cl.start_shadow(new, self.level)  # none ready: promote a fresh one
                cl.promote(self._fault(new, cl.rank))
        t_promoted = time.time()
        log.info(
            "generation %d: %s in %.3f s", new,
            "cold restarts" if promoted in ("off", None) else f"{promoted} shadows promoted",
            t_promoted - t0,
        )  # fmt: skip
        self._next_level(new)
        if self.level not in ("off", None):
            for cl in self.cells:
                cl.start_shadow(new + 1, self.level)
        self.records.append(
            {
                "generation": gen,
                "class": "HOF",
                "detected_at": self._detected,
                "fencing_s": t_fenced - t0,
                "all_nodes_fenced_s": time.time() - t0,
                "promotion_s": t_promoted - t0,
                "level": promoted,
                "local_ranks": [cl.rank for cl in self.cells],
                "pages_lost": lost,
            }
        )

    def _lose(self, gen: int) -> dict:
        """A fault plan's page losses for this failure, on every local rank's pool, while
        no trainer runs (faultkit's mechanism: the pools must allow fault injection):
        ``lose_pages`` random data pages per protection group, ``host_parity_pages``
        tier-1 pages, and ``inject``, explicit ``[kind, name, [pages]]`` losses."""
        plan = [f for f in self.faults if f["generation"] == gen]
        pages = sum(f.get("lose_pages", 0) for f in plan)
        host = sum(f.get("host_parity_pages", 0) for f in plan)
        explicit = [e for f in plan for e in f.get("inject", [])]
        lost = {"device": 0, "host": 0}
        if not (pages or host or explicit):
            return lost
        import random

        from leto.memory.client import PoolClient

        for cl in self.cells:
            rng = random.Random(gen * 1_000 + cl.rank)
            with PoolClient.connect(cl.sm.socket_path, cl.sm.token, role="faultkit") as f:
                try:
                    if pages or host:
                        for k, v in plugins.lose_pages(f, pages, host, rng).items():
                            if isinstance(v, list):  # e.g. groups smaller than asked
                                lost.setdefault(k, []).extend([cl.rank, *x] for x in v)
                            else:
                                lost[k] += v
                    for kind, name, idx in explicit:
                        f.inject_loss(kind, name, list(idx))
                        lost["host" if kind.startswith("tier") else "device"] += len(idx)
                except LetoError as e:
                    # E.g. a trainer that died before it attached its state: the pool has
                    # nothing (or not that) to lose. The failure is still recovered.
                    log.warning("rank %d: the fault plan's page loss was refused: %s", cl.rank, e)
                    lost.setdefault("refused", []).append(f"rank {cl.rank}: {e}")
        return lost

    def _fallback(self, gen: int) -> None:
        """A fatal failure: every rank restarts cold on a fresh pool from the newest
        complete checkpoint (torchrun-style, but only for FFs)."""
        c, store = self.cfg, self.store
        t0 = time.time()
        for cl in self.cells:
            cl.fence()
            cl.drop_shadow(grace_s=0)  # its generation's process group (L3) has no future
        t_fenced = time.time()
        store.add(keys.fenced(gen), 1)
        job_store.wait_count(store, keys.fenced(gen), c.nnodes, c.timeout_s, "every node to fence")
        for cl in self.cells:
            cl.reset_pool()
            # The dropped L3 shadows formed their group under the next generation; the
            # cold trainers must not find those addresses (seen in a trace replay: gloo
            # connectFullMesh refused).
            cl.fallbacks += 1
            cl.pg_attempt = f"{cl.fallbacks}.0"
        new = gen + 1
        for cl in self.cells:
            cl.start_active(new, self._fault(new, cl.rank))
        log.info("generation %d: fresh pools, cold trainers from the newest checkpoint", new)
        self._next_level(new)
        if self.level not in ("off", None):
            for cl in self.cells:
                cl.start_shadow(new + 1, self.level)
        self.records.append(
            {
                "generation": gen,
                "class": "FF",
                "detected_at": self._detected,
                "fencing_s": t_fenced - t0,
                "promotion_s": time.time() - t0,
                "level": "checkpoint",
                "local_ranks": [cl.rank for cl in self.cells],
            }
        )

    def _collect(self) -> None:
        """Trainer-side timings of each recovery, as the promoted trainers reported."""
        for rec in self.records:
            g = rec["generation"] + 1
            ranks = {}
            for r in rec["local_ranks"]:
                key = keys.resumed(g, r)
                if self.store.check([key]):
                    ranks[r] = json.loads(self.store.get(key))
            failure_keys = {
                r: keys.failure(rec["generation"], r) for r in range(self.cfg.world_size)
            }
            why = {
                r: json.loads(self.store.get(k))
                for r, k in failure_keys.items()
                if self.store.check([k])
            }
            rec["failed_ranks"] = sorted(why)
            # How each failed: exit code or hang, and the uncaught exception's error file.
            rec["failures"] = {str(r): w for r, w in why.items()}
            rec["trainers"] = ranks
            if ranks:
                rec["recovery_s"] = max(v["time"] for v in ranks.values()) - rec["detected_at"]

    def summary(self, last_gen: int) -> dict:
        return {
            "measured": self.monitor.ettr() if self.monitor is not None else {"ettr": None},
            "config": asdict(self.cfg),
            "generations": last_gen + 1,
            "failures": len(self.records),
            "shadow_restarts": self.shadow_restarts,
            "stopped": self.stopped,  # why the job stopped early (a script error), or None
            "recoveries": self.records,
            "pools": self.pools,
            "preinit": self.levels.summary() if self.levels is not None else None,
            "shadow_level": self.level,  # of the parked shadows now (None: none fits)
            # This agent's load on the job's TCPStore (every request it made).
            "store_requests": self.store.requests if self.store is not None else 0,
            "store_requests_per_s": self.store.rate() if self.store is not None else 0.0,
        }


def _device_total_bytes(index: int) -> int:
    """The GPU's memory through the driver API: no CUDA context in the agent."""
    from leto.memory.backends.cuda import _call, _driver

    d = _driver()
    _call("cuInit", d.cuInit, 0)
    dev = _call(f"cuDeviceGet({index})", d.cuDeviceGet, index)
    return int(_call("cuDeviceTotalMem", d.cuDeviceTotalMem, dev))
