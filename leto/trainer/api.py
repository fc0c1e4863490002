"""``leto.init()``: what a training script calls first under ``leto run``.

Runs in a trainer process. An active trainer initializes at once; a shadow trainer
initializes up to its level and parks here until its agent promotes it:

* L1 — process started, torch imported, the script loaded up to this call;
* L2 — + the device runtime (CUDA context and cuBLAS handles on a GPU), the user's
  ``prepare()`` (e.g. the model skeleton on the meta device) and ``warmup(device)``
  (the script's step on a small stand-in: ``leto.trainer.warmup``);
* L3 — + its process group, formed with the other ranks' shadows of its generation.

At every level it imports ahead what a promoted trainer would import lazily
(``leto.trainer.imports``: torch's, Leto's, and what its rank's trainers published).

On promotion it completes what its level deferred, connects to its rank's pool (taking
it over: the state manager fences any trainer still holding it), localizes lost pages
and returns. The caller then retains its model (``RetainedTraining``) and resumes.

Not covered: elastic world sizes (a generation has the same ranks as the last).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from leto import plugins, rank_log
from leto.errors import (
    InvalidInput,
)
from leto.job import keys
from leto.job import store as job_store
from leto.job.config import (
    TrainerEnv,
)
from leto.memory.client import PoolClient
from leto.trainer import imports as ahead_imports
from leto.trainer import run_ahead, skip_init, staging, truncation
from leto.trainer.exit_hook import record_uncaught
from leto.trainer.first_iteration import Pace, StageClock
from leto.trainer.premap import Premap
from leto.trainer.warmup import generic_step, warm_tools, warm_up


@dataclass
class Context:
    role: str  # "active" (started as the trainer) or "promoted" (was a shadow)
    rank: int
    world_size: int
    local_rank: int
    generation: int
    level: str
    device: torch.device
    pool: PoolClient
    # The pool's localization report (lost pages, pending rebuilds): ``report``, which
    # completes a deferred one first.
    localization: dict
    prepared: object = None
    timings: dict = field(default_factory=dict)
    store: dist.Store | None = None
    profiles: object = None  # leto.trainer.profiling.Profiles (LETO_PROFILE_RECOVERY)
    guard: object = None  # preinit.guard.Guard under --shadow-level auto (made at first beat)
    env: TrainerEnv | None = None  # what leto run told this process
    # The generation whose warming counter this process raised at its first beat (None:
    # not yet; -1: lowered again, its first iteration is over).
    warming_gen: int | None = None
    # Issue 37: the modules this process imports until its first iteration is over
    # (leto.trainer.imports.ImportWatch; None once it is), and the recovery record
    # ``resumed`` sent, which then gets the promoted trainer's ``promoted_imports``.
    imports: object = None
    resumed_record: dict | None = None
    # Stage times to the end of the first iteration (``leto.trainer.first_iteration``),
    # and this generation's pace, written with every beat for the next one's figures.
    clock: StageClock | None = None
    pace: Pace = field(default_factory=Pace)
    # leto.trainer.skip_init's mode while the script builds its model (None: off).
    skip_init: object = None
    # leto.trainer.run_ahead's Ahead while a parked shadow runs the script's set-up ahead
    # of its promotion (None: promoted, or never ran ahead).
    ahead: object = None

    def await_promotion(self, what: str) -> None:
        """A shadow running the set-up ahead reached ``what``: wait for the promotion."""
        if self.ahead is not None:
            self.ahead.reach(what)

    def resume_observing(self) -> None:
        """After ``leto.Run``: an active trainer's observation of the script's set-up
        goes on to the loop's start."""
        if self.skip_init is not None and self.skip_init.observe:
            skip_init.resume(self.skip_init)

    def end_skip_init(self, observed_too: bool = True) -> None:
        """The model is built: parameter writes run again (``leto.Run``, else the first
        heartbeat). An active trainer's observation runs on to the loop's start
        (``observed_too``): a draw between ``leto.Run`` and the loop counts too. The rank
        log says what was skipped, or what was observed."""
        truncation.stop()
        mode = self.skip_init
        if mode is None:
            return
        if mode.observe and not observed_too:
            # leto.Run's own binding is not the script's set-up: not watched (its
            # checks' sampling would read as the script's draws), resumed after it.
            skip_init.stop(mode)
            return
        self.skip_init = None
        skip_init.stop(mode)
        if mode.observe:
            verdict = skip_init.publish(self.store, self.rank, mode)
            rank_log.say(
                self.rank,
                "model set-up observed: a promoted trainer may skip its initialization"
                if verdict == skip_init.SAFE
                else f"model set-up observed: a promoted trainer initializes it as written "
                f"({verdict})",
            )
            return
        rank_log.say(
            self.rank,
            f"model set-up: {mode.skipped} write(s) to parameters skipped and "
            f"{mode.moved} parameter(s) moved without their values — the retained "
            f"state supplies them ({skip_init.ENV_SKIP_INIT}=0 runs them)",
        )

    @property
    def report(self) -> dict:
        """The localization report, complete. A premapped trainer's host parity scan,
        left running in the state manager at promotion, is awaited here — at the first
        use, leto.Run's resume, after the retained state is bound (issue 17: off the
        path of mapping and binding)."""
        if self.pool.localizing:
            t0 = time.time()
            report = self.pool.settle_localize()
            self.timings.update(
                localize_parity_s=report["parity_s"],
                localize_parity_wait_s=time.time() - t0,
                localize_seconds=report["seconds"],
                # LOCALIZE_PARITY: the scan overlapped the binding; another request:
                # that request could not wait for it (the overlap was cut short there).
                localize_parity_landed_by=report["parity_landed_by"],
                remapped_pages=self.pool.remapped,  # with the parity pages it replaced
            )
        return self.localization

    @property
    def checkpoint_dir(self) -> str | None:
        return self.env.checkpoint_dir

    def checkpointer(self, next_iteration: int = 0):
        """Asynchronous DCP saves at the configured (or Young's) interval; a trainer of a
        later generation continues the schedule at ``next_iteration``."""
        from leto.trainer.checkpoint import Checkpointer

        if self.checkpoint_dir is None:
            return None
        return Checkpointer(
            self.checkpoint_dir,
            self.rank,
            interval=self.env.checkpoint_interval or None,
            mttf_s=self.env.mttf_s,
            hof_ratio=self.env.hof_ratio,
            joining_at=next_iteration if self.generation > 0 else None,
            store=self.store,
        )

    def heartbeat(self, iteration: int | str) -> None:
        """Progress for the agent's hang detection: the iteration, once per iteration;
        ``"done"`` when the loop is over (the final barrier and checkpoint flush are then
        held to the general timeout, not the hang timeout, as is every trainer's first
        iteration in its process). Under ``--shadow-level auto``
        the preinitialization guard reports first (memory, reclamations)."""
        self.await_promotion("began its loop")  # (a loop without leto.Run, run ahead)
        self.end_skip_init()  # (a loop without leto.Run: it ends here at the latest)
        if iteration != "done" and self.env.preinit:
            self._guard().beat()
        if iteration == "done":
            self.loop_ended()  # (leto.Run has closed it already, before its end checks)
        elif self.profiles is not None:
            if change := self.profiles.beat():
                self.store.add(keys.warming(self.generation), change)
        if iteration != "done":
            self.store.set(keys.pace(self.generation, self.rank), self.pace.began(iteration))
        # The first iteration of a process (torch.compile, cuDNN autotuning, lazy
        # allocations) may take far longer than a steady one: while any trainer is in
        # its first, the agent holds every rank to the general timeout, since its peers
        # wait for it in collectives. Counted in the store, so no agent needs to have
        # seen a particular beat.
        if self.warming_gen is None and iteration != "done":
            self.warming_gen = self.generation
            self.store.add(keys.warming(self.generation), 1)
        elif self.warming_gen not in (None, -1):
            self.store.add(keys.warming(self.warming_gen), -1)
            self.warming_gen = -1
            self.first_iteration_over()
        self.store.set(keys.beat(self.generation, self.rank), str(iteration))

    def loop_ended(self) -> None:
        """The training loop is over (before its end-of-training checks): a profile
        window open over the last iteration closes here."""
        if self.profiles is not None:
            if change := self.profiles.loop_ended():
                self.store.add(keys.warming(self.generation), change)
        self.first_iteration_over()  # (the loop's only iteration: before the final checks)

    def first_iteration_over(self) -> None:
        """The first iteration of this process is committed (the next one's beat, or the
        loop's end): what it imported since ``leto.init()`` began (active) or since its
        promotion is published for the next shadows to import ahead, and a promoted
        trainer's recovery record gets ``promoted_imports`` (each outermost import:
        module, seconds, modules it brought in) and ``promoted_imports_s`` — empty and 0
        when its shadow had imported everything ahead (issue 37)."""
        watch, self.imports = self.imports, None
        if watch is None:
            return
        got = watch.stop()
        ahead_imports.publish(self.store, self.rank, got)
        # Where this process's way to the end of its first iteration went (rank log).
        first = self.clock.close() if self.clock is not None else {}
        if self.profiles is not None:
            self.profiles.recovery_done()
        if self.generation > 0 and self.resumed_record is not None:
            # A promoted or restarted trainer: what it still imported, and those stages
            # (the agent's recovery figures).
            self.resumed_record.update(
                promoted_imports=got, promoted_imports_s=sum(r["s"] for r in got), **first
            )
            key = keys.resumed(self.generation, self.rank)
            self.store.set(key, json.dumps(self.resumed_record))

    def _guard(self):
        if self.guard is None:
            # Made at the first beat, not in init: the hook's build and load stay off the
            # recovery path.
            from leto.preinit.guard import Guard, GuardConfig

            cfg = GuardConfig.from_json(self.env.preinit)
            self.guard = Guard(self.store, self.rank, self.generation, self.device, cfg)
        return self.guard

    def device_free_bytes(self) -> int:
        """Free device memory as the preinitialization hook sees it: cudaMemGetInfo, or
        the emulated device's on CPU (``--device-memory-bytes``)."""
        if self.env.preinit:
            return self._guard().free_bytes()
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        raise InvalidInput(
            "a CPU run has no device memory to measure; give leto run --shadow-level auto "
            "--device-memory-bytes N for an emulated device"
        )

    def wait_shadow_parked(self, timeout_s: float, other_than: int | None = None) -> dict | None:
        """Block until the next generation's shadow of this rank has parked (its pid and
        level), or ``timeout_s`` passed (None: shadows are off or none fits). With
        ``other_than`` (a pid), only a different shadow counts: the one the agent
        relaunched after that one was reclaimed."""
        from leto.preinit.guard import parked_key

        key = parked_key(self.generation + 1, self.rank)
        # (held back until this generation's second iteration otherwise: start_due)
        self.store.set(keys.shadows_wanted(self.generation), "1")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.store.check([key]):
                parked = json.loads(self.store.get(key))
                if parked["pid"] != other_than:
                    return parked
            time.sleep(0.05)
        return None

    def wait_successors_parked(self, timeout_s: float) -> bool:
        """Block until every rank's shadow of the next generation has parked, or
        ``timeout_s`` passed (False): a fault plan's ``when: parked`` waits here (the
        agent deletes a replaced shadow's record before it starts the new one). Where
        they run the script's set-up ahead (L3), also until each has run it to where it
        waits for its promotion, or found it will not: what a failure meets in a job that
        has run a while. (Not in this process's first iteration: a shadow runs ahead only
        once its trainer has finished one.)"""
        from leto.preinit.guard import parked_key
        from leto.trainer import run_ahead

        parked = [parked_key(self.generation + 1, r) for r in range(self.world_size)]
        settled = [keys.ahead_settled(self.generation + 1, r) for r in range(self.world_size)]
        # The agent holds the successors back until this generation's second iteration
        # (leto.launch.shadows.start_due), which a trainer waiting here never reaches.
        self.store.set(keys.shadows_wanted(self.generation), "1")
        deadline = time.monotonic() + timeout_s
        want = parked
        while time.monotonic() < deadline:
            if self.store.check(want):
                if want is settled:
                    return True
                # Their level is in their records (this trainer's own is "off" where it
                # started cold).
                levels = {json.loads(self.store.get(k)).get("level") for k in parked}
                if not (all(run_ahead.wanted(v) for v in levels) and self.pace.done >= 1):
                    return True
                want = settled
                continue
            time.sleep(0.05)
        return False

    def resumed(self, next_iteration: int, **timings: float) -> None:
        """Tell the agent this rank trains again (the recovery record's last step)."""
        rec = {**self.timings, **timings, "next_iteration": next_iteration, "time": time.time()}
        rec["role"] = self.role
        key = keys.resumed(self.generation, self.rank)
        self.store.set(key, json.dumps(rec))
        self.resumed_record = rec  # (completed when the first iteration is over)


