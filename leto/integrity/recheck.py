"""The update recheck: where no replica holds the same state, one sampled chunk of every
update is computed again from its undo copy and compared bit for bit.

Runs in the trainer, inside the update (``leto.update.rmu``). Data-parallel replicas
check each other's updates (``leto.integrity.replica``); a rank whose state no other rank
holds — a job of one rank, FSDP2 / tensor-parallel / pipeline shards, ZeRO-1's
optimizer shards, a mixture's rank-local experts — has nobody to compare with, so it
recomputes: after a chunk's optimizer step (before its parity absorbs it on the unfused
steps; after the fused pass, which absorbs as it computes), the chunk's state is summed as
integer words (every single flipped bit changes the sum), the chunk is restored from its
undo copy and stepped again by the script's optimizer (torch's own step, which the fused
pass matches bit for bit), and summed again. The comparison is left on the device (copied to
pinned host memory behind an event) and read at a later update once the device has passed
it — the host never waits for it there — and, waiting, before a checkpoint and at the end
of training. A difference: ``WrongUpdate``, a fatal
failure — the job falls back to its last verified checkpoint, which predates it, and
redoes the iterations. Each finding is a line of ``rank<r>.recheck.jsonl``.

Settling a disagreement (the alarm policy, docs/integrity.md): a difference that repeats
bit for bit after the rollback is no evidence of a faulty device — a computation that is
wrong the same way twice is software, not hardware. So the redo does not compare two
computations again: when it reaches the iteration and chunk its log names, the updater
settles the chunk synchronously with a third, independent computation — torch's step on
copies of the undo copy, out of place — and keeps what two of the three agree on
(``Updater._settle``). Where the recheck's own computation is the odd one out, the
recheck is off for the rest of the job (one console line, the evidence in
``rank<r>.recheck-evidence.json``) and the job goes on; where the first computation is
(the fused chunk pass), the chunk is redone by the unfused steps and the fused pass is off
for the rest of the job, likewise said; where all three agree, the first finding was
transient (a device named once, as before); where all three differ, ``WrongUpdate``.
Nothing of a settled disagreement names a device, so none is recorded as faulty.

Sampling: one chunk an iteration, chunk ``t mod chunks`` (counted over every group), so
every chunk is rechecked once every ``chunks`` iterations; ``LETO_UPDATE_RECHECK=all``
rechecks every chunk (faultkit's ``sdc-update`` on such jobs, so that the struck chunk is
one), ``0`` none. A crash during a recheck is a crash in the chunk's update: the chunk is
reverted from its undo copy and redone, as for any in-flight chunk.

Not covered: the built-in AdamW of the example workload (``leto.workload``; leto.Run
scripts only); the chunks not sampled (a transient flip in an update is found with
probability 1 / chunks); a fault that makes both computations wrong alike.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from leto import rank_log
from leto.errors import FatalFailure, WrongComputation

ENV_UPDATE_RECHECK = "LETO_UPDATE_RECHECK"  # "1" one chunk an iteration, "all", "0"


class WrongUpdate(WrongComputation, FatalFailure):
    """A chunk's update differs from its recomputation: the iteration's state is not
    trusted (the checkpoint fallback redoes it)."""


def mode() -> str:
    m = os.environ.get(ENV_UPDATE_RECHECK, "1")
    if m not in ("0", "1", "all"):
        raise ValueError(f"{ENV_UPDATE_RECHECK}={m!r}: expected 0, 1 or all")
    return m


def words_sum(regions: list[torch.Tensor]) -> torch.Tensor:
    """The regions' bytes (uint8, multiples of 8 bytes) summed as int64 words, on their
    device (a 0-d tensor)."""
    total = None
    for r in regions:
        d = r.view(torch.int64).sum()
        total = d if total is None else total + d
    return total


class Recheck:
    def __init__(self, rank: int, chunks: int, log: Path | None, every: bool = False):
        """``chunks``: the update's chunks over every group (the sampling's period);
        ``every``: recheck every chunk. Findings an earlier generation logged (``log``)
        and did not settle are settled when the redo reaches them (``must_settle``)."""
        self.rank, self.chunks, self.log, self.every = rank, chunks, log, every
        self.checked = 0
        self.off: str | None = None  # why the recheck is off for the rest of the job
        self.on_notice = None  # (text) -> None: a line for the console (leto.Run sets it)
        # (t, group, chunk, flag, the event after its host copy: None on the CPU)
        self._pending: list[tuple[int, int, int, torch.Tensor, object]] = []
        self.to_settle: set[tuple[int, int, int]] = set()
        if log is not None and log.exists():
            for line in log.read_text().splitlines():
                rec = json.loads(line)
                key = (rec["iteration"], rec["group"], rec["chunk"])
                if rec.get("settled"):
                    self.to_settle.discard(key)
                elif rec.get("rank") == rank:
                    self.to_settle.add(key)

    def due(self, t: int, ordinal: int) -> bool:
        """Whether the chunk that is the ``ordinal``-th of iteration ``t``'s update is
        rechecked."""
        return self.off is None and (self.every or ordinal == t % self.chunks)

    def must_settle(self, t: int, gi: int, j: int) -> bool:
        """Whether chunk ``j`` of group ``gi`` in iteration ``t`` disagreed before the
        rollback now being redone (it is settled by three computations, not rechecked)."""
        return self.off is None and (t, gi, j) in self.to_settle

    def settled(self, t: int, gi: int, j: int, verdict: str, evidence: dict) -> None:
        """Log a settled disagreement (``verdict``: transient, recheck, first or
        all-differ); the evidence goes to ``rank<r>.recheck-evidence.json``."""
        self.to_settle.discard((t, gi, j))
        rec = {"iteration": t, "group": gi, "chunk": j, "rank": self.rank, "settled": verdict,
               "time": time.time()}  # fmt: skip
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.evidence_path().write_text(json.dumps({**rec, **evidence}, indent=1))

    def evidence_path(self) -> Path:
        return self.log.with_name(f"rank{self.rank}.recheck-evidence.json")

    def switch_off(self, why: str) -> None:
        """The recheck is off for the rest of the job (its pending comparisons dropped)."""
        self.off, self._pending = why, []
        self.notice(f"update recheck off for the rest of the job: {why}")

    def notice(self, text: str) -> None:
        if self.log is not None:
            text += f" (evidence: {self.evidence_path()})"
        # On the console once: through the agent's notices where there is a job, else
        # from this rank's log.
        (rank_log.say if self.on_notice is not None else rank_log.tell)(self.rank, text)
        if self.on_notice is not None:
            self.on_notice(f"rank {self.rank}: {text}")

    def compared(self, t: int, gi: int, j: int, first: torch.Tensor, again: torch.Tensor):
        """The two sums of chunk ``j`` of group ``gi`` (device tensors): kept, read later.
        On a GPU the flag is copied to pinned host memory behind an event, so reading it
        never makes the host wait for the device (the loop's CPU stays ahead)."""
        self.checked += 1
        flag, ev = first != again, None
        if flag.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            flag = host
        self._pending.append((t, gi, j, flag, ev))

    def settle(self, wait: bool = True) -> None:
        """Read the comparisons made so far; ``WrongUpdate`` for the first that differed.
        ``wait=False`` (at each update): only those the device has finished, the rest
        stay for later; ``wait=True`` (a checkpoint, the end of training): every one."""
        pending, self._pending = self._pending, []
        for n, (t, gi, j, flag, ev) in enumerate(pending):
            if ev is not None and not wait and not ev.query():
                self._pending = pending[n:]  # in order: the device has not reached them
                return
            if ev is not None:
                ev.synchronize()
            if bool(flag):
                rec = {
                    "iteration": t,
                    "group": gi,
                    "chunk": j,
                    "rank": self.rank,
                    "time": time.time(),
                }
                if self.log is not None:
                    with open(self.log, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                raise WrongUpdate(
                    f"iteration {t}: rank {self.rank}'s update of chunk {j} of state group "
                    f"{gi} differs from its recomputation from the undo copy: a wrong "
                    f"computation on this rank. Nothing of this iteration is trusted; the "
                    f"job falls back to its last verified checkpoint and redoes the "
                    f"iterations from there",
                    iteration=t,
                    named=[self.rank],
                )
