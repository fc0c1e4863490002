"""Checkpoint fallback for fatal failures: asynchronous ``torch.distributed.checkpoint``
saves of every rank's retained state, and the restore after a fatal failure.

Runs in the trainer. Leto recovers HOFs in place, so checkpoints only insure against
fatal failures (FF: retained state beyond what parity covers, a dead state manager):
their interval comes from Young's formula with the FF-only MTTF ``M / (1 - h)``
(h = HOF ratio), the checkpoint cost ``p`` being what the first save cost the loop, in
iterations: its iteration's time over the median (the full scrub and the settled checks
before it, the save's call, what the staging copy costs the next iteration; the write
overlaps training), at least the save's blocking part. The save's
call alone once stood for ``p``: 3 ms at 4.3 M parameters on the CPU against a 130 ms
scrub, which gave an interval of 2 iterations and a loop spending half its time saving.
A checkpoint is complete when DCP's ``.metadata`` exists; the restore takes the
newest complete one, so a save cut short by the failure is skipped. Every save follows
a full scrub of the retained state (``leto.integrity.scrub``): a checkpoint holds only
state that agreed with its parity, so silent corruption found later falls back to a
state that predates it.

Nothing here stalls the loop for long (at 1 B parameters on the H200 the first two
iterations of a job once took 16 s and 39 s): staging runs in the background (``leto.trainer.staging``:
pinned host buffers made once, non-blocking copies on a stream of their own, started
once the next iteration has begun), overlapping its forward and backward, and the
trainer waits for it only before
the next update changes the state (``before_update``); a save that comes due while the
previous one is still being written is put off to a later iteration (the ranks agree)
instead of waiting for the disk; a save whose write fails is said, not raised; and
Young's interval is set once an iteration has
been timed after the first save (not 1 until then).

Not covered: checkpoints on storage that other nodes cannot read (multi-node jobs need
a shared directory), pruning old checkpoints beyond ``keep``.
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from leto import rank_log
from leto.errors import InvalidInput
from leto.job import keys
from leto.sim.model import young_interval
from leto.trainer.staging import HostStager, at_release_default, publish_layout, shapes_of

# A save put off (the last one still written, the staging buffers not made yet) is
# agreed on again this many iterations later.
RETRY = 4
WRITE_TIMEOUT_S = 3600.0  # a save's write waited for (at the end) at most this long


def _why(e: BaseException) -> str:
    """An error in one line: DCP's ``CheckpointException`` (a ``BaseException``) by the
    error of each rank it names, not its tracebacks."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {_why(x[0])}" for r, x in sorted(e.failures.items()))
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else '(no message)'}"


def _step_dir(root: Path, iteration: int) -> Path:
    return root / f"it{iteration:08d}"


def latest(root: str | Path, skip: int = 0, before: int | None = None) -> tuple[Path, int] | None:
    """The newest complete checkpoint under ``root`` and the iteration it ends; with
    ``skip``, the one that many older (None when there are not that many); with
    ``before``, among those of earlier iterations only."""
    root = Path(root)
    done = sorted(p for p in root.glob("it*") if (p / ".metadata").exists())
    if before is not None:
        done = [p for p in done if int(p.name[2:]) < before]
    if len(done) <= skip:
        return None
    return done[-1 - skip], int(done[-1 - skip].name[2:])


