"""The ranks that hold replicas of this rank's parameters: the whole world, or a
data-parallel group smaller than it (Megatron's tensor × data parallelism: the ranks of one
tensor-parallel position).

Runs in a trainer, made by ``leto.Run``. Leto's gradient reduction averages over these
ranks, the identical-start check and the replica check compare them, and gradient replay
(which recomputes another rank's micro-batch alone) runs only where they are the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class DPGroup:
    group: object  # a ProcessGroup; None: the world
    ranks: tuple[int, ...]  # global ranks, in group order

    @classmethod
    def world(cls, world_size: int) -> DPGroup:
        return cls(None, tuple(range(world_size)))

    @classmethod
    def of(cls, group) -> DPGroup:
        return cls(group, tuple(dist.get_process_group_ranks(group)))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def whole_world(self) -> bool:
        return self.group is None

    def gloo(self, timeout_s: float):
        """A gloo group over the same ranks (the checks' host-side collectives). Collective
        over the world: every rank makes every data-parallel group's, as torch requires."""
        timeout = timedelta(seconds=timeout_s)
        if self.whole_world:
            return dist.new_group(backend="gloo", timeout=timeout)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, list(self.ranks))
        groups = sorted({tuple(r) for r in every})
        mine, _ = dist.new_subgroups_by_enumeration(
            [list(g) for g in groups], timeout=timeout, backend="gloo"
        )
        return mine