def warm_device(device: torch.device) -> None:
    """A trainer's (or an L2/L3 shadow's) device step: the CUDA context and what Leto's
    first update after a promotion needs loaded. ``bench/preinit_footprint.py``'s
    stand-in shadows run it too, so the levels' measured footprints include it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        a = torch.ones(8, 8, device=device)
        (a @ a).sum().item()  # context and cuBLAS handle
        # Leto's codec kernels (CuPy import, module load: 0.28 s on the H200), which the
        # first update after a promotion needs.
        from leto.erasure.kernels import for_device

        for_device(device)
        # The fused chunk pass's module and its self-check against torch's fused AdamW.
        from leto.update.chunk_pass import self_check

        self_check(device)
        # The lending allocator (its C library loaded) and the library workspaces its
        # first lend creates outside the pool (0.1 s of a promoted trainer's first
        # iteration on the H200, fifteenth session's profile).
        from leto.memory import lending

        try:
            lending.load_library()
        except Exception as e:  # no C compiler: the first Lender says so, by name
            print(f"lending allocator not preloaded ({e})", file=sys.stderr, flush=True)
        lending.warm_workspaces(device)


class _Pipe:
    """A shadow's promotion pipe from its agent."""

    def __init__(self, fd: int):
        self.f = os.fdopen(fd, "r")

    def waiting(self) -> bool:
        """Whether the agent's line is there to read (a promotion), without blocking."""
        import select

        return self.f is None or bool(select.select([self.f], [], [], 0)[0])

    def park(self, tick=None, every_s: float = 0.5, until=None) -> dict | None:
        """Block until the agent writes one JSON line, calling ``tick()`` every
        ``every_s`` meanwhile (the premapping); None as soon as ``until()`` holds (the
        shadow runs the script's set-up ahead, ``leto.trainer.run_ahead``). EOF means
        the agent no longer wants this shadow (it stopped, or the job ended): exit
        quietly. (No timeout: a shadow parks as long as its trainer trains; the agent
        ends it by closing the pipe.)"""
        import select

        # ``until`` is polled more often than the tick (a few store reads, where the tick
        # premaps): a short job's iterations may all end between two ticks.
        poll_s = every_s if until is None else min(every_s, 0.2)
        last = time.monotonic()
        while tick is not None and not select.select([self.f], [], [], poll_s)[0]:
            if time.monotonic() - last >= every_s:
                tick()
                last = time.monotonic()
            if until is not None and until():
                return None
        line = self.f.readline()
        self.f.close()
        self.f = None
        if not line:
            os._exit(0) if run_ahead.running() else sys.exit(0)
        return json.loads(line)