class Checkpointer:
    def __init__(
        self,
        root: str | Path,
        rank: int,
        interval: int | None = None,
        mttf_s: float | None = None,
        hof_ratio: float = 0.0,
        keep: int = 2,
        joining_at: int | None = None,
        store=None,
    ):
        """``interval``: a fixed interval in iterations; otherwise Young's with
        ``mttf_s`` (all failures) and ``hof_ratio``. ``joining_at``: this process joins a
        running job (a promoted shadow, a restart after a fallback) at that iteration —
        collective. ``store``: the job's store (the staging layout is published there
        for the next shadow)."""
        if interval is None and mttf_s is None:
            raise InvalidInput("give a checkpoint interval, or the MTTF for Young's formula")
        if interval is not None and interval < 1:
            raise InvalidInput(f"checkpoint interval {interval}: expected >= 1 iterations")
        if not 0.0 <= hof_ratio <= 1.0:
            raise InvalidInput(f"hof_ratio {hof_ratio}: expected a fraction in [0, 1]")
        self.root, self.rank, self.store = Path(root), rank, store
        self.fixed = interval
        self.ff_mttf_s = math.inf if mttf_s is None or hof_ratio >= 1 else mttf_s / (1 - hof_ratio)
        self.keep = keep
        self.interval = interval or 1  # Young's replaces it after the first save
        self.pending = None
        self.last_t: int | None = None
        self._t_iter: list[float] = []
        self._t_prev: float | None = None
        self.saves: list[dict] = []
        self.scrubs: list[dict] = []  # the full scrub before each save
        self.deferred: list[int] = []  # iterations a save was due but the last still wrote
        self.failed: list[dict] = []  # saves whose write failed: iteration, error
        self.staging = None  # the last save's staging (a future), until before_update
        # One stager for the checkpointer's life: its pinned host buffers (12 bytes a
        # parameter) are made once — by ``warm``, in the background — and reused.
        self._stager = None
        self._warming = None
        self.close_error: str | None = None  # what close() reported, if anything
        self._young = interval is None  # Young's interval still to set after the first save
        self._retry_at = 0  # a save put off is asked for again at this iteration
        # Saves finish on a background thread with collectives of their own: a separate
        # group keeps them from interleaving with training's all-reduces.
        self.pg = dist.new_group(backend="gloo")
        self.agree_pg = dist.new_group(backend="gloo")  # interval agreement, main thread
        # A joining trainer saves nothing in its first iteration: after a recovery that
        # iteration is the one a user waits for (a due save is a full scrub and a
        # staging copy: 0.36 s at 1.1 B on the H200), and the next one saves instead.
        self._joined_first = joining_at is not None
        if joining_at is not None and store is not None and store.check([keys.CHECKPOINT_INTERVAL]):
            # The job's agreed interval (Young's, set once by the first generation that
            # timed a save), not Young's again from a save this process never made.
            self.interval = int(store.get(keys.CHECKPOINT_INTERVAL))
            self._young = False
        if joining_at is not None:
            # Continue the job's schedule from its newest complete checkpoint before this
            # iteration (a fallback may have passed over newer ones): a fresh process
            # otherwise saved at its first iteration, which after a recovery put a full
            # scrub and a save on the first iteration after it. The ranks agree (a save
            # is collective); fenced generations write nothing more.
            found = latest(self.root, before=joining_at)
            newest = torch.tensor([float(found[1]) if found else -1.0])
            dist.all_reduce(newest, op=dist.ReduceOp.MIN, group=self.agree_pg)
            self.last_t = int(newest.item()) if newest.item() >= 0 else None

    def _state(self, job) -> dict[str, torch.Tensor]:
        return _tensors(job, self.rank)

    def warm(self, job) -> None:
        """Make the staging buffers now, in the background, while the first iterations
        run: allocating and pinning them is most of a first save's staging (seconds at
        1 B parameters), which the next update would otherwise wait for — a save that
        comes due before they exist is put off. Nothing is copied into them yet."""
        state = self._state(job)
        self._stager = HostStager(state, rank=self.rank, at_release=at_release_default())
        publish_layout(self.store, self.rank, shapes_of(state))  # for the next shadow
        self._warming = self._stager.prepare(state)

    def after_iteration(self, t: int, job) -> None:
        """Call once iteration ``t`` is complete (its update done)."""
        now = time.perf_counter()
        if self._t_prev is not None:
            self._t_iter.append(now - self._t_prev)
        self._t_prev = now
        if self._young and self.saves and self._t_iter:
            self._set_young_interval()
        due = self.last_t is None or t - self.last_t >= self.interval
        if due and self._joined_first:
            self.deferred.append(t)  # (every rank joined at once: they agree)
            due = False
        self._joined_first = False
        if not due:
            return
        if t < self._retry_at:
            return  # put off: asked again at _retry_at
        if self.pending is not None or self._warming is not None:
            # One save in flight at a time, and the loop never waits for a disk or for
            # the staging buffers being made: while the last save is still being
            # written, or the buffers are not ready, this one is put off. Every rank must
            # agree (a save is collective), so they decide together — every RETRY
            # iterations, not every iteration: the agreement is a collective on the
            # host (0.4 ms an iteration at 1.1 B while a first save waited for its
            # buffers, on an H100), and a save a few iterations later costs nothing.
            ready = (self.pending is None or self.pending.done()) and (
                self._warming is None or self._warming.done()
            )
            busy = torch.tensor([0.0 if ready else 1.0])
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.agree_pg)
            if busy.item():
                self.deferred.append(t)
                self._retry_at = t + RETRY
                return
            if self.pending is not None:
                self._settle_write()  # done: a failure is said, not raised
            if self._warming is not None:
                self._warming.result()
                self._warming = None
        # Only a verified state is saved: silent corruption found later falls back to
        # a checkpoint that predates it (CorruptState, a fatal failure, if found now).
        t0 = time.perf_counter()  # the loop's stall from here is the save's cost
        job.settle_checks()  # a checkpoint holds no update a recheck found wrong
        s0 = time.perf_counter()
        self.scrubs.append(job.scrub.full(when=f"before the checkpoint of iteration {t}"))
        scrub_s = time.perf_counter() - s0
        step = _step_dir(self.root, t)
        # A save over an existing checkpoint (a fallback passed over it, and the schedule
        # reached its iteration again): its metadata goes first, and no rank writes
        # until it has, or a save cut short would leave old metadata over new shards —
        # a "complete" checkpoint of mixed state.
        if self.rank == 0:
            (step / ".metadata").unlink(missing_ok=True)
            self._remove_incomplete()
        dist.barrier(group=self.agree_pg)
        state = self._state(job)
        if self._stager is None:
            self._stager = HostStager(state, rank=self.rank, at_release=at_release_default())
        stager = self._stager
        # The stager's copies wait on this stream for the update of iteration t.
        # The writer is named: with none, torch picks one by trying its fsspec backend,
        # an import (fsspec's) in a promoted trainer's first iteration where fsspec is
        # installed. Leto's checkpoints are local directories.
        got = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(step),
            process_group=self.pg,
            async_stager=stager,
        )
        self.pending = getattr(got, "upload_completion", got)
        # The staged copy's future, from the stager itself: every torch version's
        # async_save returns its upload, not all return the staging as well, and the
        # next update must not change what is still being copied.
        self.staging = stager.last
        blocking_s = time.perf_counter() - t0
        self.last_t = t
        self.saves.append(
            {
                "iteration": t,
                "blocking_s": blocking_s,
                "scrub_s": scrub_s,
                "wait_s": 0.0,
                "interval": self.interval,
            }
        )
        if self._young:
            # Young's interval is set at the next iteration, once the save's own
            # iteration has been timed (its staging copy beside forward and backward,
            # the update's wait for it); nothing is saved before then.
            self.interval = 10**9
        self._prune()

    def _set_young_interval(self) -> None:
        """Young's interval from the first save's cost and the median iteration, at the
        iteration after the save (the last one timed is the save's); every rank calls it
        at the same iteration (a collective). The cost is what the save's iteration took
        over the median of the others, where there are others (the staging copy can cost
        the next iteration time that no wait of the loop measures: 270 ms at 128 K tokens
        on an H100 with the copies queued at the save, docs/benchmarks.md), at least the
        save's blocking part; with no other iteration timed, the stall (``cost_s``)."""
        save, others = self.saves[0], self._t_iter[:-1]
        t_iter = statistics.median(others or self._t_iter)
        p_s = self.cost_s(save)
        if others:
            # The save's iteration over the median, and at least the loop's stall before
            # the save's call returned (the scrub's device work is extra work). Not the
            # staging wait: the host waits there while the device still runs the
            # forward and backward it was given (on an H100 at 16 K tokens: a 93 ms
            # wait in an iteration 20 ms over the median).
            p_s = max(save["blocking_s"], self._t_iter[-1] - t_iter)
        save["cost_s"] = p_s
        p = p_s / t_iter
        young = young_interval(p, self.ff_mttf_s, t_iter)
        mine = max(1, round(young)) if math.isfinite(young) else 10**9
        # Every rank must save at the same iterations (a save is collective), but each
        # measured its own costs: agree on the largest interval. Same call on every
        # rank at the same iteration, in the main thread, on a group of its own.
        agreed = torch.tensor([float(mine)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.agree_pg)
        self.interval = int(agreed.item())
        self.saves[0]["interval"] = self.interval
        self._young = False
        if self.store is not None and self.rank == 0:
            self.store.set(keys.CHECKPOINT_INTERVAL, str(self.interval))  # for joiners

    def summary(self) -> str:
        """The saves of this trainer's life, for the rank's log: when, at what interval
        and why (Young's from the first save's cost, or fixed), what each stalled the
        loop (its scrub, its staging wait), and how many due saves were put off."""
        if not self.saves:
            return "no save" + (f", {len(self.deferred)} put off" if self.deferred else "")
        its = [s["iteration"] for s in self.saves]
        how = f"fixed at {self.fixed}" if self.fixed else f"Young's {self.interval}"
        blocking = ", ".join(
            f"{1e3 * self.cost_s(s):.1f} (scrub {1e3 * s['scrub_s']:.1f}, staging "
            f"{1e3 * s['wait_s']:.1f})"
            for s in self.saves[:3]
        )
        first = self.saves[0].get("cost_s")
        return (
            f"{len(its)} saved (iteration {', '.join(map(str, its[:4]))}"
            f"{', ...' if len(its) > 4 else ''}), interval {how}"
            + (
                f" (a save's cost {1e3 * first:.0f} ms: the first save's iteration over the "
                "median, at least its blocking part)"
                if first
                else ""
            )
            + f", the loop stalled {blocking} ms"
            + (f", put off {len(self.deferred)} times (one in flight)" if self.deferred else "")
            + (
                f", {len(self.failed)} not written (iteration "
                f"{', '.join(str(f['iteration']) for f in self.failed[:4])}: {self.failed[0]['error']})"
                if self.failed
                else ""
            )
        )

    def begin_iteration(self) -> None:
        """Call once the next iteration has made its first writes to the host (the
        marker's, the scrub's flags): the last save's staging copies start now, beside
        its forward and backward, not queued ahead of those writes (``leto.trainer.
        staging``: they would wait for all 13 GB)."""
        if self._stager is not None:
            self._stager.release()

    def before_update(self, timeout_s: float = 600.0) -> None:
        """Call before the retained state changes (the next update, the loop record's
        write): the last save's staging copies must have read it. Normally long done:
        it overlapped a forward and backward."""
        if self._stager is not None:
            self._stager.release()  # (an iteration that did not begin: now)
        if self.staging is not None:
            staging, self.staging = self.staging, None
            t0 = time.perf_counter()
            staging.result(timeout=timeout_s)
            self.saves[-1]["wait_s"] += time.perf_counter() - t0

    @staticmethod
    def cost_s(save: dict) -> float:
        """What a save stalled the loop: its blocking part in ``after_iteration`` (the
        checks settled, the full scrub, the barrier, DCP's call) and the next update's
        wait for its staging copy."""
        return save["blocking_s"] + save["wait_s"]

    def _prune(self) -> None:
        if self.rank != 0:
            return
        done = sorted(p for p in self.root.glob("it*") if (p / ".metadata").exists())
        for p in done[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def drain(self) -> None:
        """Wait until the last save is staged and written (a failed write is said, not
        raised: ``_settle_write``)."""
        self.before_update()
        if self.pending is not None:
            self._settle_write()

    def _settle_write(self, at_end: bool = False) -> None:
        """The last save's write, waited for: a failure (a full disk, a lost mount) is
        said on the console and counted, not raised. The checkpoint is insurance: the
        training's state is intact in the pool, ``latest`` passes over a save with no
        metadata, and the next save is tried at its interval. Raised, it ended the
        trainer, and every promoted shadow after it, on a full disk (seen on an H100)."""
        pending, self.pending = self.pending, None
        t = self.saves[-1]["iteration"]
        try:
            pending.result(timeout=WRITE_TIMEOUT_S)
            return
        except FutureTimeout:
            why = f"not written within {WRITE_TIMEOUT_S:.0f} s"
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - whatever the writer raised
            why = _why(e)
        self.failed.append({"iteration": t, "error": why})
        found = latest(self.root)
        if at_end:
            # Training is complete: the checkpoint was only insurance during it.
            self.close_error = why
            rank_log.tell(
                self.rank,
                f"the last checkpoint (iteration {t}) was not written after training "
                f"ended ({why}); the trained state is intact in the pool, the newest "
                f"complete checkpoint under {self.root} is "
                + (f"iteration {found[1]}'s" if found else "none"),
            )
            return
        message = (
            f"the checkpoint of iteration {t} was not written ({why}); training goes on, "
            f"its state intact in the pool. A fatal failure would restart from "
            + (f"the checkpoint of iteration {found[1]}" if found else "the first iteration")
            + "; the next save is tried at its interval"
        )
        if len(self.failed) == 1:
            rank_log.tell(self.rank, message + " (any further failure: in this rank's log)")
        else:
            rank_log.say(self.rank, message)

    def _remove_incomplete(self) -> None:
        """Rank 0, once every rank's last write is done (the save's agreement): the
        folders of saves that were not completed (no metadata) go, as the files a failed
        write left would fill the disk that made it fail."""
        for p in self.root.glob("it*"):
            if p.is_dir() and not (p / ".metadata").exists():
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        """At the end of training: wait for the last save, release the buffers. A failure
        here is reported, not raised: the training is complete, and the checkpoint was
        only insurance against a fatal failure during it (raised, it would end a
        finished job as a failed trainer, and a promoted shadow would run the script's
        set-up again for nothing — seen on the H200)."""
        try:
            self.before_update()
            if self.pending is not None:
                self._settle_write(at_end=True)
            if self._warming is not None:
                self._warming.result()
            if self._stager is not None:
                self._stager.shutdown()
        except Exception as e:  # noqa: BLE001 - any error of the insurance's last save
            import traceback

            print(
                f"rank {self.rank}: the last checkpoint save or its cleanup failed after "
                f"training ended ({type(e).__name__}: {e}); the trained state is intact "
                f"in the pool, the newest complete checkpoint under {self.root} is older:\n"
                + traceback.format_exc(),
                file=sys.stderr,
                flush=True,
            )
            self.close_error = f"{type(e).__name__}: {e}"
        finally:
            self._warming = None
            self._stager = None


def restore(path: Path, iteration: int, job) -> None:
    """Load ``path`` into this rank's retained state (a fresh pool) and protect it: the
    marker then says iteration ``iteration`` is done."""
    rank = job.rank

    def load():
        # in place, into the pool's pages; the reader named, as the writer is in save()
        dcp.load(_tensors(job, rank), storage_reader=dcp.FileSystemReader(path))
        if getattr(job, "loop", None) is not None:
            job.loop.restored()

    job.up.initialize(load, iteration=iteration)


def _tensors(job, rank: int) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of a rank: its retained tensors and, under ``leto.Run``,
    the loop record (hyperparameters, LR scheduler, the script's state) and the data
    records. (Their parity: ``restore`` re-encodes every group after the load.)"""
    st = job.up.state
    out = {f"rank{rank}.{k}": v[: st.local_valid] for k, v in st.flat.items()}
    if getattr(job, "loop", None) is not None:
        for k, rec in enumerate(job.loop.records):
            out[f"rank{rank}.loop{k}"] = rec
    if getattr(job, "data", None) is not None:  # the data position (leto.Run's data=)
        for k, rec in enumerate(job.data.records):
            out[f"rank{rank}.data{k}"] = rec
    return out
