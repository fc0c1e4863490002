"""Replica agreement: data-parallel replicas compare a digest of their retained state
after every update, so a wrong computation on one rank (a silent data corruption in
the optimizer's arithmetic or in a gradient it read) is found in the iteration it
happened, before a checkpoint or a later iteration trusts that state.

Runs in the trainer (``leto.trainer.retained``): an update's digests are copied to the
host in stream order (pinned memory behind an event on a GPU) and compared at the start
of the next iteration's step — before anything of it can fail and before its update
reads that state — and before every checkpoint and at the end of training; the host
never waits for an update to finish. The digest is taken
from the tier-1 parity each rank keeps per protection group (``leto.update.rmu``): a
linear function of every byte of the group's data pages, identical across replicas that
hold identical bytes in identical layouts. The updater reduces each group's parity, on
the device where it already is, to one 64-bit word (``group_digest``: the sum of its
8-byte words, modulo 2^64); the ranks exchange the words in one ``all_gather`` of
``8 x groups`` bytes on a gloo group of their own. Equal: training goes on. Different:
the digest cannot tell a wrong parity page (harmless, repaired in place by the scrub)
from wrong data, so every rank first scrubs the groups that differ (a parity error is
repaired, a data page that disagrees with its parity is the scrub's own fatal
``CorruptState``) and the ranks compare again; still different: ``ReplicaDisagreement``
(a ``FatalFailure``): every rank exits fatal, the job falls back to the last verified
checkpoint and redoes the iterations from there.

Which rank is wrong: at world >= 3 the ranks outside the strict majority are named; at
world 2 (or with no strict majority) both sides are, and the fallback's redo names one:
each rank logged every rank's digests with the disagreement, and when the redone
iteration's replicas agree, the ranks whose logged digests differ from the agreed ones
computed wrong — a recomputation on the same GPUs, right for a transient fault (a GPU
that computes wrong every time disagrees again, and the job stops on the repeat).

Not covered: sharded state — FSDP2, tensor or pipeline parallel jobs and ZeRO-1
shards have no replica, and the check is skipped there (``leto.integrity.recheck``
recomputes a sampled chunk of their update instead); nor is it run for a mixture of
experts with rank-local experts (DDP's ignore list): their pages share protection groups
with the replicated state, so no group's digest is comparable across ranks; an update that a recovery
finished (its digest covers only the groups it redid; the next iteration's check covers
the whole state again); a corruption that flips the same bits on every replica; a digest
collision (a data flip changes H1 parity words, and their signed changes would have to
sum to 0 modulo 2^64); an update whose check was still pending when a failure struck
(the new trainers have nothing to compare for it; the next iteration's check covers the
whole state again).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from leto import rank_log
from leto.errors import FatalFailure, WrongComputation

ENV_REPLICA_CHECK = "LETO_REPLICA_CHECK"  # "0": leto run --no-replica-check


def enabled() -> bool:
    """Whether ``leto run`` left the check on (the default)."""
    return os.environ.get(ENV_REPLICA_CHECK, "1") != "0"


class ReplicaDisagreement(WrongComputation, FatalFailure):
    """Data-parallel replicas hold different state after an update: the iteration's
    state is not trusted (the checkpoint fallback redoes it)."""


def group_digest(parity: torch.Tensor) -> torch.Tensor:
    """One group's tier-1 parity (a flat uint8 tensor, a multiple of 8 bytes) as a 0-d
    int64 tensor on its device: the sum of its little-endian 8-byte words modulo 2^64
    (torch's integer sum wraps). Every single-bit change of the parity changes it."""
    return parity.view(torch.int64).sum()


def group_digest_reference(parity: torch.Tensor) -> int:
    """``group_digest``, slowly and obviously: Python integers, reduced to a signed
    64-bit value."""
    raw = bytes(parity.cpu().numpy().tobytes())
    total = sum(int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8))
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


def suspects(digests: list[tuple[int, ...]]) -> tuple[list[int], bool]:
    """The ranks to name for ``digests`` (one tuple per rank): ([], _) when all agree;
    else (ranks outside a strict majority, True), or (every rank, False) when no strict
    majority exists (world 2: one against one)."""
    counts = Counter(digests)
    if len(counts) == 1:
        return [], True
    top, n = counts.most_common(1)[0]
    if 2 * n > len(digests):
        return [r for r, d in enumerate(digests) if d != top], True
    return list(range(len(digests))), False


def _differing(rows: list[tuple[int, ...]]) -> list[int]:
    """The positions (groups) where any rank's words differ."""
    return [i for i, col in enumerate(zip(*rows, strict=True)) if len(set(col)) > 1]


