"""``leto.Run``: a script's own model, optimizer and LR scheduler under Leto.

Runs in a trainer (active, or a promoted shadow), after ``leto.init()``. The script
keeps its objects and its loop; Leto takes over what survives a failure::

    ctx = leto.init(prepare=build_model)           # a shadow parks in here
    model = ctx.prepared or build_model()
    optimizer = torch.optim.AdamW(groups, lr=6e-4, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    run = leto.Run(ctx, model, optimizer, scheduler)   # retains, resumes
    for it in run.iterations(max_iters):          # starts where the job left off
        loss = model(x, y); loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()                          # Leto's crash-consistent update
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

What Leto does with them:

* the model's parameters become views of retained pool memory (tied parameters once,
  under every name; frozen ones retained, never updated; buffers on the meta device
  refused by name; running statistics retained with the data records,
  ``leto.trainer.buffer_state``); gradients accumulate in retained memory and are
  reduced across data-parallel ranks in buckets while backward runs, averaged by the
  time ``backward()`` returns (as DDP: do not wrap the model in DDP);
* on a fresh pool the parameters take the model's own initial values (or ``init()``
  for a model built on the meta device), checked identical on every rank;
* ``optimizer.step()`` runs the optimizer's own arithmetic as Leto's resumable update
  (``leto.update.user_optim``), its hyperparameters read at that moment;
  ``optimizer.zero_grad()`` and ``model.zero_grad()`` zero the retained gradients in
  place; ``optimizer.state_dict()`` reports the retained state;
* the scheduler's state, each group's hyperparameters and ``run.state`` (the script's
  small state, e.g. the best validation loss) are retained per iteration
  (``leto.update.loop_record``), so a recovery resumes the loop exactly — this assumes
  one ``scheduler.step()`` after each ``optimizer.step()``, which is checked; so is the
  position of a stateful data loader given as ``data=`` (``leto.trainer.data_state``);
* ``run.model`` is the model shaped like the DDP object it replaces (``no_sync()``,
  ``require_backward_grad_sync``, ``.module``: ``leto.trainer.ddp_shape``);
* heartbeats, the checkpoint fallback, fault points (``compute.forward`` /
  ``compute.backward`` fire around the model's forward) and verification
  (``leto run --verify``) are the runtime's.

Code after ``optimizer.step()`` of an iteration a failure interrupted is not run again
(the loop resumes at the next iteration): evaluate at the top of the loop.

A ``torch.amp.GradScaler`` (fp16) given as ``scaler=``: a step it skips commits nothing
and the scale is retained per iteration.

Not covered: closures, parameters that get no
gradient in an iteration (torch skips them; Leto updates them with a zero gradient).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from leto import plugins, rank_log
from leto.errors import InvalidInput
from leto.integrity import replay
from leto.integrity.scrub import REQUEST_FILE as SCRUB_REQUEST
from leto.job import fault_plan, keys
from leto.job.config import ENV_FAULT_PLAN
from leto.plugins import point
from leto.ranges import leto_range
from leto.trainer import (
    checks_line,
    data_state,
    megatron,
    megatron_scaler,
    shape_warmup,
    shared_gpu,
)
from leto.trainer.batch_fn import BatchFunctions
from leto.trainer.buffer_state import RetainedBuffers
from leto.trainer.ddp_shape import DDPShaped
from leto.trainer.exit_hook import uncaught
from leto.trainer.loop_state import LoopState
from leto.trainer.retained import RetainedTraining
from leto.trainer.rng_state import GlobalRNG
from leto.update import grad_clip
from leto.update.rmu import UpdaterConfig
from leto.update.user_optim import UserOptimizer


class Run:
    def __init__(
        self,
        ctx,
        model: torch.nn.Module,
        optimizer,
        scheduler=None,
        *,
        init=None,
        scaler=None,
        start_iteration: int = 0,
        out: str | Path | None = None,
        zero1: bool = False,
        chunk_units: int | None = None,
        bucket_mib: float = 25.0,
        data_parallel: bool = True,
        data=None,
    ):
        """``ctx``: what ``leto.init()`` returned. ``model``: the script's model (or, for
        Megatron's interleaved pipeline schedule, its list of Megatron DDP model chunks,
        which ``run.model`` is then). ``optimizer``: the script's optimizer,
        or a list of them (e.g. Muon for the 2-D weights and AdamW for the rest; the update
        runs once all have stepped); ``scheduler``: None, one or a list; ``scaler``: the
        script's ``torch.amp.GradScaler`` (fp16: a step it skips commits nothing, and its
        scale is retained with the loop). ``start_iteration``: where a fresh job starts
        (the script's own checkpoint: load the model, optimizer and scheduler states
        before ``leto.Run``; they are retained then). ``init()``: fills the parameters on a
        fresh pool when the model was built on the meta device (otherwise the model's
        own initial values are retained). ``out``: the loss log (and, with ``--verify``,
        the verifiers' trace); default ``$LETO_TRAIN_DIR``, else ``<--log-dir>/train``.
        ``data_parallel=False``: this rank's parameters are its own — a pipeline stage
        (``torch.distributed.pipelining``) — so Leto reduces no gradients across ranks
        and does not check that ranks start alike. (FSDP2 and tensor-parallel models are
        recognized by their DTensor parameters and reduce their own gradients.)
        ``data``: a stateful data loader or sampler (``state_dict``/``load_state_dict``,
        e.g. torchdata's ``StatefulDataLoader``), or a list of them: its position is
        retained per iteration and restored on a recovery (iterate it after
        ``leto.Run``)."""
        if getattr(ctx, "ahead", None) is not None:
            ctx.await_promotion("reached leto.Run")  # a shadow that ran the set-up ahead
        t0 = time.time()
        if hasattr(ctx, "end_skip_init"):
            ctx.end_skip_init(observed_too=False)  # before anything here reads the model
        self._clock = getattr(ctx, "clock", None)  # stage times to the first iteration's end
        self._mark("script set-up")
        self.optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        # Megatron's own DDP and optimizer: Leto runs the torch optimizers inside Megatron's
        # (Megatron reduces, takes the norm and clips; Leto's update is their step()).
        megatron_optimizers = self.optimizers
        self.optimizers, self._megatron_ddp = megatron.adopt(model, self.optimizers)
        given = model  # (Megatron's interleaved schedule: a list of model chunks)
        if isinstance(model, (list, tuple)):
            chunks = list(model)
            model = torch.nn.ModuleList(chunks) if len(chunks) > 1 else chunks[0]
        else:
            chunks = [model]
        # (the script's word: data_parallel=False is a pipeline stage)
        stage = not data_parallel
        # Megatron-Core's parallel state: replicas or shards; what is not supported yet.
        data_parallel, dp = megatron.check(
            model, self.optimizers, data_parallel, self._megatron_ddp
        )
        # What Leto retains: the model's parameters, or the fp32 main copies Megatron's
        # optimizer keeps apart from them (its Float16 optimizer's; its
        # DistributedOptimizer's shards, each rank its own: nothing replicated to reduce
        # or compare). The model's parameters are then their cast.
        self._main_copies = self._megatron_ddp is not None and megatron.main_copies(
            megatron_optimizers
        )
        retained = model
        if self._main_copies:
            megatron.unrestored(model, getattr(ctx, "skip_init", None))
            retained = megatron.MainShards(self.optimizers)
            self._megatron_optimizers = megatron_optimizers
            if megatron.distributed(self._megatron_ddp):
                data_parallel, dp = False, None
        backend = dist.get_backend() if dist.is_initialized() else None
        # A pipeline stage's first send would hand gloo a CUDA address (issue 47);
        # Megatron's DDP reduces and gathers coalesced, which gloo carries for CPU tensors
        # only. (Not what Megatron's tensor-parallel shards are: their collectives pass.)
        stages = megatron.pipeline_stages()
        if stages is not None:
            split = (
                "megatron-pp" if stages > 1
                else "megatron-ddp" if self._megatron_ddp is not None
                else None
            )  # fmt: skip
        else:
            split = "pp" if stage else None
        if split and ctx.world_size > 1 and shared_gpu.gloo_on_cuda(ctx.device, backend):
            where = "leto.Run(data_parallel=False)" if split == "pp" else "leto.Run"
            raise InvalidInput(f"{where}: {shared_gpu.refusal(split)}; nothing was retained")
        self.ctx = ctx
        # The data position (data=) and the global generators, retained together.
        self._rng = GlobalRNG(ctx.device)
        self._batches = BatchFunctions(self._rng)  # run.batches()
        # The model's running statistics (BatchNorm's) travel with them.
        self._buffers = RetainedBuffers(model, ctx.device, ctx.world_size)
        data = [
            *(data_state.stateful(data) if data is not None else []),
            self._rng, self._batches, self._buffers,
        ]  # fmt: skip
        extra = self._buffers.record_bytes()
        self.schedulers = (
            [] if scheduler is None
            else list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
        )  # fmt: skip
        # (Megatron's retained alike)
        self.schedulers = megatron.schedulers(self.schedulers, ctx.store, ctx.rank)
        for sc in self.schedulers:
            if not any(
                getattr(sc, "optimizer", None) is o
                for o in [*self.optimizers, *megatron_optimizers]
            ):
                raise InvalidInput("an LR scheduler drives an optimizer that was not given")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise InvalidInput(f"scaler= takes a torch.amp.GradScaler, not {type(scaler).__name__}")
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        if self.scaler is not None:
            self._watch_scaler(self.scaler)
        # Megatron's optimizer with its loss scaler (fp16): its skips and its state, as a
        # GradScaler's (leto.trainer.megatron_scaler).
        if self._megatron_ddp is not None:
            ms = megatron_scaler.of(megatron_optimizers, self._prepared)
            if ms is not None and self.scaler is not None:
                raise InvalidInput(
                    "leto.Run: Megatron's optimizer scales the loss itself (fp16): give no "
                    "scaler= beside it; nothing was retained"
                )
            self.scaler = ms if ms is not None else self.scaler
        names = {id(p): n for n, p in retained.named_parameters()}
        self.user = UserOptimizer(self.optimizers, names)  # refuses what it cannot run, first
        other = [(n, p.dtype) for n, p in retained.named_parameters() if p.dtype != torch.float32]
        if other:
            raise InvalidInput(
                f"parameter {other[0][0]} is {other[0][1]}: under leto.Run parameters are "
                f"float32 (train in bf16 with torch.autocast); nothing was retained"
            )
        on_meta = [n for n, p in retained.named_parameters() if p.device.type == "meta"]
        if on_meta and init is None:
            raise InvalidInput(
                f"parameter {on_meta[0]} is on the meta device and no init= was given: "
                f"Leto cannot know its initial value"
            )
        originals = (
            None if init is not None else {n: p.detach() for n, p in retained.named_parameters()}
        )
        env = ctx.env
        self.out = Path(out or env.train_dir or Path(env.log_dir) / "train")
        self.out.mkdir(parents=True, exist_ok=True)
        steps = max((n for n in self.user.loaded_steps if n is not None), default=0)
        if steps > 0 and start_iteration == 0:
            # The script resumed its own checkpoint but not its loop: the loop would
            # start again at 0 with step-N optimizer state (the LR warm-up replayed) —
            # silently unlike the same script in plain PyTorch.
            raise InvalidInput(
                f"the optimizer was loaded with state of {steps} step(s) taken, and "
                "leto.Run was given start_iteration=0: pass start_iteration= the iteration "
                "your checkpoint ended at (the loop continues there); nothing was retained"
            )
        if self.user.loaded and zero1:
            raise InvalidInput(
                "optimizer state loaded before leto.Run with ZeRO-1 is not supported yet; "
                "nothing was retained"
            )

        def first_values():
            if init is not None:
                init()
            else:
                self._copy_in(originals)
            self._load_optimizer_state()

        # The data records: before the updater maps the pool's groups when they may be
        # among them, else after its allocations (data_state.attach_first).
        self._data = None
        if data_state.attach_first(ctx.localization):
            self._data = data_state.DataState(ctx.pool, data, extra)
        self.job = RetainedTraining(
            ctx.pool,
            retained,
            first_values,
            None,
            ctx.rank,
            ctx.world_size,
            self.out,
            UpdaterConfig(chunk_units=chunk_units, undo=self._undo_mode(ctx)),
            zero1=zero1,
            on_iteration=plugins.iteration_observer(ctx.rank, self.out),
            heartbeat=ctx.heartbeat,
            bucket_mib=bucket_mib if bucket_mib > 0 else math.inf,
            user=self.user,
            scrub_requests=Path(ctx.env.log_dir) / SCRUB_REQUEST if ctx.env else None,
            data_parallel=data_parallel,
            guard_loss=self.scaler is None,  # (fp16: the scaler skips non-finite steps)
            dp=dp,
            external_grads=self._megatron_ddp is not None,
        )
        if self._undo_note is not None:
            self.job.up.undo_note = self._undo_note
        if ctx.store is not None:
            self.job.on_no_loss = lambda: ctx.store.add(keys.NO_LOSS, 1)
            if self.job.up.recheck is not None:
                self.job.up.recheck.on_notice = lambda text: _notice(ctx.store, text)
        self.loop = self.job.loop = self.job.up.loop
        early = self._data is not None
        self._data = self._data or data_state.DataState(ctx.pool, data, extra)
        if self._buffers.broadcast_stats and not (
            (self.job.replicated and self.job.dp.whole_world) or ctx.world_size == 1
        ):
            raise InvalidInput(
                f"buffer {self._buffers.broadcast_stats[0]} holds running statistics in a "
                f"model that is not data parallel over every rank (sharded, tensor or pipeline "
                f"parallel): "
                f"Leto retains them in data-parallel models only; nothing was retained"
            )
        self._data.bind(self.job.up.views if early else None)
        self.job.data = self._data
        # What the script uses where it had DDP(model) (a compiled model inside it is split
        # at the gradient buckets as under DDP: data parallel only).
        self.model = (
            given  # (Megatron's own DDP: what the script drives, its no_sync included)
            if self._megatron_ddp is not None
            else DDPShaped(
                model, self, self._buffers, bucket_mib=bucket_mib if self.job.replicated else None
            )
        )
        self.user.adopt(self.job.params)  # the optimizers now hold the retained parameters
        for oi, opt in enumerate(self.optimizers):
            self._patch(oi, opt)
        if self._megatron_ddp is None:  # (Megatron's zeroes its own gradient buffers)
            model.zero_grad = self._zero_grad
        self._watch_grads()
        for chunk in chunks:  # (a model chunk's forward follows another's, interleaved)
            chunk.register_forward_pre_hook(lambda *_: self._point("compute.forward"))
            chunk.register_forward_hook(lambda *_: self._point("compute.backward"))
        # The first forward's shapes, for this rank's shadows to warm up at: only where
        # the forward talks to no other rank (a replica over the whole world).
        self._shapes = shape_warmup.Recorder(
            model, ctx.store, ctx.rank, ctx.device,
            why_not="Megatron's DDP reduces gradients in its backward"
            if self._megatron_ddp is not None
            else None if ctx.world_size == 1 or (self.job.replicated and self.job.dp.whole_world)
            else "the model is sharded or split across ranks: its forward talks to them",
        )  # fmt: skip
        plugins.expose_model(lambda: model)
        # Gradient replay (leto.integrity.replay): every K-th iteration each rank's first
        # micro-batch recomputed by the next rank (collective: every rank decides alike).
        k = replay.every()
        if k > 0 and self.job.can_replay():
            self.job.replay = replay.GradReplay(
                model, self.job.params, self.job.up.state.grad, ctx.rank, ctx.world_size, k,
                log=self.out / f"rank{ctx.rank}.replay.jsonl",
                generators=megatron.generators(),  # Megatron's dropout draws from its tracker
            )  # fmt: skip
            self.job.replay.buckets = self.job.buckets
            if self.job.landing is not None:
                self.job.replay.before_whole = self.job.landing.finish
        self._t: int | None = None  # the iteration in progress
        self._stepped = False
        self._called: set[int] = set()  # optimizers whose step() this iteration called
        self._inf: set[int] = set()  # ... whose step the GradScaler skips
        self._seen: set[int] = set()  # ... whose scaler.step() began
        self._reported = False
        self._loop = LoopState(
            self.loop, self.user, self.schedulers, self.scaler, len(self.optimizers), self._data
        )
        self._loss = None  # run.record_loss's, this iteration (None: not given)
        self._left_early: tuple[int, int] | None = None  # (iteration, of) the loop was left
        self._epochs: list[int] = []  # the schedulers' last_epoch when the iteration began
        self._mark("bind")
        t_resume = time.time()
        self.next_iteration = self.job.resume(
            ctx.report,
            checkpoints=ctx.checkpoint_dir,
            before_finish=lambda t: self._set_update(self._loop.step_record(t)),
            checkpoint_skip=ctx.env.checkpoint_skip if ctx.env is not None else 0,
            generation=ctx.generation,
            start_iteration=start_iteration,
        )
        self.job.init_fn = None  # the original parameters it holds are garbage now
        if self._main_copies:  # the model's parameters: a cast of the retained copies
            megatron.rebuild(self._megatron_optimizers, self._megatron_ddp)
        self._loop.restore(self.next_iteration)
        self._epochs = [sc.last_epoch for sc in self.schedulers]  # at the start of an iteration
        if self.job.fresh and ctx.world_size > 1 and self.job.replicated:
            self._check_identical()  # (shards and pipeline stages differ by design)
        self._mark("resume")
        ctx.resumed(
            self.next_iteration,
            resume_s=time.time() - t_resume,
            bind_s=t_resume - t0,
            **self.job.timings,
        )
        # Insurance against fatal failures only.
        self.checkpointer = ctx.checkpointer(self.next_iteration)
        if self.checkpointer is not None:
            self.checkpointer.warm(self.job)  # staging buffers made while training starts
        atexit.register(self._close)
        if hasattr(ctx, "resume_observing"):
            ctx.resume_observing()  # the script's code up to its loop is watched again
        self._mark("Run's end")

    # -- the loop -------------------------------------------------------------------

    def iterations(self, total: int):
        """The iterations still to run, up to ``total`` (exclusive): from where the job
        stands (0 on a fresh start; after a recovery, the first unfinished one)."""
        self._mark("script to loop")
        if hasattr(self.ctx, "end_skip_init"):
            self.ctx.end_skip_init()  # the set-up's draws observed up to here
        self._batches.start()
        self._rng.apply()  # after the script's own seeding: a recovery's generator states
        store = self.ctx.store
        if self.ctx.rank == 0 and store is not None and store.add(keys.CHECKS_SAID, 1) == 1:
            # Where every check stands on this job, once on the console (here, not in
            # leto.Run: a script may turn deterministic algorithms on after it).
            _notice(store, checks_line.describe(self.job, replay.every()))
            # The loop's end is known here first: a fault-plan entry past it is said now.
            plan = os.environ.get(ENV_FAULT_PLAN)
            for line in fault_plan.past_the_end(json.loads(plan), total) if plan else []:
                _notice(store, line)
        t = self.next_iteration
        t_first, t_loop = t, time.time()
        # Leto's host time between the script's iterations (from the script's end of one
        # to its start of the next): the device idles through it where the script waited
        # for the device (a logged loss), so the loop's figures say it.
        self._gaps: list[dict[str, float]] = []  # seconds of each gap, and of its parts
        self._gap_at: list[int] = []  # the iteration each gap came before
        resumed, checkpoint_s = None, 0.0
        while t < total:
            self._t, self._stepped, self._loss = t, False, None
            self._called, self._inf, self._seen = set(), set(), set()
            if isinstance(self.scaler, megatron_scaler.MegatronLossScaler):
                self.scaler.begin()
            self._got_grad.clear()
            self._reported = False
            checks = time.perf_counter() - resumed if resumed is not None else 0.0
            self.job.begin(t)
            if self.checkpointer is not None:
                self.checkpointer.begin_iteration()  # the last save's staging starts now
            self._mark("loop start")
            if resumed is not None:
                self._gaps.append({"all": time.perf_counter() - resumed, "checks": checks,
                                   "checkpoint": checkpoint_s, **self.job.begin_s})  # fmt: skip
                self._gap_at.append(t)
            try:
                yield t
            except GeneratorExit:
                # The loop was left (break, return — or an exception, sys.exit included,
                # unwinding through it: from here the two cannot be told apart). The end
                # of training is collective, and peers of a dying trainer would wait in
                # it; so it does not run here. Whether the script left it or died is
                # known at exit: only a script that ended without an uncaught exception
                # is told (a healthy rank whose collective failed with a peer's death
                # is not — it is being recovered).
                self._left_early = (t, total)
                atexit.register(self._said_left_early)
                raise
            resumed = time.perf_counter()
            if not self._stepped:
                if self.scaler is None or len(self._inf) < len(self.optimizers):
                    # (Under a GradScaler: step through scaler.step(), as torch's docs do.)
                    raise InvalidInput(
                        f"iteration {t} ended without the step() of every optimizer given "
                        f"to leto.Run: every iteration of run.iterations() updates. A last "
                        f"pass that only evaluates (llm.c's last step) goes after the loop: "
                        f"loop one iteration fewer, then evaluate — docs/porting.md"
                    )
                if self.checkpointer is not None:
                    self.checkpointer.before_update()  # the loop record is checkpointed
                # Every step skipped (inf/NaN gradients): no update, but the iteration
                # and its loss happened — in the loss log and the trace as any other.
                self.job.skipped(t, self._loss)
                self._loop.write_end(t)
            self._t = None
            self._check_schedulers(t, skipped=not self._stepped)
            c0 = time.perf_counter()
            if self.checkpointer is not None:
                with leto_range("checkpoint"):
                    self.checkpointer.after_iteration(t, self.job)
            checkpoint_s = time.perf_counter() - c0
            self._mark("after step")
            self._clock = None  # the first iteration is over: no more marks, no syncs
            if self._shapes is not None:
                self._shapes.done()
                self._shapes = None
            t += 1
            self.next_iteration = t
        self._end_of_training(t_first, t_loop, t)

    def _end_of_training(self, t_first: int, t_loop: float, t: int) -> None:
        """After the last iteration: the loop's figures in the rank's log, every check
        settled, the full scrub, ZeRO-1's final gather; collective (a loop the script
        left early does not reach it: see iterations())."""
        self.ctx.loop_ended()
        grad_clip.install(None)  # (the script's clips after the loop are torch's alone)
        # What the loop and the replica check took, in the rank's log (the check's
        # all_gather includes waiting for the slowest replica's update).
        rc, rp = self.job.replica, self.job.replay

        def median(key: str) -> float:
            xs = sorted(g[key] for g in self._gaps)
            return 1e3 * xs[len(xs) // 2]

        parts = (
            ", ".join(f"{k} {median(k):.2f}" for k in self._gaps[0] if k != "all")
            if self._gaps
            else ""
        )
        if self._gaps:  # the longest gap and its parts (a checkpoint's, where one was due)
            k = max(range(len(self._gaps)), key=lambda i: self._gaps[i]["all"])
            longest = self._gaps[k]
            parts += (
                f"; the longest {1e3 * longest['all']:.1f} before iteration {self._gap_at[k]} ("
                + (", ".join(f"{n} {1e3 * v:.1f}" for n, v in longest.items() if n != "all") + ")")
            )
        rank_log.say(
            self.ctx.rank,
            f"the loop ran {time.time() - t_loop:.2f} s for "
            f"{t - t_first} iteration(s); "
            + (
                f"Leto's host time between the script's iterations: median "
                f"{median('all'):.2f} ms (medians: {parts} ms); "
                if self._gaps
                else ""
            )
            + (
                f"gradient parity from the clip's pass at {cp.used} of {t - t_first} steps; "
                if (cp := self.job.up.clip_parity) is not None
                else ""
            )
            + (
                f"checkpoints: {self.checkpointer.summary()}; "
                if self.checkpointer is not None
                else ""
            )
            + "replica check: "
            + (
                f"{rc.checks} updates compared, {1e3 * rc.check_s / rc.checks:.3f} ms each"
                if rc is not None and rc.checks
                else "off"
            )
            + "; gradient replay: "
            + (
                f"{rp.replays} micro-batches replayed, {1e3 * rp.replay_s / rp.replays:.1f} ms each"
                if rp is not None and rp.replays
                else f"skipped ({rp.skipped})"
                if rp is not None and rp.skipped
                else f"every {rp.k} iterations, none due"
                if rp is not None
                else "off"
            ),
        )
        # Nothing leaves the loop unverified: a corruption the background pass has not
        # reached yet is found here (the fallback then redoes the iterations after it).
        self.job.settle_checks()
        self.job.scrub.full(when="at the end of training")
        # ZeRO-1: the last update's shards into every rank's full parameters (the gather
        # otherwise runs when the next iteration begins), so the model the script reads
        # after the loop — to evaluate, to save — is the trained one, not one update behind.
        self.job.up.state.gather()
        final = getattr(self.job.on_iteration, "final", None)
        if final is not None:  # verification's look at the final state (every rank)
            final(self.job.final_state())
        self.ctx.heartbeat("done")
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        dist.barrier()

    @property
    def state(self) -> dict:
        """The script's small state (e.g. the best validation loss), retained per
        iteration with the loop: keep it small, tensors belong in the model."""
        return self._loop.state

    @state.setter
    def state(self, value: dict) -> None:
        self._loop.state = value

    def batches(self, fn):
        """The script's batch function (a function of its arguments and the global
        generators, e.g. nanoGPT's ``get_batch``), wrapped so that a recovery's call before
        the loop returns the batch the failed trainer drew last with the same arguments —
        the next iteration's prefetch: ``get_batch = run.batches(get_batch)``, before the
        first call (``leto.trainer.batch_fn``)."""
        if not callable(fn):
            raise InvalidInput(f"run.batches() takes the script's batch function, not {fn!r}")
        if self._batches.started:
            raise InvalidInput("run.batches() is called before run.iterations() starts")
        return self._batches.wrap(fn)

    def no_sync(self):
        """Context for the backward of every micro-batch but the last (DDP's
        ``no_sync``): gradients accumulate, nothing is reduced yet."""
        return self.job.no_sync()

    def compute(self):
        """Optional context for forward and backward: on a GPU their activations borrow
        the updater's buffers (less device memory)."""
        return self.job.compute()

    def record_loss(self, loss) -> None:
        """This iteration's loss, for Leto's loss log and the verifiers' trace. A tensor is
        not waited for here: on a GPU the update is queued while backward still runs."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)

    # -- what the script's objects now do -------------------------------------------

    def _patch(self, oi: int, opt: torch.optim.Optimizer) -> None:
        orig_state_dict = opt.state_dict

        def step(closure=None):
            return self._step(oi, closure)

        def state_dict():
            self.user.expose_state(self.job.params, self._views, self._steps_done())
            return orig_state_dict()

        # torch's LR scheduler warns when optimizer.step was replaced after it wrapped it.
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.step = step
        opt.zero_grad = self._zero_grad
        opt.state_dict = state_dict
        opt.load_state_dict = self._load_state_dict

    def _step(self, oi: int, closure=None):
        """One optimizer's ``step()``: the update runs when every optimizer given to Leto
        has stepped in this iteration (Muon and AdamW side by side: one transaction)."""
        if closure is not None:
            raise InvalidInput("optimizer.step(closure) is not supported under Leto")
        t = self._t
        if t is None:
            raise InvalidInput(
                "optimizer.step() was called outside run.iterations(): under Leto the "
                "optimizer steps only inside the loop, as its crash-consistent update"
            )
        if self._stepped or oi in self._called:
            raise InvalidInput(f"optimizer {oi}'s step() was called twice in iteration {t}")
        opt = self.optimizers[oi]
        if getattr(opt, "grad_scale", None) is not None:
            raise InvalidInput(
                "the GradScaler passed its scale to a fused optimizer's step(): call "
                "scaler.unscale_(optimizer) before scaler.step(optimizer) under Leto"
            )
        self._called.add(oi)
        opt._opt_called = True  # what torch's scheduler checks for
        self._maybe_commit()

    def _maybe_commit(self) -> None:
        """Run the update once every optimizer has had its say: without a GradScaler,
        every ``step()`` called; with one, every ``scaler.step()`` begun and every step it
        did not skip called (a skipped non-fused step is never called; a skipped fused
        one is, and must no-op). The skipped optimizers' pieces are left as they are."""
        t = self._t
        if self._stepped or t is None:
            return
        n = len(self.optimizers)
        skip = set(self._inf)
        if self.scaler is not None:
            if len(self._seen) < n:
                return
            expected = {
                i for i, o in enumerate(self.optimizers)
                if i not in skip or getattr(o, "_step_supports_amp_scaling", False)
            }  # fmt: skip
        else:
            expected = set(range(n))
        if not expected <= self._called:
            return
        if skip and not self._reported:
            self._reported = True
            rank_log.say(
                self.ctx.rank,
                f"iteration {t}: the GradScaler skipped the step of optimizer(s) "
                f"{sorted(skip)} (inf/NaN gradients)",
            )
        if len(skip) == n:
            return  # every step skipped: the iteration's end records it
        self._check_got_grads(skip)
        skip = sorted(skip)
        if self.checkpointer is not None:
            self.checkpointer.before_update()  # the last save's staging has read the state
        self._set_update(self._loop.write_step(t, skip))
        self._mark("forward/backward")
        self.job.step(t, self._loss)
        self._mark("update")
        self._stepped = True
        self._loop.committed(skip)

    def _watch_grads(self) -> None:
        """Note which trainable parameters receive a gradient in an iteration. torch's
        optimizers skip a parameter whose ``.grad`` is None; under Leto every gradient is
        a retained view that is never None, so such a parameter would be updated with a
        zero gradient (weight decay, moments decaying) — silently unlike torch. It is
        refused instead (``_check_got_grads``)."""
        name_of = {id(p): n for n, p in self.job.params.items()}
        self._owner: dict[int, tuple[str, int]] = {}  # id(param) -> (name, optimizer)
        self._got_grad: set[int] = set()
        if self._main_copies:
            return  # (Megatron's main copies: no autograd; Megatron sets every .grad)
        for oi, opt in enumerate(self.optimizers):
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.requires_grad:  # frozen ones torch skips, and so does Leto
                        self._owner[id(p)] = (name_of.get(id(p), "?"), oi)
        seen = set()
        for p in self.job.params.values():
            if id(p) in self._owner and id(p) not in seen:  # tied: one hook
                seen.add(id(p))
                p.register_post_accumulate_grad_hook(lambda q: self._got_grad.add(id(q)))

    def _check_got_grads(self, skip: set[int]) -> None:
        missing = sorted(
            n for i, (n, oi) in self._owner.items() if oi not in skip and i not in self._got_grad
        )
        if missing:
            raise InvalidInput(
                f"iteration {self._t}: parameter(s) {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} received no gradient, so torch's "
                "optimizer would skip them; Leto cannot (their gradients are retained "
                "buffers, never None) and does not update them with a zero gradient "
                "instead. Freeze them (requires_grad=False) before leto.Run, or keep them "
                "out of the optimizer — nothing was updated in this iteration"
            )

    def _check_schedulers(self, t: int, skipped: bool = False) -> None:
        """Each LR scheduler stepped exactly once in iteration ``t`` (what a recovery
        replays after finishing an interrupted update) — or not at all in an iteration
        whose every step the loss scaler skipped (Megatron-LM steps its scheduler only
        after a successful update; the iteration's end record keeps it as it is)."""
        epochs = [sc.last_epoch for sc in self.schedulers]
        for sc, e, before in zip(self.schedulers, epochs, self._epochs, strict=True):
            if e != before + 1 and not (skipped and e == before):
                raise InvalidInput(
                    f"the LR scheduler {type(sc).__name__} stepped {e - before} times in "
                    f"iteration {t}; Leto retains it assuming one scheduler.step() per "
                    f"iteration, after optimizer.step()"
                )
        self._epochs = epochs

    def _undo_mode(self, ctx) -> str:
        """``leto run --undo``, but per chunk under Megatron's DDP: its distributed
        optimizer may all-gather parameters during the next forward (overlap_param_gather),
        and whether that writes what Leto retains beside the whole-state copy is not
        checked yet. The note says so in the checks line."""
        mode = ctx.env.undo if ctx.env is not None else "chunk"
        self._undo_note = None
        if mode == "ahead" and self._megatron_ddp is not None:
            self._undo_note = (
                "--undo ahead not taken: Megatron's DDP gathers parameters during forward, "
                "not yet checked beside a whole-state copy"
            )
            mode = "chunk"
        return mode

    def _prepared(self, found_inf: bool) -> None:
        """Megatron's optimizer prepared this iteration's gradients: every optimizer has
        had its say, and with inf/NaN found every step is skipped (Megatron runs none)."""
        every = set(range(len(self.optimizers)))
        self._seen |= every
        if found_inf:
            self._inf |= every
            rank_log.say(
                self.ctx.rank,
                f"iteration {self._t}: Megatron's loss scaler found inf/NaN gradients: its "
                "update is skipped",
            )

    def _watch_scaler(self, scaler) -> None:
        """Note, as ``scaler.step(opt)`` begins, whether it will skip ``opt``'s step: a
        non-fused optimizer's skipped step never reaches Leto, and by the iteration's end
        ``scaler.update()`` has forgotten why."""
        from torch.amp.grad_scaler import OptState

        orig = scaler.step

        def step(optimizer, *args, **kwargs):
            st = scaler._per_optimizer_states[id(optimizer)]
            if st["stage"] is OptState.READY:
                scaler.unscale_(optimizer)  # what scaler.step would do first
            inf = sum(float(v.sum()) for v in st["found_inf_per_device"].values())
            for i, o in enumerate(self.optimizers):
                if o is optimizer:
                    self._seen.add(i)
                    if inf:
                        self._inf.add(i)
            out = orig(optimizer, *args, **kwargs)
            self._maybe_commit()  # the last one may have been skipped: never called
            return out

        scaler.step = step

    def _set_update(self, rec: dict) -> None:
        """The updater's per-optimizer step numbers and skips for the update ``rec``
        (a step record) describes."""
        self.job.up.hparams = rec["hparams"]
        self.job.up.user_step = [n + 1 for n in rec["updates"]]
        self.job.up.user_skip = frozenset(rec["skip"])

    def _zero_grad(self, set_to_none: bool = True) -> None:
        """``set_to_none``: the gradients None, as torch leaves them, where they land in
        the retained buffer by copy (``leto.trainer.grad_landing``: the next backward puts
        them back); otherwise the retained gradients zeroed in place."""
        if set_to_none and self.job.landing is not None:
            self.job.landing.release()
        else:
            self.job.up.state.grad.zero_()

    def _load_state_dict(self, state_dict) -> None:
        raise InvalidInput(
            "optimizer.load_state_dict() after leto.Run: the optimizer's state is retained "
            "and restored by Leto (and its checkpoint fallback); load your own checkpoint "
            "before leto.Run (with start_iteration=) — nothing was changed"
        )

    def _steps_done(self) -> list[int]:
        return self._loop.updates

    def _views(self, name: str, state: str) -> torch.Tensor:
        st = self.job.up.state
        slot = next(s for s in st.slots if s.name == name)
        a = slot.offset - st.shard_start
        if st.shard is not None and not (0 <= a and a + slot.numel <= st.local_valid):
            raise InvalidInput(
                f"optimizer state of {name} is on another rank (ZeRO-1): state_dict() under "
                f"ZeRO-1 covers only this rank's parameters"
            )
        return st.flat[state][a : a + slot.numel].view(slot.shape)

    def _point(self, name: str) -> None:
        if self._t is not None and not (self.job.replay is not None and self.job.replay.replaying):
            point(name, self._t)

    def _mark(self, stage: str) -> None:
        """``stage`` ends now, in this process's way to its first iteration's end."""
        if self._clock is not None:
            self._clock.mark(stage)

    # -- resume ---------------------------------------------------------------------

    def _copy_in(self, originals: dict[str, torch.Tensor]) -> None:
        for name, p in self.job.params.items():
            p.copy_(originals[name])

    def _load_optimizer_state(self) -> None:
        """The optimizer state the script loaded (its own checkpoint), into retained
        memory (a fresh pool, before parity is computed)."""
        for name, st in self.user.loaded.items():
            for k, v in st.items():
                if v is not None:
                    self._views(name, "exp_avg" if k == "momentum_buffer" else k).copy_(v)

    def _check_identical(self) -> None:
        """Every data-parallel rank starts from the same parameters (DDP broadcasts rank
        0's; Leto checks, so different seeds per rank are an error, not a silent fork).
        Rank-local parameters (DDP's ignore list: experts) differ by design."""
        st = self.job.up.state
        slots = [s for s in st.slots if s.name not in self.job.rank_local]
        sums = torch.stack(
            [
                st.param_full[s.offset : s.offset + s.numel]
                .view(torch.int16 if st.param_full.element_size() == 2 else torch.int32)
                .sum(dtype=torch.int64)
                for s in slots
            ]
        )
        dp = self.job.dp  # the ranks holding replicas of this rank's parameters
        every = [torch.empty_like(sums) for _ in range(dp.size)]
        dist.all_gather(every, sums, group=dp.group)
        for r, other in zip(dp.ranks, every, strict=True):
            differ = (other != every[0]).nonzero()
            if differ.numel():
                name = slots[int(differ[0])].name
                raise InvalidInput(
                    f"parameter {name} differs between rank {dp.ranks[0]} and rank {r} at the start: "
                    f"initialize the model identically on every data-parallel rank (same "
                    f"seed); nothing was trained"
                )

    def _said_left_early(self) -> None:
        if self._left_early is None or uncaught():
            return
        t, total = self._left_early
        rank_log.tell(
            self.ctx.rank,
            f"the loop was left at iteration {t} of {total} before run.iterations() "
            f"ended: the end of training did not run (the checks of the last updates "
            f"settled, the full scrub, ZeRO-1's final gather); to have it, let the loop "
            f"run out — docs/porting.md",
        )

    def _close(self) -> None:
        try:
            self.ctx.pool.close()
        except Exception:  # noqa: BLE001 - at exit: the pool's owner cleans up anyway
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def _notice(store, text: str) -> None:
    """A line for the console, through the job's store (node 0's agent logs it once)."""
    n = store.add(keys.NOTICES_TAKEN, 1) - 1
    store.set(keys.notice(n), text)
    store.add(keys.NOTICES, 1)
