"""Retained training state of one rank: the updater, the job-wide resume rule and the
per-iteration plumbing around the user's forward and backward.

Runs in the trainer (an active trainer, or a promoted shadow). One object per rank:
``resume`` recovers the pool's state and agrees with every other rank on where to
continue (finish the interrupted update, or redo the interrupted iteration);
``compute`` wraps forward and backward (the updater's buffers hold activations);
``step`` finishes the reduction of the retained gradients (buckets all-reduced while
backward ran, ``leto.trainer.buckets``), protects them, synchronizes and runs the
resumable update, then logs the loss and calls the caller's ``on_iteration`` (the
example job passes the verifiers' recorder: Leto never imports its tools).

Gradient accumulation: micro-batches accumulate into the retained gradient buffer (the
example job's ``--micro-batches``; every backward but the last under ``no_sync``), and
a crash in any of them is a crash in the compute phase (the iteration is redone).

A parallelized model (FSDP2, tensor parallel, FSDP2 x TP): the retained state is this
rank's shards and the parallelism's own reductions fill the retained gradients
(``leto.update.shards``); under FSDP2 use ``set_requires_gradient_sync`` for
micro-batches instead of ``no_sync``. A pipeline stage (``data_parallel=False``) has no
replicas: nothing is reduced across ranks. A mixture of experts under expert parallelism
(experts sharded by rank, the rest replicated): the parameters DDP's ignore list names
(``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``) are this rank's
own, as they are for DDP — retained like the rest, their gradients never reduced, left
out of the identical-start check — and the others are data parallel.

Not covered: pipeline x data parallelism; the replica check with rank-local parameters
(their state shares protection groups with the replicated state: the check is off).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from leto import rank_log
from leto.errors import FatalFailure, InvalidInput
from leto.integrity import loss_guard, recheck, replica
from leto.integrity.scrub import Scrubber
from leto.memory.client import PoolClient
from leto.plugins import SDC_GRAD_POINT, point
from leto.ranges import leto_range
from leto.trainer import grad_landing
from leto.trainer.buckets import GradBuckets
from leto.trainer.dp_group import DPGroup
from leto.update import grad_clip
from leto.update.marker import MarkerState, Phase
from leto.update.rmu import Updater, UpdaterConfig, decide
from leto.update.schedule import WarmupCosine

ENV_AHEAD_AT = "LETO_UNDO_AHEAD_AT"  # grad: --undo ahead's copy at the first gradient


class RetainedTraining:
    def __init__(
        self,
        client: PoolClient,
        model: torch.nn.Module,
        init_fn,
        schedule: WarmupCosine,
        rank: int,
        world: int,
        out: Path,
        updater: UpdaterConfig | None = None,
        zero1: bool = False,
        on_iteration=None,
        heartbeat=None,
        bucket_mib: float = 25.0,
        user=None,
        scrub_requests: Path | None = None,
        data_parallel: bool = True,
        guard_loss: bool = True,
        dp=None,
        external_grads: bool = False,
    ):
        """``model`` may live on the meta device: its parameters become views of pool
        memory. ``init_fn()`` initializes them on a fresh pool (first start only).
        ``user``: the script's own optimizer (``UserOptimizer``; ``leto.Run`` drives
        this mode) instead of ``updater.adamw`` and ``schedule``. ``scrub_requests``:
        the file ``leto pool scrub`` writes to ask for a full scrub now.
        ``data_parallel``: every rank holds the same parameters and Leto averages the
        gradients over all of them; False: each rank's parameters are its own (a
        pipeline stage) and nothing is reduced across ranks. ``dp``: the ranks holding
        this rank's replicas (``leto.trainer.dp_group.DPGroup``; None: the world).
        ``external_grads``: a library reduces the gradients in its own buffers (Megatron's
        DDP): the parameters keep their objects, Leto reduces nothing and copies the
        gradients in at the update."""
        self.external_grads = external_grads
        self.rank, self.world, self.out = rank, world, Path(out)
        self.dp = dp if dp is not None else DPGroup.world(world)
        if zero1 and not self.dp.whole_world:
            raise InvalidInput(
                "ZeRO-1 with data-parallel groups smaller than the world is not supported; "
                "nothing was retained"
            )
        self.model = model
        self.init_fn = init_fn
        shard = (rank, world) if zero1 else None
        # Parameters DDP would ignore (a MoE's experts under expert parallelism): this
        # rank's own. Read before binding replaces the parameter objects.
        self.rank_local = frozenset(
            n for n, p in model.named_parameters() if getattr(p, "_ddp_ignored", False)
        )
        if self.rank_local and zero1:
            raise InvalidInput(
                f"parameter {min(self.rank_local)} is ignored by DDP (rank-local, e.g. an "
                f"expert under expert parallelism): ZeRO-1 shards replicated state only — "
                f"nothing was retained"
            )
        t0 = time.time()
        self.up = Updater(
            client, model, schedule, updater or UpdaterConfig(), shard=shard, user=user,
            swap_data=external_grads,
        )  # fmt: skip
        self.params = self.up.params
        # Leto averages gradients over the ranks only when every rank holds the same
        # parameters: a parallelized model reduces its own (FSDP2's reduce-scatter, TP's
        # collectives) into the retained shards, and a pipeline stage has no replicas.
        shards = self.up.state.shards
        self.replicated = (
            shards is None and data_parallel and len(self.rank_local) < len(self.params)
        )
        self.fsdp = bool(shards) and any(sh.owner is not None for sh in shards.values())
        # Which code updates the chunks (the fused pass's kernel or twin, or the unfused
        # steps and why), in the rank's log.
        rank_log.say(rank, f"chunk updates: {self.up.update_path}")
        # Silent corruption: the state checked against its parity (findings logged).
        self.scrub = Scrubber(self.up, log=self.out / f"rank{rank}.scrub.jsonl")
        self.scrub_requests = Path(scrub_requests) if scrub_requests else None
        self._served: str | None = None  # the last on-demand scrub this rank answered
        # Wrong computations: replicas compare their state's digest after each update
        # (leto.integrity.replica; collective — every rank decides alike). Sharded state
        # (FSDP2, TP, pipeline stages, ZeRO-1's optimizer shards) has no replica, and
        # rank-local experts share protection groups (their digests) with replicated state.
        # A non-finite loss on any rank fails the iteration on every rank
        # (leto.integrity.loss_guard): agreed in the replica check's all_gather, else in
        # its own. Off under a GradScaler (its skipped steps) and --no-loss-guard.
        self.guard = (
            loss_guard.LossGuard(rank, world) if guard_loss and loss_guard.enabled() else None
        )
        self.replica = None
        # The last update's digests and loss flag, not yet compared (_check_replicas).
        self._unchecked: tuple | None = None
        if (
            self.dp.size > 1 and self.replicated and self.up.state.shard is None
            and not self.rank_local and replica.enabled()
        ):  # fmt: skip
            log = self.out / f"rank{rank}.replica.jsonl"
            self.replica = replica.ReplicaCheck(
                rank, world, log=log,
                **({} if self.dp.whole_world else {"pg": self.dp.gloo(600.0), "members": self.dp.ranks}),
            )  # fmt: skip
            self.up.digest_on = True
        # Where no replica checks this rank's update (one rank, shards, rank-local
        # experts), a sampled chunk of it is recomputed (leto.integrity.recheck); off with
        # the replica check (--no-replica-check) and for the example workload's AdamW.
        if self.replica is None and user is not None and replica.enabled():
            how = recheck.mode()
            if how != "0":
                n = sum(len(self.up.state.chunks(gi)) for gi in range(len(self.up.groups)))
                self.up.recheck = recheck.Recheck(
                    rank, n, self.out / f"rank{rank}.recheck.jsonl", every=how == "all"
                )
        # The recovery record's steps on the trainer's side (the agent adds its own).
        self.timings: dict[str, float] = {"map_retained_s": time.time() - t0}
        self.device = self.up.device
        # Verification is the caller's callback (e.g. verifiers.Recorder.record), called
        # once per iteration with (iteration, loss, {name: retained tensor}).
        self.on_iteration = on_iteration
        self.observer_s = 0.0  # time in on_iteration since resume began to count it
        self.loop = None  # leto.Run's loop record (checkpoints carry it)
        self.data = None  # leto.Run's data records (DataState; checkpoints carry them)
        self._said_no_loss = False  # the missing run.record_loss was reported
        self.on_no_loss = None  # leto.Run: tell the agent too (it says so on the console)
        self.fresh = False  # resume initialized a fresh pool (no retained state, no checkpoint)
        self.heartbeat = heartbeat  # (iteration) -> None: progress for a hang monitor
        self.begin_s: dict[str, float] = {}  # host seconds of the last begin()'s parts
        self._loss_host: torch.Tensor | None = None  # pinned: the loss log's copy (GPU)
        # Gradients reduced in buckets while backward runs (as DDP does); 0: one
        # all-reduce of the whole retained buffer after backward (with rank-local
        # parameters: buckets around them, however large).
        if self.rank_local and bucket_mib <= 0:
            bucket_mib = float("inf")
        # Gradients copied into their views as autograd hands them over, not added to a
        # zeroed buffer (leto.trainer.grad_landing); its hooks come before the buckets'.
        self.landing = (
            grad_landing.GradLanding(self.params, self.up.state)
            if not external_grads and shards is None and grad_landing.wanted()
            else None
        )
        self.buckets = (
            GradBuckets(
                self.params, self.up.state, bucket_mib, at_backward_end=user is not None,
                rank_local=self.rank_local, group=self.dp.group,
            )
            if self.dp.size > 1 and bucket_mib > 0 and self.replicated and not external_grads
            else None
        )  # fmt: skip
        if self.buckets is not None:
            self.buckets.before_launch = self._local_grad
            if self.landing is not None:
                self.buckets.before_finish = self.landing.finish
        # The gradients' parity taken in the script's clip_grad_norm_ (leto.update.
        # grad_clip). Under data parallelism the buckets' reduction ends when backward
        # does (before the script's clip reads the gradients); one that ends later, at
        # the step (backward under no_sync, or no buckets), ends with an in-place
        # division, which moves the buffer's autograd version counter (an all-reduce
        # alone would not), so the step encodes instead. A library's own gradients are
        # copied in at the step, after any clip of the script's.
        if self.up.clip_parity_reason is None and external_grads:
            self.up.clip_parity_reason = "a library's own gradients"
        if self.up.clip_parity_reason is None:
            self.up.clip_parity = grad_clip.ClipParity(self.up)
        grad_clip.install(self.up.clip_parity)
        # --undo ahead with LETO_UNDO_AHEAD_AT=grad: the whole-state copy queued when the
        # iteration's first gradient lands, for the device to run it beside the rest of
        # backward (queued at the iteration's start, the default, it ran alone on an
        # H100). On an H100 it made no difference either (the copy takes the SMs and the
        # memory bandwidth wherever it runs: docs/update.md). A library that sets the
        # gradients itself (Megatron's) gets no hooks: its update queues the copy.
        if self.up.ahead and not external_grads and os.environ.get(ENV_AHEAD_AT) == "grad":
            seen: set[int] = set()
            for p in self.params.values():
                if p.requires_grad and id(p) not in seen:  # tied: one hook
                    seen.add(id(p))
                    p.register_post_accumulate_grad_hook(self._first_grad)
            self.up.ahead_at_grad = True
        # Gradient replay (leto.integrity.replay): leto.Run sets it when the job can replay.
        self.replay = None
        self._t: int | None = None  # the iteration in progress

    def _first_grad(self, _param: torch.Tensor) -> None:
        if self.up._ahead_pending is not None:
            self.up.ahead_at_first_grad()

    def can_replay(self) -> bool:
        """Whether another rank holds every parameter this rank computes gradients of
        (data parallel, nothing sharded or rank-local): gradient replay's premise."""
        return (
            self.world > 1 and self.replicated and self.up.state.shards is None
            and not self.rank_local and self.dp.whole_world and not self.external_grads
        )  # fmt: skip

    def _local_grad(self, view: torch.Tensor) -> None:
        """``view`` (a bucket, or the whole buffer) holds this rank's local gradient, about
        to be reduced: faultkit's ``sdc-grad`` seam, then gradient replay's digest."""
        point(SDC_GRAD_POINT, self._t, dest=[view])
        if self.replay is not None:
            self.replay.local(view)

    def resume(
        self,
        report: dict,
        checkpoints: str | Path | None = None,
        before_finish=None,
        checkpoint_skip: int = 0,
        generation: int = 0,
        start_iteration: int = 0,
    ) -> int:
        """Recover this rank, apply the job-wide rule; returns the next iteration. On a
        fresh pool the newest complete checkpoint under ``checkpoints`` (if any) is
        loaded, else ``init_fn`` runs. ``before_finish(t)`` runs before an interrupted
        update of iteration t is finished (the script's optimizer needs t's
        hyperparameters)."""
        t0 = time.time()
        m = self.up.recover(report)
        self._settle()
        self.timings["reconstruct_s"] = time.time() - t0
        restored = False
        if m is None:
            from leto.trainer.checkpoint import latest, restore

            found = latest(checkpoints, checkpoint_skip) if checkpoints is not None else None
            note = getattr(self.on_iteration, "restored", None)
            if found is not None:
                restore(found[0], found[1], self)
                restored = True
                if note is not None:  # verification: later records are superseded
                    note(found[1])
            else:
                # A fresh job: the marker says iteration start_iteration - 1 is done.
                self.up.initialize(self.init_fn, iteration=start_iteration - 1)
                self.fresh = True
                if note is not None and generation > 0:  # a fallback to the very start
                    note(start_iteration - 1)
            m = self.up.marker.state
        # A failure in the middle of a recovery (pages rebuilt, the job-wide rule not yet
        # agreed): faultkit's "resume@0".
        point("resume", 0)
        t0 = time.time()
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, m)
        action, t = decide(gathered)
        self.timings["resumed_by"] = action  # finish: iteration t completed here
        t1 = time.time()
        self.timings["agree_s"] = t1 - t0
        self.observer_s = 0.0
        if action == "finish" and m.next_iteration() == t:
            if before_finish is not None:
                before_finish(t)
            self.up.finish(m)
            self._log(t, self.up.marker.state)
        elif m.phase is Phase.DONE and m.iteration >= 0 and not (restored or self.fresh):
            self._log(m.iteration, m)  # a crash between the marker and the log line
        self._settle()
        self.timings["finish_update_s"] = time.time() - t1
        # Of which the iteration observer's record (the verifiers' digest, under
        # --verify): the measurement's cost, which benchmarks report apart.
        self.timings["observer_s"] = self.observer_s
        # Verified recovery: the rebuilt groups against the parity their rebuild did not
        # consume (tier 1's other rows, tier 2). A mismatch is a fatal failure naming
        # the pages: the checkpoint fallback. Launched here, beside the first forward
        # and backward (which only read the pages), and read before the first update
        # or checkpoint (Scrubber.verify_later): off the recovery's critical path.
        lost = report.get("groups", {})
        rebuilt = [gi for gi, g in enumerate(self.up.groups) if str(g.gid) in lost or g.gid in lost]
        if rebuilt:
            v = self.scrub.verify_later(rebuilt, when="verifying the rebuilt groups")
            self.timings["verify_s"] = v["seconds"]
            self.timings["verified_groups"] = v["groups"]
        return t + 1 if action == "finish" else t

    def _settle(self) -> None:
        """Wait for the device, so a recovery step's time includes its kernels (only on
        the recovery path)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, t: int) -> None:
        c0 = time.perf_counter()
        if self.heartbeat is not None:
            with leto_range("heartbeat"):
                self.heartbeat(t)
        c1 = time.perf_counter()
        with leto_range("scrub"):
            self.scrub.step()  # the previous update is done: parity matches the pages
            self._scrub_on_demand(t)
        c2 = time.perf_counter()
        point("gather", t)
        with leto_range("begin"):
            self.up.state.gather()  # ZeRO-1: the owners' retained shards make the full parameters
            landing = self.landing is not None and self.landing.begin()
            if not self.external_grads and not landing:
                self.up.state.attach_grads(self.params)
            if self.buckets is not None:
                self.buckets.begin()
            self.up.begin(t, zero_grads=not landing)
        c3 = time.perf_counter()
        self.begin_s = {"heartbeat": c1 - c0, "scrub": c2 - c1, "updater": c3 - c2}
        self._t = t
        if self.replay is not None:
            with leto_range("gradient replay"):
                self.replay.begin(t)

    def _scrub_on_demand(self, t: int) -> None:
        """A full scrub when ``leto pool scrub`` asked (a new request id), answered in
        ``scrub.<id>.rank<r>.json`` beside the request — also when it found corruption,
        which then ends this trainer as the fatal failure it is."""
        req = self.scrub_requests
        if req is None or not req.exists():
            return
        try:
            rid = str(json.loads(req.read_text())["id"])
        except (OSError, ValueError, KeyError):
            return  # being replaced (the CLI renames a whole file in): next iteration
        answer = req.parent / f"scrub.{rid}.rank{self.rank}.json"
        if rid == self._served or answer.exists():
            return
        self._served = rid
        rec: dict = {"rank": self.rank, "iteration": t}
        try:
            rec.update(ok=True, **self.scrub.full(when="on demand (leto pool scrub)"))
            rec["background"] = self.scrub.report()  # passes, bytes, findings so far
        except FatalFailure as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            tmp = answer.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec))
            tmp.rename(answer)

    def compute(self):
        """Context for forward and backward (activations borrow the updater's buffers)."""
        return self.up.lent_memory()

    def no_sync(self):
        """Context for the backward of every micro-batch but the last (as DDP's
        ``no_sync``): gradients accumulate, nothing is reduced yet."""
        if self.fsdp:
            raise InvalidInput(
                "run.no_sync() with a model sharded by fully_shard: use FSDP2's "
                "model.set_requires_gradient_sync(False) for the micro-batches instead"
            )
        # (Tensor parallel alone: nothing is reduced across ranks, nothing to defer.)
        return self.buckets.no_sync() if self.buckets is not None else contextlib.nullcontext()

    def sync_backward(self, on: bool) -> None:
        """Whether the backward of the forward now starting reduces (DDP's
        ``require_backward_grad_sync``, read by the DDP-shaped model at each forward)."""
        if not on and self.fsdp:
            raise InvalidInput(
                "require_backward_grad_sync=False (or no_sync()) with a model sharded by "
                "fully_shard: use FSDP2's model.set_requires_gradient_sync(False) instead"
            )
        if self.buckets is not None:
            self.buckets.forward_sync = on

    def reduce(self, t: int) -> None:
        """Finish the reduction of the retained gradients (sum, then divide by the world
        size). Under the script's optimizer the buckets do it when backward ends; with
        ``external_grads`` the library did (its reduced, clipped gradients are copied in)."""
        if self.external_grads:
            point("allreduce", t)  # (the library's reduction is over: before the copy)
            self.up.state.stage_grads(self.params)
            return
        if self.landing is not None:
            self.landing.finish()  # (a parameter no backward reached: its view, zeroed)
        self.up.state.check_grads(self.params)
        point("allreduce", t)
        if self.buckets is not None:
            if not self.buckets.reduced:
                self.buckets.finish()  # the buckets backward launched, then any it did not
        else:
            self._local_grad(self.up.state.grad)
            if self.dp.size > 1 and self.replicated:
                dist.all_reduce(self.up.state.grad, group=self.dp.group)
                self.up.state.grad.div_(self.dp.size)
        if self.replay is not None:  # before the update reads the gradients
            self.replay.verify(t)

    def step(self, t: int, loss: torch.Tensor | float | None) -> None:
        """``loss``: a float or a tensor; None: the script gave none (logged as NaN). A
        device tensor is not waited for before the update is queued (the marker copies
        it on the device); the loss log reads it after, from a pinned copy made in
        stream order — waiting for the backward pass, not for the update."""
        # The last update's replica check, before anything of this iteration can fail
        # (a replay mismatch redoes it in place, and a check left pending would be lost).
        with leto_range("replica check"):
            self._check_replicas()
        with leto_range("reduce"):
            self.reduce(t)
        value, later = float("nan"), None
        if loss is None:
            self._no_loss(t)
        elif isinstance(loss, torch.Tensor) and loss.device.type == "cuda":
            later = self._pinned_loss(loss)
        elif isinstance(loss, torch.Tensor):
            value = float(loss.detach())
        else:
            value = float(loss)
        if self.up.recheck is not None:  # earlier updates' rechecks the device finished
            with leto_range("update recheck"):
                self.up.recheck.settle(wait=False)
        with leto_range("scrub"):
            self.scrub.before_update()
        with leto_range("protect grads"):
            self.up.protect_grads(t, loss=loss if later is not None else value)
        with leto_range("sync"):
            self.up.sync(t, group=dist.group.WORLD)
        with leto_range("update"):
            self.up.update(t)
        if self.device.type == "cpu" and self.up.recheck is not None:
            self.up.recheck.settle()  # nothing to overlap on the CPU: read it now
        if later is not None:  # the pinned copy: waits for backward, not for the update
            host, ev = later
            with leto_range("loss read"):
                ev.synchronize()
            value = float(host)
        bad = self.guard is not None and loss is not None and not math.isfinite(value)
        if self.replica is not None:  # compared before the next update (_check_replicas)
            self._unchecked = (t, self._digests_copy(), int(bad), value)
        elif self.guard is not None and (flagged := self.guard.agree(bad)):
            self.guard.fail(t, flagged, value)
        m = self.up.marker.state
        if later is not None:
            m = m.but(loss=value)
        with leto_range("log"):
            self._log(t, m)

    def skipped(self, t: int, loss: torch.Tensor | float | None) -> None:
        """Iteration ``t`` ended with every step skipped by the GradScaler: nothing was
        updated, and its loss is logged (and traced, with the state it left: the one
        before) as any iteration's — the script's own log has it, and torchrun's."""
        if loss is None:
            self._no_loss(t)
            value = float("nan")
        else:
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._log(t, self.up.marker.state.but(loss=value))

    def settle_checks(self) -> None:
        """Every check of the updates made so far, before a checkpoint and at the end of
        training: the replica check of the last update (with the loss guard's flags)
        and the update recheck's comparisons (waiting for the device).
        ``ReplicaDisagreement``, ``NonFiniteLoss`` or ``WrongUpdate`` (fatal) if one
        failed. Collective: every rank, at the same points."""
        self.scrub.settle_verified()  # a recovery's check of its rebuilt groups
        self._check_replicas()
        if self.up.recheck is not None:
            self.up.recheck.settle()

    def _digests_copy(self) -> tuple[torch.Tensor, object] | None:
        """This update's group digests on the host, or None when they do not cover
        every group (an update a recovery finished). On a GPU a pinned copy behind an
        event: made in stream order, read when the next check needs it (the host never
        waits for the update to finish)."""
        if not self.up.digest_complete:
            return None
        if self.device.type != "cuda":
            return self.up.digests.clone(), None
        host = torch.empty(self.up.digests.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(self.up.digests, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def _check_replicas(self) -> None:
        """The replica check of the last update (and the loss guard's flags with it):
        one all_gather, made before the next update reads that state, before a
        checkpoint and at the end of training — deferred so that the host never waits
        for an update to finish. A rank with nothing unchecked (the first iteration, a
        trainer that took over) sends none and nothing is compared."""
        if self.replica is None:
            return
        pending, self._unchecked = self._unchecked, None
        t, got, bad, value = pending if pending is not None else (-1, None, 0, float("nan"))
        digests = None
        if got is not None:
            digests, ev = got
            if ev is not None:
                ev.synchronize()  # long past, as a rule: the device is in the next backward
        gids = [g.gid for g in self.up.groups]
        if self.dp.whole_world:
            flagged = self.replica.check(t, digests, gids, recheck=self._recheck, flag=bad)
        else:
            # Replicas are a data-parallel group's; a non-finite loss fails the iteration
            # on every rank of the job, so its flag is agreed over the world.
            self.replica.check(t, digests, gids, recheck=self._recheck)
            flagged = self.guard.agree(bad) if self.guard is not None else []
        if flagged:
            self.guard.fail(t, flagged, value)

    def _recheck(self, gis: list[int]) -> torch.Tensor:
        """Groups whose digests differ between replicas, scrubbed (a wrong parity page is
        repaired in place; a data page that disagrees with its parity is a fatal
        ``CorruptState``), and every group's digest again, from host tier 1."""
        self.scrub.full(gis, when="replicas disagreed")
        out = self.up.digests.clone()
        for gi in gis:
            out[gi] = replica.group_digest(self.up._host_tier(self.up.groups[gi], 1))
        return out

    def _no_loss(self, t: int) -> None:
        """Under verification, say once that the trace's losses are NaN: every run's
        trace then holds the same "nan" for each iteration, and the verifiers' loss
        comparison checks nothing (only the tensors' digests would)."""
        if self.on_iteration is None or self._said_no_loss:
            return
        self._said_no_loss = True
        print(
            f"rank {self.rank}: warning: iteration {t} committed without a loss: the "
            "--verify trace and the loss log record NaN for it and every iteration like "
            "it. Call run.record_loss(loss) before optimizer.step()",
            file=sys.stderr,
            flush=True,
        )
        if self.on_no_loss is not None:
            self.on_no_loss()

    def _pinned_loss(self, loss: torch.Tensor):
        """A non-blocking copy of the loss to pinned host memory, and an event after it."""
        if self._loss_host is None:
            self._loss_host = torch.empty((), dtype=torch.float64, pin_memory=True)
        self._loss_host.copy_(loss.detach().reshape(()), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return self._loss_host, ev

    def _log(self, t: int, m: MarkerState) -> None:
        with open(self.out / f"rank{self.rank}.losses.jsonl", "a") as f:
            f.write(json.dumps({"iteration": t, "loss": m.loss.hex()}) + "\n")
        if self.on_iteration is not None:
            st = self.up.state
            t0 = time.time()
            self.on_iteration(t, m.loss, {k: v[: st.local_valid] for k, v in st.flat.items()})
            self.observer_s += time.time() - t0

    def final_state(self) -> dict[str, torch.Tensor]:
        """Full parameters (gathered under ZeRO-1: a collective, every rank calls it),
        this rank's (shard of the) optimizer state and where the shard starts; CPU
        copies (what verification saves to compare runs)."""
        st = self.up.state
        st.gather()
        state = {k: v[: st.local_valid].clone().cpu() for k, v in st.flat.items() if k != "param"}
        state["param"] = st.param_full[: st.numel].clone().cpu()
        state["shard_start"] = torch.tensor([st.shard_start])
        return state
