"""Gradient buckets all-reduced while backward runs, over the retained gradient buffer.

Runs in the trainer. The retained gradients are one flat buffer with the parameters in
model order; backward produces them roughly in reverse. The buffer is cut, from its end,
into buckets of about ``bucket_mib`` (DDP's default is 25 MiB) at parameter boundaries,
so each bucket is one contiguous range. A post-accumulate-grad hook on every parameter
counts the parameters of its bucket; a complete bucket is all-reduced asynchronously
(sum) while backward goes on. Buckets are launched strictly in index order — a bucket
that completes early waits for the ones before it — so every rank issues the same
collectives in the same order whatever order autograd finishes parameters in; ``finish``
launches what backward did not complete (unused parameters), in order, and waits for
all of them (each wait bounded by the process group's timeout).

``finish`` also divides the sums by the world size (the mean, after the sum). Under the
script's own optimizer (``at_backward_end``) it runs when the synchronized backward
ends, queued on the autograd engine as DDP does, so the script's own clipping between
backward and ``optimizer.step()`` sees reduced gradients.

Exactness: the fault-free run and every recovered run cut the same buckets and sum them
with the same collective, so their bytes agree; with two ranks a bucket's sum is the
whole buffer's sum (a + b either way).

Rank-local parameters (``rank_local``: a mixture of experts' experts, each on one rank
under expert parallelism; DDP's ignore list names them) are left out: a bucket never
spans one, and their gradients are neither summed nor divided.

Not covered: gradient parity per bucket as it is reduced (the parity groups do not
follow the buckets; parity is encoded after ``finish``); overlapping the reduction with
the optimizer of the previous iteration.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from leto.update.layout import RetainedModel


class GradBuckets:
    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        state: RetainedModel,
        bucket_mib: float,
        at_backward_end: bool = False,
        rank_local: frozenset[str] = frozenset(),
        group=None,
    ):
        """``params``: the retained parameters by name (``RetainedModel.bind``).
        ``rank_local``: parameters whose gradients are this rank's own (a mixture of
        experts' experts under expert parallelism): never reduced nor divided, and no
        bucket spans one. ``group``: the data-parallel group reduced over (None: the
        world)."""
        self.group = group
        grad = state.grad
        esize = grad.element_size()
        limit = max(1, int(bucket_mib * 2**20) // esize)
        slots = [s for s in state.slots if s.trainable]  # frozen ones get no gradient
        self.grad = grad
        self.ranges: list[tuple[int, int]] = []  # [a, b) of the flat gradient, per bucket
        self._members: list[int] = []  # parameters per bucket
        bucket_of: dict[str, int] = {}
        end = state.numel
        count = 0
        start = end
        for slot in reversed(slots):
            if slot.name in rank_local:  # closes the bucket below it
                if count:
                    self.ranges.append((start, end))
                    self._members.append(count)
                end, count = slot.offset, 0
                continue
            start = slot.offset
            bucket_of[slot.name] = len(self.ranges)
            count += 1
            if end - start >= limit:
                self.ranges.append((start, end))
                self._members.append(count)
                end, count = start, 0
        if count:
            self.ranges.append((start if rank_local else 0, end))
            self._members.append(count)
        self._whole = not rank_local  # the buckets cover the whole buffer
        self._ready = [0] * len(self.ranges)
        self._next = 0  # the next bucket to launch (index order)
        self._works: list = []
        self._sync = True
        # DDP's require_backward_grad_sync as the DDP-shaped model's last forward with
        # autograd on saw it (leto.trainer.ddp_shape): DDP decides at the forward whether
        # its backward reduces, so a script may leave no_sync() before calling backward.
        self.forward_sync = True
        self._at_end = at_backward_end
        self._queued = False
        self.reduced = False  # this iteration's gradients are summed and averaged
        # Called with each bucket's view just before its all-reduce launches (the local
        # gradient's last moment: a wrong-computation seam and gradient replay's digest).
        self.before_launch = None
        # Called as ``finish`` begins, before the buckets backward did not complete are
        # launched (leto.trainer.grad_landing: a parameter no backward reached gets its
        # view zeroed first, or its bucket would carry the last iteration's gradient).
        self.before_finish = None
        self._hooks = []
        for name, b in bucket_of.items():
            self._hooks.append(params[name].register_post_accumulate_grad_hook(self._hook(b)))

    def _hook(self, b: int):
        def ready(_param: torch.Tensor) -> None:
            if not (self._sync and self.forward_sync):
                return
            if self._at_end and not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._ready[b] += 1
            self._launch_ready()

        return ready

    def _launch_ready(self) -> None:
        while (
            self._next < len(self.ranges) and self._ready[self._next] >= self._members[self._next]
        ):
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        a, e = self.ranges[b]
        if self.before_launch is not None:
            self.before_launch(self.grad[a:e])
        self._works.append(dist.all_reduce(self.grad[a:e], group=self.group, async_op=True))
        self._next = b + 1

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside does not reduce (micro-batches before the last)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish(self) -> None:
        """Launch, in order, every bucket backward did not; wait for all; divide by the
        world size; reset."""
        if self.before_finish is not None:
            self.before_finish()
        try:
            while self._next < len(self.ranges):
                self._launch(self._next)
            for w in self._works:
                w.wait()
        finally:
            self._works = []
            self._ready = [0] * len(self.ranges)
            self._next = 0
            self._queued = False
        world = dist.get_world_size(self.group)
        if self._whole:
            self.grad.div_(world)
        else:
            for a, e in self.ranges:
                self.grad[a:e].div_(world)
        self.reduced = True

    def begin(self) -> None:
        """A new iteration: nothing reduced yet."""
        self.reduced = False
