"""The loss guard: a non-finite loss on any rank makes the iteration untrusted, on every
rank alike.

Runs in the trainer, after the update of an iteration is queued (``RetainedTraining.step``).
A NaN or an infinity in the loss the script recorded (``run.record_loss``) is what a wrong
computation often leaves behind — a flipped exponent bit in an activation — and what a
diverging model produces. Either way the iteration's update read gradients that cannot
be trusted. The ranks agree on it in the collective they already make: the replica
check's ``all_gather`` carries one more word, the flag (``leto.integrity.replica``); where
that check does not run (sharded state, rank-local experts, ``--no-replica-check``) in an
``all_gather`` of its own on a gloo group; at world 1 nothing is exchanged. On a GPU the
loss is read from the pinned copy the loss log already waits for (it waits for backward,
not for the update): the guard adds no synchronisation.

Flagged anywhere: ``NonFiniteLoss`` (a ``FatalFailure``) on every rank — the job falls
back to its last verified checkpoint and redoes the iterations from there (a transient
fault does not recur). The same failure again falls back to an older checkpoint, and a
third time ``leto run`` stops the job (its rule for a fatal failure that repeats): then
the training itself diverged.

Off under a ``torch.amp.GradScaler`` (fp16: infinite gradients are its business, and it
skips those steps) and with ``leto run --no-loss-guard``. Not covered: non-finite
gradients under a finite loss (checking every gradient reads them all: ~1.5 ms of a 1 B
model's iteration on an H200, over the 0.5 % budget); an iteration without a recorded
loss.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from leto.errors import FatalFailure

ENV_LOSS_GUARD = "LETO_LOSS_GUARD"  # "0": leto run --no-loss-guard


def enabled() -> bool:
    return os.environ.get(ENV_LOSS_GUARD, "1") != "0"


class NonFiniteLoss(FatalFailure):
    """A rank's loss was NaN or infinite: the iteration is not trusted on any rank."""


def flagged_ranks(flags: list[int]) -> list[int]:
    return [r for r, f in enumerate(flags) if f]


class LossGuard:
    def __init__(self, rank: int, world: int, timeout_s: float = 600.0):
        """Collective when ``world`` > 1 (makes a gloo group for its own exchange)."""
        self.rank, self.world = rank, world
        self.pg = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            if world > 1
            else None
        )

    def agree(self, bad: bool) -> list[int]:
        """The ranks whose loss was not finite (an ``all_gather`` of one word)."""
        if self.pg is None:
            return [self.rank] if bad else []
        mine = torch.tensor([int(bad)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.pg)
        return flagged_ranks([int(x) for x in every])

    def fail(self, t: int, ranks: list[int], value: float) -> None:
        mine = f" (this rank's: {value!r})" if self.rank in ranks else ""
        raise NonFiniteLoss(
            f"iteration {t}: the loss is not finite on rank(s) {ranks}{mine}: a wrong "
            f"computation, or the model diverging. Nothing of this iteration is trusted; "
            f"the job falls back to its last verified checkpoint and redoes the iterations "
            f"from there (the same failure again falls back further, a third time stops the "
            f"job: the training itself diverged). leto run --no-loss-guard turns this "
            f"check off"
        )
