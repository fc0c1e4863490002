"""The node agent: what ``leto run`` runs on each node.

Runs in the agent process. Starts the job store (node 0) and one cell per local rank,
then watches: every ``poll_s`` its ``Monitor`` (``leto.launch.monitor``) reports the
local trainers that died or hang (typed ``Failure`` records), and the store's failure
counter of the current generation tells of a failure on another node. What happens
then is ``leto.launch.recovery`` (in place: fence every node, promote the shadows
together; fatal: the checkpoint fallback), and the shadows are
``leto.launch.shadows``'. The agent decides which, and when the job stops:

* a trainer exiting ``EXIT_FATAL`` (its retained state is beyond parity, or silently
  corrupted) or a dead state manager is a fatal failure: the checkpoint fallback. The
  same fatal failure (exception, message, place) right after a fallback falls back a
  tier — to an older checkpoint (or the start) — and a third time stops the job with
  the chain in the summary (a persistent fault must not loop);
* a script error (an uncaught Python exception) before its trainer began training, or
  the same one again after a recovery, stops the job (``_script_error``);
* ``max_failures`` failures stop it;
* a signal (SIGTERM from a scheduler, Ctrl-C) stops it (``on_signal``): every live
  trainer fenced at once, the record's ``stopped`` says which signal, ``fenced`` whom.

Whichever way it ends, every trainer, shadow and state manager is stopped and the
record (``node<N>.recovery.json``) written; while it runs, ``node<N>.pools.json`` in the
log directory tells ``leto pool status --log-dir`` where each rank's pool is.

A failure during a recovery is one more failure of the new generation.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from leto import plugins
from leto.errors import EXIT_FATAL, EXIT_RECOVERABLE, InvalidInput
from leto.integrity import faulty
from leto.job import fault_plan, keys
from leto.job import store as job_store
from leto.job.config import ENV_FAULT_PLAN, RunConfig
from leto.launch.cell import Cell, kill_group, stop_group
from leto.launch.monitor import Failure, FailureKind, Monitor
from leto.launch.recovery import Recovery, RecoveryRecord
from leto.launch.relay import Relay
from leto.launch.shadows import Shadows
from leto.launch.zygote import Zygote
from leto.launch.zygote import enabled as zygote_enabled
from leto.memory.config import PoolConfig
from leto.proc import started_at

log = logging.getLogger("leto.agent")

# Where a running job's pools are (socket directory, token, per local rank), for
# `leto pool status --log-dir` — written 0600 (the token is the pool's only lock) while
# the job runs and removed when it ends.
POOLS_FILE = "node{node}.pools.json"
RELAY_S = 0.1  # how often the script's new output is copied to the console
# How long failures that are only peers' broken collectives wait for their cause to be
# seen (``Agent._hold``): a process ends a little after its connections close. Bounded:
# a cause never seen (a whole node gone) delays that recovery by this much.
PEER_GRACE_S = 2.0


class SignalStop(BaseException):
    """A signal (SIGTERM from a scheduler, SIGINT from Ctrl-C) stops the job: raised
    in the agent's main loop by ``Agent.on_signal``, handled there like the job's end
    (every trainer fenced, shadows and state managers stopped, the record written).
    A BaseException: no ``except Exception`` on the way may swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Agent:
    def __init__(self, cfg: RunConfig, command: list[str], zygote: Zygote | None = None):
        """``zygote``: one ``leto run`` started before it imported torch (the two
        imports then overlap); the agent owns it from here and closes it at the end.
        None: ``run()`` starts one (``LETO_ZYGOTE=0``: none)."""
        self.cfg, self.command = cfg, command
        self.zygote = zygote
        # Checked against its schema first: a guessed key or page loss the pools refuse
        # stops the job before anything starts (leto.job.fault_plan).
        self.faults = fault_plan.parse(
            os.environ.get(ENV_FAULT_PLAN, "[]"), cfg.world_size, cfg.allow_fault_injection
        )
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
        self.records: list[RecoveryRecord] = []
        self._notices_seen, self._notices_at = 0, 0.0  # trainers' console lines logged
        self.script_exit: int | None = None  # a trainer's own sys.exit(n): leto run's code
        self._held: tuple[int, float] | None = None  # (generation, since): see _hold
        # script errors recovered from once: signature -> the generation that raised it
        self._signatures: dict[tuple, int] = {}
        # Recoverable failures Leto raised (EXIT_RECOVERABLE): signature -> generation.
        self._recoverable: dict[tuple, int] = {}
        self.tally: faulty.Tally | None = None  # detections that named ranks (run())
        # Fatal failures by what they said (exception, message, where): the generations
        # each happened in. The same one again falls back a tier; a third time stops.
        self._fatal: dict[tuple, list[int]] = {}
        self._fatal_now: tuple | None = None  # this generation's, if its trainer said
        self.stopped: str | None = None  # why the job stopped early (a script error, "SIGTERM")
        self.fenced: list[int] = []  # ranks whose live trainers the agent fenced at the stop
        self._stopping = False  # cleanup has begun: a signal now must not interrupt it
        self.pools: list[dict] = []  # each local pool's final status
        self.monitor: Monitor | None = None
        self.store: job_store.CountingStore | None = None
        self.shadows: Shadows | None = None
        self.recovery: Recovery | None = None

    def _pool(self, local_rank: int) -> PoolConfig:
        c = self.cfg
        kw = dict(
            device="cpu" if c.device == "cpu" else f"cuda:{local_rank // c.ranks_per_gpu}",
            data_pages=c.data_pages,
            tier1_pages=c.tier1_pages,
            allow_fault_injection=c.allow_fault_injection,
        )
        if c.page_bytes:
            kw["page_bytes"] = c.page_bytes
        return PoolConfig(**kw)

    def on_signal(self, signum: int, frame) -> None:
        """The handler ``leto run`` installs for SIGTERM and SIGINT: the first stops the
        job (``SignalStop`` unwinds the main loop into the cleanup); later ones, and any
        during the cleanup, are logged and ignored — an interrupted cleanup would leave
        trainers, state managers and their directories behind."""
        if self._stopping:
            log.warning("%s while stopping: ignored (the job is being stopped)",
                        signal.Signals(signum).name)  # fmt: skip
            return
        self._stopping = True
        raise SignalStop(signum)

    def _said_start(self, zygote, t_forked: float) -> None:
        """Where a fresh job's start went before its trainers' own (their rank logs say
        the rest, to the end of their first iteration), from this process's start."""
        began = started_at()
        if began is None:
            return
        parts = []
        if zygote is not None and zygote.ready_at is not None:
            parts.append(f"the zygote ready (torch imported) {zygote.ready_at - began:.2f} s")
        parts.append(f"the first trainers started {t_forked - began:.2f} s")
        parts.append(f"the state managers READY {time.time() - began:.2f} s")
        log.info("start-up, after leto run's process started: %s", ", ".join(parts))

    def _connect(self):
        c = self.cfg
        try:
            raw = job_store.connect(c.master_addr, c.master_port, c.node_rank == 0, c.timeout_s)
        except dist.DistNetworkError as e:
            # torch's message (a C++ traceback) names neither the cause's fix nor the flag.
            if c.node_rank == 0 and "EADDRINUSE" in str(e):
                raise InvalidInput(
                    f"port {c.master_port} on {c.master_addr} is in use (another job?); "
                    "pass --master-port PORT; nothing started"
                ) from None
            raise
        return job_store.CountingStore(raw)

    def run(self) -> int:
        c = self.cfg
        store = self.store = self._connect()
        cells: list[Cell] = []
        self.cells = cells
        shadows = recovery = zygote = relay = None
        gen = 0
        code = 0
        try:
            self._place()  # before any process that could touch a GPU starts
            # Importing torch while the state managers start: every trainer and shadow
            # is forked from it (leto.launch.zygote).
            zygote = self.zygote
            if zygote is None and zygote_enabled():
                zygote = Zygote(c.timeout_s)
            store.add(keys.AGENTS, 1)
            job_store.wait_count(store, keys.AGENTS, c.nnodes, c.timeout_s, "every node's agent")
            first = c.node_rank * c.nproc_per_node
            for lr in range(c.nproc_per_node):  # each starts its state manager
                cells.append(Cell(c, lr, first + lr, self.command, self._pool(lr)))
                cells[-1].zygote = zygote
            self._write_pools()
            shadows = self.shadows = Shadows(c, cells)
            self.monitor = Monitor(
                c, cells, store, on_beat=shadows.observe_memory if c.controlled else None
            )
            shadows.monitor = self.monitor
            recovery = self.recovery = Recovery(c, cells, store, shadows, self.faults)
            shadows.setup(store)
            for cell in cells:
                cell.start_active(0, recovery.fault(0, cell.rank))
            t_forked = time.time()
            for cell in cells:  # started together, beside the trainers' own start-up
                cell.sm.wait_ready()
            self._said_start(zygote, t_forked)
            log.info(
                "started ranks %s (world %d, %s), shadows %s; their pools: leto pool status "
                "--log-dir %s --rank R",
                [cl.rank for cl in cells], c.world_size, c.device, c.shadow_level, c.log_dir,
            )  # fmt: skip
            shadows.start_first()
            out = {"stdout": sys.stdout, "stderr": sys.stderr}.get(c.console)
            relay = Relay(cells, out, c.world_size, c.local_ranks_filter)
            relayed = 0.0
            if not c.checkpointing:
                log.warning(
                    "--no-checkpoints: a fatal failure restarts the job from its first iteration"
                )
            reported = False
            while True:
                time.sleep(c.poll_s)
                self._notices(store)
                if time.monotonic() - relayed >= RELAY_S:
                    relay.poll()
                    relayed = time.monotonic()
                dead = self.monitor.failures(gen)
                if dead and not reported and self._hold(dead, store, gen):
                    continue
                if dead and not reported:
                    reported = True
                    self._detected = time.time()
                    for f in dead:
                        store.set(keys.failure(gen, f.rank), json.dumps(f.as_record()))
                        log.warning("generation %d: rank %d %s", gen, f.rank, f.describe())
                    store.add(keys.failures(gen), 1)
                    stop = self._faulty(gen, dead)
                    if stop is None:
                        stop = self._script_error(gen, dead)
                    if stop is not None:
                        log.error("%s", stop)
                        self.stopped = stop
                        code = self.script_exit or 1  # a script's sys.exit(n) is n
                        break
                if dead and c.recovery == "checkpoint":
                    store.add(keys.fatal(gen), 1)  # the baseline: no in-place recovery
                if any(f.code == EXIT_FATAL for f in dead):
                    store.add(keys.fatal(gen), 1)
                    said = [f for f in dead if f.code == EXIT_FATAL and f.error is not None]
                    if said and self._fatal_now is None:
                        self._fatal_now = said[0].signature()
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
                        self.stopped = self._too_many(gen)
                        code = EXIT_FATAL
                        break
                    before = self._fatal.setdefault(self._fatal_now, []) if self._fatal_now else []
                    # Without checkpoints there is one tier: the start.
                    if len(before) >= (2 if c.checkpointing else 1):
                        tried = (
                            "the newest checkpoint and an older one were tried"
                            if c.checkpointing
                            else "a restart from the first iteration was tried (--no-checkpoints)"
                        )
                        self.stopped = (
                            f"a fatal failure in generation {gen} is the same as in generations "
                            f"{', '.join(map(str, before))} ({self._fatal_now[0]}: "
                            f"{self._fatal_now[1]}); {tried} — the job stops instead of looping."
                        )
                        log.error("%s", self.stopped)
                        code = EXIT_FATAL
                        break
                    skip = len(before)  # the same failure after the last fallback: older
                    if skip:
                        log.warning(
                            "generation %d: fatal failure, the same as in generation %d: "
                            "falling back to an older checkpoint", gen, before[-1],
                        )  # fmt: skip
                    else:
                        log.warning(
                            "generation %d: fatal failure, falling back to %s", gen,
                            "the checkpoint" if c.checkpointing else "the first iteration "
                            "(--no-checkpoints)",
                        )  # fmt: skip
                    rec = recovery.fallback(gen, self._detected, skip=skip)
                    self._write_pools()  # the fallback started fresh state managers
                    rec.repeats = list(before) or None
                    self.records.append(rec)
                    if self._fatal_now:
                        before.append(gen)
                    self._fatal_now = None
                    gen += 1
                    reported = False
                    continue
                if job_store.counter(store, keys.failures(gen)):
                    if not reported:
                        self._detected = time.time()
                    if len(self.records) >= c.max_failures:
                        self.stopped = self._too_many(gen)
                        code = 1
                        break
                    log.info("generation %d: HOF, recovering in place", gen)
                    self.records.append(recovery.in_place(gen, self._detected))
                    self._fatal_now = None
                    gen += 1
                    reported = False
                    continue
                shadows.start_due()
                shadows.replace_dead(gen)
                if all(cl.active.poll() == 0 for cl in cells):
                    log.info("generation %d: every local trainer finished", gen)
                    store.add(keys.DONE, 1)
                    job_store.wait_count(store, keys.DONE, c.nnodes, c.timeout_s, "every node")
                    break
        except SignalStop as e:
            self.stopped = str(e)  # "SIGTERM": the record's "stopped"
            code = 128 + e.signum
            log.warning("%s: stopping the job", e)
        finally:
            self._stopping = True
            self.fenced = self._fence_all(cells)
            if relay is not None:
                relay.poll(final=True)  # every line, a fenced trainer's last ones too
            if self.stopped in ("SIGTERM", "SIGINT"):
                log.warning("%s: %d trainer(s) fenced", self.stopped, len(self.fenced))
            if shadows is not None and shadows.levels is not None:
                Path(c.log_dir).mkdir(parents=True, exist_ok=True)
                shadows.levels.write(Path(c.log_dir))
            self.pools = [self._pool_status(cl) for cl in cells]
            for cl in cells:
                cl.stop()
            if zygote is not None:
                zygote.close()
            self._pools_file().unlink(missing_ok=True)  # the pools are gone
            try:
                if recovery is not None:
                    recovery.collect(self.records)
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

    def _fence_all(self, cells: list[Cell]) -> list[int]:
        """Stop every live trainer's process group, then kill them all, then wait for
        them: the ranks it fenced. One at a time (each cell's stop), the last ranks
        outlived their peers long enough to fail on the closed connections (gloo's
        "Connection closed by peer") and leave error files that read as crashes of their
        own; killed in one loop, a rank still did when the agent was preempted between
        two kills (CI, two busy cores). A stopped rank runs nothing when a peer dies."""
        live = [cl for cl in cells if cl.active is not None and cl.active.poll() is None]
        for cl in live:
            stop_group(cl.active)
        for cl in live:
            kill_group(cl.active)
        for cl in live:
            cl.fence()  # waits
        return [cl.rank for cl in live]

    def _too_many(self, gen: int) -> str:
        return (
            f"{len(self.records)} failures, --max-failures {self.cfg.max_failures}: the job "
            f"stops at generation {gen} (logs in {self.cfg.log_dir})"
        )

    def _pools_file(self) -> Path:
        return Path(self.cfg.log_dir) / POOLS_FILE.format(node=self.cfg.node_rank)

    def _write_pools(self) -> None:
        """Where each local rank's pool listens and its token (``leto pool status
        --log-dir``), readable by this user only."""
        pools = {
            str(cl.rank): {"socket_dir": str(cl.sm.socket_dir), "token": cl.sm.token,
                           "state_manager_pid": cl.sm.pid}
            for cl in self.cells
        }  # fmt: skip
        path = self._pools_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"node": self.cfg.node_rank, "ranks": pools}, f)
        tmp.replace(path)  # whole, or not there

    def _place(self) -> None:
        """This node's ranks and their devices; with ``--exclude-faulty``, the GPUs a
        previous run of the job found faulty (``<log-dir>/faulty-devices.json``) are
        left out of ``CUDA_VISIBLE_DEVICES`` for every process it starts."""
        c = self.cfg
        node = faulty.node_name()
        if c.exclude_faulty:
            bad = faulty.excluded(c.log_dir, node)
            if bad and c.device == "cpu":
                log.warning("--exclude-faulty: %s lists GPUs %s of this node, but the job "
                            "runs on the CPU: nothing to leave out", faulty.FILE, sorted(bad))  # fmt: skip
            elif bad:
                gpus = faulty.node_gpus()
                os.environ["CUDA_VISIBLE_DEVICES"] = faulty.visible_devices(
                    gpus, bad, c.nproc_per_node, c.ranks_per_gpu
                )
                log.warning("--exclude-faulty: GPUs %s of %s found faulty before (%s): the "
                            "ranks run on CUDA_VISIBLE_DEVICES=%s", sorted(bad), node,
                            faulty.FILE, os.environ["CUDA_VISIBLE_DEVICES"])  # fmt: skip
        if c.device == "cuda":
            try:
                gpus = faulty.node_gpus()
            except (InvalidInput, OSError, subprocess.SubprocessError):
                gpus = []
            if gpus:  # none listed (no nvidia-smi): the trainers' CUDA start-up will say
                faulty.enough_gpus(gpus, c.nproc_per_node, c.ranks_per_gpu)
        first = c.node_rank * c.nproc_per_node
        self.tally = faulty.Tally(
            node,
            {
                first + lr: faulty.device_of(c.device, lr, c.ranks_per_gpu)
                for lr in range(c.nproc_per_node)
            },
        )

    def _faulty(self, gen: int, dead: list[Failure]) -> str | None:
        """Detections that named a rank (the error files' ``named``): a device of this
        node named for the second time is reported and recorded; with
        ``--exclude-faulty`` the job stops (why, or None)."""
        if self.tally is None:
            return None
        new = self.tally.observe(gen, [f.error for f in dead])
        if not new:
            return None
        path = faulty.append(self.cfg.log_dir, new)
        said = []
        for rec in new:
            where = ", ".join(f"iteration {d['iteration']} ({d['check']}, generation "
                              f"{d['generation']})" for d in rec["detections"])  # fmt: skip
            said.append(f"rank {rec['rank']}'s device {rec['device']} on {rec['node']} was "
                        f"named as computing wrong twice: {where}")  # fmt: skip
            log.error("%s: a faulty device (recorded in %s)", said[-1], path)
        if not self.cfg.exclude_faulty:
            return None
        return (
            f"{'; '.join(said)} — a hardware failure (--exclude-faulty): the job stops, "
            f"keeping its checkpoints. Start it again with leto run --exclude-faulty and "
            f"the same --log-dir: the devices listed in {path} are left out and it resumes "
            f"from the newest checkpoint"
        )

    def _hold(self, dead: list[Failure], store, gen: int) -> bool:
        """Wait for the failure that caused these? True while every failure seen is a
        peer's broken collective (``Failure.collateral``), no other node has reported
        one for this generation, and ``PEER_GRACE_S`` has not passed since the first:
        a rank's own ``sys.exit(3)`` (the job stops with 3) or crash is then seen with
        them, not a poll later — after a recovery had begun."""
        if not all(f.collateral for f in dead) or job_store.counter(store, keys.failures(gen)):
            self._held = None
            return False
        now = time.monotonic()
        if self._held is None or self._held[0] != gen:
            self._held = (gen, now)
        return now - self._held[1] < PEER_GRACE_S

    def _script_error(self, gen: int, dead: list[Failure]) -> str | None:
        """Why the job stops instead of recovering, or None. A Python exception is a
        script error, not a hardware failure: before its trainer began training (start-up,
        or a recovery's resume) it stops the job at once; the same exception at the same
        place as one already recovered from stops it too (a restart loop otherwise)."""
        for f in dead:
            if f.code == EXIT_RECOVERABLE and f.error is not None:
                # Raised by Leto on every rank at once (a replay mismatch): recovered in
                # place; the same one again in a later generation is a device that
                # computes wrong every time, and redoing it would loop.
                sig = f.signature()
                first = self._recoverable.setdefault(sig, gen)
                if first < gen:
                    return (
                        f"rank {f.rank} raised {f.error['exception']} again at the same "
                        f"place after a recovery in place (generations {first} and {gen}; "
                        f"{f.first_error_line()}) — a device that computes wrong every "
                        f"time: the job stops instead of looping; take the named GPU out "
                        f"of the job.\n{f.traceback_tail()}\n(logs in {self.cfg.log_dir})"
                    )
                continue
            if not f.script_error or f.collateral:
                # (a collective a peer's failure broke is that failure's, never the
                # script's: seen in CI beside a peer's fatal exit before training began)
                continue
            # The first line says it all (rank, exit code, what the error said); the
            # traceback's tail follows, from the error file or the end of the rank's log.
            if f.error is not None:
                what = f"raised {f.error['exception']}"
                where = f"full traceback in {f.error.get('file', '?')}; logs in {self.cfg.log_dir}"
            else:
                what = f"exited with code {f.code}"
                where = f"the end of {f.log}" if f.log else f"logs in {self.cfg.log_dir}"
            said = f.first_error_line()
            if f.error is not None:  # "exited with code N" already says it otherwise
                said = f"exit code {f.code}: {said}"
            if f.error is None and f.code is not None and f.code > 0:
                # An exit with a code and no exception (sys.exit(3), exit(), argparse's 2):
                # the script's own verdict, as torchrun returns it — never retried.
                self.script_exit = f.code
                if self.store.check([keys.resumed(gen, f.rank)]):
                    return (
                        f"rank {f.rank} exited with code {f.code} in generation {gen} (the "
                        f"script's own exit — sys.exit({f.code}), exit() — not an exception "
                        f"and not a crash): the script's verdict, as under torchrun; the job "
                        f"stops with exit code {f.code}.\n{f.traceback_tail()}\n({where})"
                    )
            if not self.store.check([keys.resumed(gen, f.rank)]):
                return (
                    f"rank {f.rank} {what} before it began training (generation {gen}; {said})"
                    f" — a script error, not a hardware failure: the job stops.\n"
                    f"{f.traceback_tail()}\n({where})"
                )
            if any(d.code is not None and d.code < 0 for d in dead):
                # A rank died by a signal in this failure (a crash, or a fault injected):
                # the exceptions beside it are its peers' broken collectives, whose
                # place repeats at every such crash — not a script error looping.
                continue
            sig = f.signature()
            if sig in self._signatures:
                # What the earlier recovery was, now that it is known: the same error.
                for rec in self.records:
                    if rec.generation == self._signatures[sig]:
                        rec.cause = (
                            f"a script error ({f.error['exception'] if f.error else 'exit'}), "
                            f"raised again at the same place in generation {gen}"
                        )
                # (its traceback was on the console when it first came: not again)
                return (
                    f"rank {f.rank} {what} again at the same place, as before a recovery "
                    f"(generation {gen}; {said}) — the job stops instead of looping ({where})"
                )
            self._signatures.setdefault(sig, gen)
        return None

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

    def _notices(self, store, every_s: float = 1.0) -> None:
        """Node 0: the trainers' console lines (a check switched off...), each once,
        looked for once a second (the store's load stays flat)."""
        now = time.time()
        if self.cfg.node_rank != 0 or now - self._notices_at < every_s:
            return
        self._notices_at = now
        try:
            n = int(store.add(keys.NOTICES, 0))
            while self._notices_seen < n:
                key = keys.notice(self._notices_seen)
                if not store.check([key]):
                    return  # counted before set by a racing trainer: next time
                text = store.get(key).decode()
                # Where the checks stand is information; anything else a trainer says
                # here (a check switched off) is a warning.
                (log.info if text.startswith("checks:") else log.warning)("%s", text)
                self._notices_seen += 1
        except Exception:  # noqa: BLE001 - a notice must never stop the job
            return

    def _unfired(self) -> list[dict]:
        """The fault plan's entries that never struck: a fired entry ends its generation
        in a failure, so an entry of a generation no recovery record names did not."""
        failed = {r.generation for r in self.records}
        return [f for f in self.faults if f["generation"] not in failed]

    def _no_loss(self) -> int:
        if self.store is None:
            return 0
        try:
            return int(self.store.add(keys.NO_LOSS, 0))
        except Exception:  # noqa: BLE001 - the store may be gone at a stop; only a notice
            return 0

    def _iterations(self, last_gen: int) -> int | None:
        """Iterations the first local rank's trainers began (their last pace), or None."""
        if self.store is None or not self.cells:
            return None
        try:
            for g in range(last_gen, -1, -1):
                k = keys.pace(g, self.cells[0].rank)
                if self.store.check([k]):
                    return int(json.loads(self.store.get(k))["iteration"]) + 1
        except Exception:  # noqa: BLE001 - the store may be gone at a stop; only a figure
            return None
        return None

    def _unprotected(self, last_gen: int) -> list[int]:
        """The local ranks none of whose trainers reached ``leto.Run``'s resume in any
        generation: their state was never retained (a script without ``leto.init()`` and
        ``leto.Run``, or one that never got that far)."""
        if self.store is None:
            return []
        try:
            return [
                cl.rank for cl in self.cells
                if not any(self.store.check([keys.resumed(g, cl.rank)]) for g in range(last_gen + 1))
            ]  # fmt: skip
        except Exception:  # noqa: BLE001 - the store may be gone at a stop; only a notice
            return []

    def summary(self, last_gen: int) -> dict:
        if self.store is not None:
            self._notices(self.store, every_s=0.0)  # any the loop had no time to show
        return {
            "measured": (
                self.monitor.ettr(self._iterations(last_gen))
                if self.monitor is not None
                else {"ettr": None}
            ),
            "config": asdict(self.cfg),
            "generations": last_gen + 1,
            "failures": len(self.records),
            "shadow_restarts": self.shadows.restarts if self.shadows else 0,
            # Why the job stopped early, or None: a script error, a repeated fatal failure,
            # --max-failures, or the signal's name ("SIGTERM", "SIGINT").
            "stopped": self.stopped,
            # This node's devices the checks named twice as computing wrong.
            "faulty": self.tally.faulty() if self.tally is not None else [],
            "fenced": self.fenced,  # ranks whose live trainers were fenced at the stop
            "recoveries": [r.as_dict() for r in self.records],
            "pools": self.pools,
            "preinit": self.shadows.summary() if self.shadows else None,
            # of the parked shadows now (None: none fits)
            "shadow_level": self.shadows.level if self.shadows else None,
            # This agent's load on the job's TCPStore (every request it made).
            # Trainers that committed iterations without run.record_loss under --verify.
            "no_loss_ranks": self._no_loss(),
            # Fault-plan entries whose generation ended without a failure (node 0 says so).
            "unfired_faults": self._unfired(),
            # Local ranks whose state was never retained (the script never reached leto.Run).
            "unprotected_ranks": self._unprotected(last_gen),
            "store_requests": self.store.requests if self.store is not None else 0,
            "store_requests_per_s": self.store.rate() if self.store is not None else 0.0,
        }