def placement(
    device: str, local_rank: int, ranks_per_gpu: int, gpus: int
) -> tuple[torch.device, str]:
    """A trainer's device and process-group backend: on the CPU gloo; on a GPU its own
    with NCCL, or with ``leto run --ranks-per-gpu N`` (testing on fewer GPUs than ranks)
    the GPU of local ranks ``N*g .. N*g+N-1`` shared over gloo — NCCL refuses two ranks on
    one GPU, gloo takes CUDA tensors for what data parallelism needs."""
    if device != "cuda":
        return torch.device("cpu"), "gloo"
    gpu = torch.device("cuda", (local_rank // ranks_per_gpu) % gpus)
    return gpu, "nccl" if ranks_per_gpu == 1 else "gloo"


def init(prepare=None, warmup=None) -> Context:
    try:
        env = TrainerEnv.from_environ()
    except ValueError as e:
        raise InvalidInput(f"leto.init(): {e}") from None
    t0 = time.time()
    # What this trainer imports until its first iteration is over, for its rank's next
    # shadows to import ahead (a shadow watches from its promotion instead).
    watch = ahead_imports.ImportWatch().start() if env.role != "shadow" else None
    record_uncaught(env.error_file)
    plugins.load()  # the tools named in LETO_PLUGINS (faultkit for a faulted job)
    timeout_s = env.timeout_s
    rank, world, local_rank = env.rank, env.world_size, env.local_rank
    generation, level, role = env.generation, env.level, env.role
    if env.device == "cuda":
        # Deterministic cuBLAS needs its workspace fixed before the first handle.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device, backend = placement(
        env.device, local_rank, env.ranks_per_gpu,
        torch.cuda.device_count() if env.device == "cuda" else 0,
    )  # fmt: skip
    store = job_store.connect(env.master_addr, env.master_port, False, timeout_s)
    done: set[str] = set()
    prepared = None
    profiles = None
    if env.profile_recovery:
        from leto.trainer.profiling import Profiles

        profiles = Profiles(
            env.profile_recovery, rank, generation, device, window=env.profile_window
        )

    def profile_recovery() -> None:
        if profiles is not None:
            profiles.start_recovery()

    def step(name: str) -> None:
        nonlocal prepared
        if name == "device":
            warm_device(device)
        elif name == "prepare":
            prepared = prepare() if prepare is not None else None
        elif name == "pg":
            dist.init_process_group(
                backend,
                store=job_store.pg_store(store, generation, env.pg_attempt),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
                # NCCL creates its communicator at the first collective unless given the
                # device: eagerly, an L3 shadow parks with it built (0.35 s on the H200).
                device_id=device if backend == "nccl" else None,
            )
        done.add(name)

    order = ("device", "prepare", "pg")
    timings: dict[str, float] = {}
    premap = None
    msg = None  # the agent's promotion line (a shadow's)

    def attach_localize() -> tuple[PoolClient, dict]:
        t_pool = time.time()
        client = premap.promote() if premap else None
        if client is None:
            client = PoolClient.connect(
                env.pool_socket, env.pool_token, takeover=True, timeout_s=timeout_s,
                starting=generation == 0,  # (its state manager may still be starting)
            )  # fmt: skip
            if client.waited_s:
                # The state manager's start on this trainer's way (leto run starts them
                # together): part of its ``init`` stage, said apart.
                timings["pool_wait_s"] = client.waited_s
                rank_log.say(rank, f"waited {client.waited_s:.3f} s for its state manager to "
                             "listen (started beside this trainer)")  # fmt: skip
        t_localize = time.time()
        # A premapped client maps again what was replaced, and leaves the host parity
        # scan running until its report is first read (Context.report).
        report = client.localize(defer_parity=client.premapped)
        timings["attach_localize_s"] = time.time() - t_pool
        # Its parts: attach (premapped: the last premap call and the takeover), then
        # the state manager's scan of every page (of which data and parity) and the
        # remap here.
        timings["attach_s"] = t_localize - t_pool
        timings["localize_s"] = time.time() - t_localize
        timings.update(
            {f"localize_{k}": report[k] for k in ("seconds", "data_s", "parity_s") if k in report}
        )
        return client, report

    def promoted(msg: dict | None):
        """The rest of a promotion (``msg``: the agent's line; None for an active
        trainer): what the level deferred, the pool taken over and localized."""
        nonlocal watch
        if msg is not None:
            timings["promoted_at"] = time.time()
            if device.type == "cuda":
                # (a shadow running the set-up ahead may be promoted on a thread of the
                # script's, where another device is current)
                torch.cuda.set_device(device)
            profile_recovery()
            if timings["imports_learned"] < 0:
                # Promoted before it saw what its trainer published: imported now, on the
                # recovery's path (as the promoted trainer would), and the record says so.
                timings["imports_learned_late"] = ahead_imports.import_learned(
                    store, rank, device, timings
                )
            watch = ahead_imports.ImportWatch().start()
            if msg.get("fault_at"):
                when = msg.get("fault_when", "now")
                plugins.arm(msg["fault_at"], msg.get("fault_mode", "kill"), when)
        client = report = None
        if premap is not None and premap.client is not None:
            # Premapped (the device is up): take the pool over and localize before the
            # deferred steps, so the host parity scan also runs under them (an L2 shadow's
            # process group: 0.35 s at 1 B on the H200).
            client, report = attach_localize()
        t_deferred = time.time()
        for name in order:
            if name not in done:
                step(name)
        timings["deferred_init_s"] = time.time() - t_deferred
        if report is None:  # cold: the deferred steps bring the device up first
            client, report = attach_localize()
        if premap:
            timings.update(premap.summary(), remapped_pages=client.remapped)
        clock = StageClock(rank, device, timings.get("promoted_at", t0))
        if msg is not None:  # the script's set-up again: a log it empties is said
            truncation.watch(rank)
        return client, report, watch, clock

    if role == "shadow":
        ahead = {"L1": 0, "L2": 2, "L3": 3}[level]
        for name in order[:ahead]:
            step(name)
        if ahead >= 2:  # with the device runtime up
            # The script's own step, or — for a plain script that gives none — a generic
            # one (LETO_GENERIC_WARMUP=0: none; benchmarks compare both).
            if warmup is None and os.environ.get("LETO_GENERIC_WARMUP", "1") != "0":
                warmup = generic_step
            if warmup is not None:
                timings.update(warm_up(warmup, device, rank))
            timings.update(warm_tools(device, rank))
        # What the script calls once promoted (leto.Run: the runtime's trainer side,
        # imported lazily by ``leto``): imported now, not on the recovery path (0.07 s at
        # a promotion on the H200, compiling where no bytecode was cached).
        import leto.trainer.run  # noqa: F401

        # What a promoted trainer would import lazily (issue 37: torch._dynamo behind the
        # script's optimizer, 3.65 s of a 3.87 s recovery on 2 CPU cores): imported now,
        # the RNG states kept; what the active trainer publishes later, while parked.
        timings.update(ahead_imports.warm_imports(store, rank, device))
        timings["parked_after_s"] = time.time() - t0
        # Tells the active trainer's preinitialization guard whom to reclaim, and when
        # this shadow's memory is all there.
        from leto.preinit.guard import parked_key

        store.set(parked_key(generation, rank), json.dumps({"pid": os.getpid(), "level": level}))
        if env.premap and level in ("L2", "L3"):  # with the device runtime up
            premap = Premap(env.pool_socket, env.pool_token, timeout_s, rank)
            premap.tick()

        def tick() -> None:
            if premap is not None:
                premap.tick()
            ahead_imports.import_learned(store, rank, device, timings)
            if ahead >= 2:  # with the device runtime up: the checkpoint's host buffers
                said = staging.make_ahead(store, rank, device)
                if said:
                    rank_log.say(rank, said)

        pipe = _Pipe(env.promote_fd)
        gate = None
        if run_ahead.wanted(level):
            gate = run_ahead.Gate(
                store, generation, env.pg_attempt, rank, world, device,
                lambda: premap.client.mapped_bytes() if premap and premap.client else None,
            )  # fmt: skip
        msg = pipe.park(tick, until=gate.open if gate is not None else None)
        if msg is None:
            # The script's set-up runs ahead from here; its first step that could change
            # something outside this process (leto.Run at best) waits for the promotion.
            ctx = Context(
                role="promoted", rank=rank, world_size=world, local_rank=local_rank,
                generation=generation, level=level, device=device, pool=None,
                localization={}, prepared=prepared, timings=timings, store=store,
                profiles=profiles, env=env,
            )  # fmt: skip

            def promote() -> None:
                got = promoted(pipe.park(tick))
                ctx.pool, ctx.localization, ctx.imports, ctx.clock = got
                ctx.timings.update(
                    ran_ahead_to=runner.stopped_at, ran_ahead_s=runner.ran_s,
                    ran_ahead_collectives=runner.collectives, **runner.warmup,
                )  # fmt: skip
                made = (f" ({runner.collectives} collective(s) made with the other ranks' "
                        "shadows)" if runner.collectives else "")  # fmt: skip
                rank_log.say(
                    rank,
                    f"shadow: ran the script's set-up ahead in {runner.ran_s:.2f} s{made}, to "
                    f"where it {runner.stopped_at}; promoted",
                )
                ctx.clock.mark("init")

            runner = run_ahead.Ahead(
                rank, promote, store, device, pipe.waiting, world=world, key=gate.key,
                settled_key=keys.ahead_settled(generation, rank),
            )  # fmt: skip
            ctx.ahead = runner
            ctx.skip_init = skip_init.start(store, generation, rank)
            rank_log.say(rank, "shadow: running the script's set-up ahead of a promotion")
            runner.start()
            _install_parked_wait(ctx)
            return ctx
    elif generation > 0 or env.profile_start:
        # A trainer restarted cold, or (LETO_PROFILE_START=1) a fresh start's way to its
        # first iteration: the kernels' builds, the pool's first pages.
        profile_recovery()

    client, report, watch, clock = promoted(msg)
    # The script's model set-up from here to leto.Run: parameters the retained state
    # overwrites are not initialized (a promoted trainer whose pool holds its state).
    # (an active trainer observes the same set-up: may its promoted trainers skip it?)
    skip = skip_init.start(store, generation, rank) if role == "shadow" else skip_init.observe()
    clock.mark("init")
    ctx = Context(
        role="promoted" if role == "shadow" else "active",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        generation=generation,
        level=level,
        device=device,
        pool=client,
        localization=report,
        prepared=prepared,
        timings=timings,
        store=store,
        profiles=profiles,
        env=env,
        imports=watch,
        clock=clock,
        skip_init=skip,
    )
    _install_parked_wait(ctx)
    return ctx


def _install_parked_wait(ctx: Context) -> None:
    """What a fault plan's ``when: parked`` waits for (``leto.plugins.wait_parked``):
    every rank's next shadow parked, within half the hang limit (the agent must not take
    the waiting trainer for a hung one: the planned fault strikes, late, instead)."""
    limit = min(ctx.env.timeout_s, ctx.env.hang_timeout_s / 2)
    plugins.install_parked_wait(lambda: ctx.wait_successors_parked(limit))
