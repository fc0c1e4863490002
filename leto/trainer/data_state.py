"""The script's data position, retained per iteration: ``leto.Run(..., data=loader)``.

Runs in a trainer, inside ``leto.Run``. Each object given as ``data=`` — torchdata's
``StatefulDataLoader``, a sampler, anything with ``state_dict()`` and
``load_state_dict()`` (duck-typed: Leto imports no data library) — has its
``state_dict()`` recorded when iteration t commits (at ``optimizer.step()``, before
t's gradients are protected: t's batches have been drawn), i.e. the position at the
start of t + 1. A recovery that resumes at n loads n - 1's record into each object before
the script iterates it again, so a shuffled, multi-worker loader resumes at the exact
next batch.

Two records, one per iteration parity as the loop record (``leto.update.loop_record``):
t's in slot ``t % 2``, so t - 1's stays intact while t's is written, and a write torn
by a crash fails its CRC. Each slot is a RECORD allocation of ``PAGES`` host pages, a
protection group of its own with XOR parity (tier 1: the XOR of its pages; tier 2, over
that one page: a copy), kept by the writer, so a lost page is rebuilt from the others.
A slot: magic, iteration, length, CRC-32, then the pickled list of state dicts.

Not in the loop record: a ``StatefulDataLoader``'s state with its generator pickles to
~6 KB, more than the loop record's page.

Not covered: a loop that draws the next iteration's batch from a loader before
``optimizer.step()`` (its record is a batch ahead: draw at the top of the iteration; a
batch *function* that prefetches is ``run.batches``'s, ``leto.trainer.batch_fn``); an
iterator made
before ``leto.Run`` (a ``StatefulDataLoader`` loads a state into its next iterator);
states larger than the record (``capacity``: the error says how large).
"""

from __future__ import annotations

import pickle
import struct
import zlib

import torch

from leto.errors import FatalFailure, InvalidInput
from leto.memory.client import PoolClient
from leto.memory.config import AllocationKind

NAMES = ("leto.data.0", "leto.data.1")
PAGES = 16  # host record pages per slot: 64 KiB at the default 4 KiB
MAGIC = 0x44415441  # "DATA"
_HEAD = struct.Struct("<IqII")  # magic, iteration, payload length, crc32 of the payload


def stateful(data) -> list:
    """``data=`` as a list of objects, each checked for ``state_dict``/``load_state_dict``."""
    objects = list(data) if isinstance(data, (list, tuple)) else [data]
    for i, o in enumerate(objects):
        if not (
            callable(getattr(o, "state_dict", None))
            and callable(getattr(o, "load_state_dict", None))
        ):
            raise InvalidInput(
                f"data={type(o).__name__}{f' (item {i})' if len(objects) > 1 else ''} has no "
                "state_dict()/load_state_dict(): give leto.Run a stateful loader (torchdata's "
                "StatefulDataLoader is a drop-in for torch's DataLoader) or sampler; nothing "
                "was retained"
            )
    return objects


def attach_first(report: dict) -> bool:
    """Whether to attach the records before the updater maps the pool's groups: when the
    pool holds allocations already (a promoted or restarted trainer: the updater maps
    every group, so every allocation must be attached first). On an empty pool they are
    attached after the updater's, so the state groups keep the numbers of a job without
    them (fault plans name groups by number)."""
    return report.get("pages_scanned", 0) > 0


class DataState:
    def __init__(self, client: PoolClient, objects: list, extra_bytes: int = 0):
        """``extra_bytes``: room beyond the 64 KiB for objects whose state is large
        (the model's running statistics); the same on every start of the rank."""
        self.client, self.objects = client, objects
        page = client.config.record_page_bytes
        pages = PAGES + -(-extra_bytes // page)
        self.records = [client.attach(n, pages * page, kind=AllocationKind.RECORD) for n in NAMES]
        self.capacity = pages * page - _HEAD.size
        self._pages: list[list[torch.Tensor]] = []  # per slot: its data pages (int64)
        self._parity: list[list[torch.Tensor]] = []  # per slot: tier 1, tier 2 (int64)

    def bind(self, views: list | None = None) -> None:
        """Take each slot's group from a layout (None: fetch one: the records were attached
        after the updater's)."""
        views = views if views is not None else self.client.layout()
        for n in NAMES:
            (g,) = [g for g in views if any(m[0] == n for m in g.members)]
            if len(g.tier1) != 1 or len(g.tier2) != 1:
                raise ValueError("the data record needs record_parity_pages=1 (XOR parity)")
            self._pages.append([p.view(torch.int64) for p in g.data])
            self._parity.append([g.tier1[0].view(torch.int64), g.tier2[0].view(torch.int64)])

    def write(self, t: int) -> None:
        """Record each object's state as iteration ``t`` commits."""
        body = pickle.dumps([o.state_dict() for o in self.objects], pickle.HIGHEST_PROTOCOL)
        if len(body) > self.capacity:
            raise InvalidInput(
                f"the data state of iteration {t} (the state_dict() of data=) pickles to "
                f"{len(body)} bytes; the data record holds {self.capacity}. Nothing was written"
            )
        raw = _HEAD.pack(MAGIC, t, len(body), zlib.crc32(body)) + body
        k = t % 2
        self.records[k][: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        # Then the parity: a crash in between leaves it one write behind, and a page of
        # this slot lost with it rebuilds a record that fails its CRC — t's, which is not
        # needed then (t's gradients were not protected: t is redone from t - 1's).
        pages, (tier1, tier2) = self._pages[k], self._parity[k]
        tier1.copy_(pages[0])
        for p in pages[1:]:
            tier1.bitwise_xor_(p)
        tier2.copy_(tier1)

    def read(self, t: int) -> list | None:
        """The states recorded at ``t``'s commit, or None (never written, torn, or
        overwritten by t + 2)."""
        if t < 0:
            return None
        rec = self.records[t % 2]
        magic, it, n, crc = _HEAD.unpack(bytes(rec[: _HEAD.size].numpy()))
        if magic != MAGIC or it != t or n > self.capacity:
            return None
        body = bytes(rec[_HEAD.size : _HEAD.size + n].numpy())
        return pickle.loads(body) if zlib.crc32(body) == crc else None

    def restore(self, n: int, required: bool) -> None:
        """The objects' state at the start of iteration ``n``: ``n - 1``'s record. None
        there leaves them as the script built them (a fresh start); ``required`` (the
        loop record says ``n - 1`` committed) makes that a fatal failure instead."""
        states = self.read(n - 1)
        if states is None:
            if required:
                raise FatalFailure(
                    f"the data position after iteration {n - 1} is not in the data record: "
                    "the loop cannot resume at the exact next batch"
                )
            return
        for o, sd in zip(self.objects, states, strict=True):
            o.load_state_dict(sd)
