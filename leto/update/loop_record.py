"""The script's small loop state, retained beside the model: what a recovery needs to
continue the loop exactly besides tensors.

Runs in the trainer. At every ``optimizer.step()`` of iteration t, before its gradients
are protected, the record of t is written: each parameter group's hyperparameters for
t (what the update uses — a recovery that finishes t's interrupted update needs them),
the LR scheduler's ``state_dict()`` at that moment and the script's own small state
(``Run.state``: e.g. the best validation loss, the data loader's position).

Two pool records (host pages, parity-protected like the progress marker: a record page
whose parity pages are byte copies), one per iteration parity: t's record goes to slot
``t % 2``, so t - 1's stays intact while t's is written and a write torn by a crash
leaves a slot that fails its CRC. Each slot: magic, iteration, length, CRC-32, then the
pickled payload.
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib

import torch

from leto.errors import InvalidInput
from leto.memory.client import PoolClient
from leto.memory.config import AllocationKind

NAMES = ("leto.loop.0", "leto.loop.1")
MAGIC = 0x4C4F4F50  # "LOOP"
_HEAD = struct.Struct("<IqII")  # magic, iteration, payload length, crc32 of the payload


class LoopRecord:
    def __init__(self, client: PoolClient):
        """Attaches the records (the updater does, before it reads the pool's layout,
        which needs every allocation attached)."""
        nbytes = client.config.record_page_bytes
        self.client = client
        self.records = [client.attach(n, nbytes, kind=AllocationKind.RECORD) for n in NAMES]
        self._mirrors: list[list[torch.Tensor]] | None = None
        self.capacity = nbytes - _HEAD.size

    def bind(self, views: list) -> None:
        """Take the records' parity pages from a layout the caller has already built
        (the updater's): fetching one here at the first write cost a promoted trainer a
        LAYOUT request and a view of every page in its first iteration."""
        out = []
        for n in NAMES:
            (g,) = [g for g in views if any(m[0] == n for m in g.members)]
            if len(g.tier1) != 1:
                raise ValueError("the loop record needs record_parity_pages=1 (XOR parity)")
            out.append([*g.tier1, *g.tier2])
        self._mirrors = out

    @property
    def mirrors(self) -> list[list[torch.Tensor]]:
        if self._mirrors is None:  # not bound: this record's own layout
            self.bind(self.client.layout())
        return self._mirrors

    def write(self, iteration: int, payload: dict) -> None:
        buf = io.BytesIO()
        pickle.dump(payload, buf, protocol=pickle.HIGHEST_PROTOCOL)
        body = buf.getvalue()
        if len(body) > self.capacity:
            raise InvalidInput(
                f"the loop state of iteration {iteration} (hyperparameters, LR scheduler, "
                f"Run.state) pickles to {len(body)} bytes; a record holds {self.capacity}. "
                f"Keep Run.state small (tensors belong in the model); nothing was written"
            )
        raw = _HEAD.pack(MAGIC, iteration, len(body), zlib.crc32(body)) + body
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        k = iteration % 2
        # Record first, then its parity copies: a crash in between leaves the parity one
        # write behind, which a lost record page then rebuilds as the older record.
        for t in (self.records[k], *self.mirrors[k]):
            t[: len(raw)].copy_(data)

    def restored(self) -> None:
        """The records were loaded in place (a checkpoint): bring their parity along."""
        for rec, mirrors in zip(self.records, self.mirrors, strict=True):
            for m in mirrors:
                m[: rec.numel()].copy_(rec)

    def read(self, iteration: int) -> dict | None:
        """The payload written for ``iteration``, or None (never written, torn, or
        overwritten by iteration + 2)."""
        if iteration < 0:
            return None
        rec = self.records[iteration % 2]
        head = bytes(rec[: _HEAD.size].numpy())
        magic, it, n, crc = _HEAD.unpack(head)
        if magic != MAGIC or it != iteration or n > self.capacity:
            return None
        body = bytes(rec[_HEAD.size : _HEAD.size + n].numpy())
        if zlib.crc32(body) != crc:
            return None
        return pickle.loads(body)