class ReplicaCheck:
    def __init__(
        self,
        rank: int,
        world: int,
        log: Path | None = None,
        timeout_s: float = 600.0,
        pg=None,
        members: tuple[int, ...] | None = None,
    ):
        """Collective (makes a gloo group): every rank of the job, data parallel over all
        of them — or, given ``pg`` (a gloo group) and its ``members`` (global ranks), the
        replicas of one data-parallel group smaller than the world (tensor × data
        parallel). ``log``: a file each disagreement is appended to (one JSON line)."""
        self.members = tuple(members) if members is not None else tuple(range(world))
        self.rank, self.world, self.log = rank, len(self.members), log
        self.pg = pg or dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.checks = 0
        self.check_s = 0.0  # time spent in check(), this process
        # Disagreements no majority named (world 2), by iteration: every rank's digests,
        # from the log (a fallback's new trainer reads what the failed one wrote).
        self._pending: dict[int, list[list[int]]] = {}
        if log is not None and Path(log).exists():
            for line in Path(log).read_text().splitlines():
                rec = json.loads(line)
                if rec.get("resolved"):
                    self._pending.pop(rec["iteration"], None)
                elif not rec.get("majority", True) and "digests" in rec:
                    self._pending[rec["iteration"]] = rec["digests"]

    def _gather(self, digests: torch.Tensor | None, n: int, flag: int = 0):
        """Every rank's ``n`` digests (None: a rank without them, e.g. a trainer that
        took over mid-job: zeros, marked invalid), whether each had them, and every
        rank's ``flag`` (the loss guard's, ``leto.integrity.loss_guard``)."""
        words = torch.zeros(n, dtype=torch.int64) if digests is None else digests
        mine = torch.cat(
            [
                words.to("cpu", torch.int64).reshape(-1),
                torch.tensor([int(digests is not None), flag], dtype=torch.int64),
            ]
        )
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.pg)
        rows = [tuple(int(x) for x in d) for d in every]
        return [r[:-2] for r in rows], [r[-2] for r in rows], [r[-1] for r in rows]

    def check(
        self,
        t: int,
        digests: torch.Tensor | None,
        gids: list[int],
        recheck: Callable[[list[int]], torch.Tensor] | None = None,
        flag: int = 0,
    ) -> list[int]:
        """Compare this rank's per-group ``digests`` (int64, one per state group; None:
        this rank has none for iteration ``t``, and nothing is compared) of iteration
        ``t`` with every replica's; raise ``ReplicaDisagreement`` on any difference
        (every rank raises: they all see the same words). ``recheck(groups)`` (indices
        into ``digests``): scrub those groups, return the digests again — called on
        every rank alike when they differ, before the second comparison. ``flag``
        travels in the same collective: the ranks whose flag is set are returned (and
        the digests not compared: the caller fails the iteration on every rank)."""
        t0 = time.perf_counter()
        rows, valid, flags = self._gather(digests, len(gids), flag)
        self.checks += 1
        self.check_s += time.perf_counter() - t0
        if any(flags):
            return [self.members[r] for r, f in enumerate(flags) if f]
        if not all(valid):
            return []
        named, majority = suspects(rows)
        if named and recheck is not None:
            rows, _, _ = self._gather(recheck(_differing(rows)), len(gids))
            named, majority = suspects(rows)
        named = [self.members[i] for i in named]  # global ranks
        if not named:
            if t in self._pending:
                self._resolve(t, rows[0])
            return []
        differ = sorted(gids[i] for i in _differing(rows))
        if majority:
            who = (
                f"rank(s) {named} disagree with the majority of the {self.world} replicas: "
                f"they computed wrong"
            )
        else:
            who = (
                f"ranks {named} disagree and no majority names one (world {self.world}): the "
                f"fallback's redo of iteration {t} will tell which computed wrong"
            )
        if self.log is not None:
            rec = {
                "iteration": t, "named": named, "majority": majority, "groups": differ,
                "world": self.world, "digests": [list(r) for r in rows], "time": time.time(),
            }  # fmt: skip
            with open(self.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        raise ReplicaDisagreement(
            f"iteration {t}: data-parallel replicas hold different retained state after "
            f"the update (tier-1 parity digests differ in state group(s) {differ}, also "
            f"after a scrub of them): {who}. "
            f"Nothing of this iteration is trusted; the job falls back to its last "
            f"verified checkpoint and redoes the iterations from there",
            iteration=t,
            named=named if majority else (),  # world 2: the redo names one (not counted)
        )

    def _resolve(self, t: int, agreed: tuple[int, ...]) -> None:
        """Iteration ``t`` redone and agreed after a disagreement no majority named: the
        ranks whose digests then differed from the agreed ones are named (logged, and
        said on stderr)."""
        before = self._pending.pop(t)
        named = [self.members[r] for r, row in enumerate(before) if list(row) != list(agreed)]
        rec = {"iteration": t, "resolved": True, "named": named, "by": "redo", "time": time.time()}
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        rank_log.tell(
            self.rank,
            f"replica check: iteration {t} redone and agreed; rank(s) {named} held "
            f"different state after its first computation: they computed wrong",
        )
