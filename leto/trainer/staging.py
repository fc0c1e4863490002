"""The checkpoint stager: copies a rank's retained state into host buffers made once,
in the background, for ``torch.distributed.checkpoint.async_save`` to write from.

Runs in the trainer (a thread of its own), and — for the buffers a promoted trainer
will need — in its parked shadow. DCP's ``DefaultStager`` does the same job, but its
life cycle differs between torch releases: torch 2.11's ``async_save`` left it unusable
for a second save (``KeyError: <class 'type'>`` from its cleared copy table on the
H200, every save after the first), 2.13's leaves it to the caller. This one follows
DCP's ``AsyncStager`` protocol and nothing else, so every release drives it the same
way.

* Buffers: one host tensor per state tensor (12 bytes a parameter for AdamW), made by
  the first ``prepare`` or ``stage`` and reused by every save: the checkpointer keeps
  one save in flight at a time, so a buffer is never staged into while it is being
  written. When the state is on a GPU they are page-locked through the driver
  (``cuMemHostRegister``) in pieces of ``CHUNK_BYTES``, paced: a thread making 13 GB
  with ``torch.empty(pin_memory=True)`` held the training thread's every CUDA call for
  8.5 s on the H200 (``bench/pin_stall.py``, docs/benchmarks.md), while registering
  piece by piece let it run.
* Made ahead: a parked shadow makes the buffers its trainer published
  (``publish_layout``; ``make_ahead``), another process, so the trainer's steps do not
  notice, and the promoted trainer takes them (``take_ahead``) instead of making its
  own during its first iterations. Only when the host has room for both sets with as
  much again to spare (``/proc/meminfo``'s MemAvailable); ``LETO_STAGING_AHEAD=0``
  turns it off.
* Order: an event on the caller's stream — recorded by ``stage``, or under
  ``at_release`` by ``release`` — and the copies on a stream of their own after it, so
  they read the state the caller's stream left (the update of that iteration) without
  the host waiting for the GPU. Each copy stays within one registered piece (the driver
  copies asynchronously only within one registration). The checkpointer releases a
  save's copies after the next iteration's first writes to the host (its marker write,
  the scrub's flags): a copy to the host queued on another stream while the staging's
  13 GB ran waited for all of it, on an H100 (``bench.copy_overlap --to-host
  --main-d2h``: compute +220 ms, with the pieces queued two at a time as well). On the
  1.1 B job on an H100 a save's iteration was 257 ms over the median with the copies
  queued at the save, 20-23 ms with them released at the next iteration's begin (16 K
  tokens, three runs each; 128 K: 270 and 25 ms; docs/benchmarks.md).
  ``LETO_STAGING_AT_RELEASE=0`` queues them at the save, to measure one against the
  other.
* ``close`` is the protocol's and does nothing (some releases call it after each save);
  ``shutdown`` is the checkpointer's, once, at the end.

Not covered: a state whose shapes change between saves after the first (buffers are
made again, unpaced).
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from leto import rank_log
from leto.job import keys

CHUNK_BYTES = 64 << 20  # one registration (and one copy) at most
RELEASE_TIMEOUT_S = 600.0  # a stage not released by then fails (its future raises)
PACE = 2.0  # after registering a piece, idle this many times as long (background only)
ENV_AHEAD = "LETO_STAGING_AHEAD"  # "0": a parked shadow makes no buffers ahead
# "0": a save's copies start at the save, not at the next iteration's begin (the
# previous default, kept to measure one against the other).
ENV_AT_RELEASE = "LETO_STAGING_AT_RELEASE"


def at_release_default() -> bool:
    return os.environ.get(ENV_AT_RELEASE, "1") != "0"


# Stages waiting for their release, cancelled as the interpreter exits: its exit joins
# the staging thread (and DCP's, which waits for the staging's result), so a trainer
# that ended between a save and the next iteration's begin would otherwise take
# RELEASE_TIMEOUT_S to exit. Called before those joins: threading's exit callbacks run
# newest first, and concurrent.futures registered its own (the joins) at import.
_waiting: set[threading.Event] = set()


def _cancel_waiting() -> None:
    for ev in list(_waiting):
        ev.cancelled = True  # type: ignore[attr-defined]
        ev.set()


if hasattr(threading, "_register_atexit"):  # (CPython >= 3.9)
    threading._register_atexit(_cancel_waiting)


def _await_release(released: threading.Event) -> None:
    """Wait for a stage's release (``at_release``), at most ``RELEASE_TIMEOUT_S``, or
    until the interpreter exits (``_cancel_waiting``): nothing is copied then."""
    _waiting.add(released)
    try:
        if not released.wait(timeout=RELEASE_TIMEOUT_S):
            raise TimeoutError(
                f"checkpoint staging: not released within {RELEASE_TIMEOUT_S:.0f} s of "
                f"the save (the trainer stopped between iterations?); nothing was copied"
            )
    finally:
        _waiting.discard(released)
    if getattr(released, "cancelled", False):
        raise RuntimeError(
            "checkpoint staging: the trainer ended before the save's copies were "
            "released; nothing was copied"
        )


Shapes = dict[str, tuple[torch.Size, torch.dtype, bool]]  # name -> (shape, dtype, pinned)


class HostBuffers:
    """Host tensors for a state's ``Shapes``, page-locked in pieces where pinned."""

    def __init__(self, shapes: Shapes, device: torch.device | None, pace: float = 0.0):
        self.shapes = shapes
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}
        self._pinned: list[int] = []  # registered addresses (undone by release)
        self.refused = 0  # pieces the driver would not page-lock (copied synchronously)
        t0 = time.perf_counter()
        for k, (shape, dtype, pin) in shapes.items():
            t = torch.empty(shape, dtype=dtype)
            if pin and device is not None and t.numel():
                self._pin(t, pace)
            self.tensors[k] = t
        self.seconds = time.perf_counter() - t0

    def _pin(self, t: torch.Tensor, pace: float) -> None:
        from leto.memory.backends.cuda import pin_host

        raw = t.view(-1).view(torch.uint8)
        for lo in range(0, raw.numel(), CHUNK_BYTES):
            piece = raw[lo : lo + CHUNK_BYTES]
            t0 = time.perf_counter()
            piece.fill_(0)  # its pages faulted in here, not inside the driver's lock
            if pin_host(self.device.index or 0, piece.data_ptr(), piece.numel()) == 0:
                self._pinned.append(piece.data_ptr())
            else:
                self.refused += 1
            if pace:
                time.sleep(pace * (time.perf_counter() - t0))

    def fits(self, shapes: Shapes) -> bool:
        return self.shapes == shapes

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def release(self) -> None:
        if self._pinned:
            from leto.memory.backends.cuda import unpin_host

            for ptr in self._pinned:
                unpin_host(self.device.index or 0, ptr)
            self._pinned = []
        self.tensors = {}


def shapes_of(state: dict[str, torch.Tensor]) -> Shapes:
    return {k: (v.shape, v.dtype, v.is_cuda) for k, v in state.items()}


def _pieces(src: torch.Tensor, dst: torch.Tensor):
    """(source, destination) slices of at most ``CHUNK_BYTES`` each, aligned with the
    registered pieces of ``dst``."""
    s, d = src.reshape(-1), dst.view(-1)
    step = max(1, CHUNK_BYTES // max(1, d.element_size()))
    for lo in range(0, d.numel(), step):
        yield s[lo : lo + step], d[lo : lo + step]


# -- made ahead by a parked shadow ----------------------------------------------------

_ahead: dict = {"thread": None, "buffers": None, "said": None}


def publish_layout(store, rank: int, shapes: Shapes) -> None:
    """The trainer's staging layout, for its rank's next shadow to make ahead."""
    if store is None:
        return
    text = json.dumps(
        {k: [list(s), str(d).removeprefix("torch."), p] for k, (s, d, p) in shapes.items()}
    )
    store.set(keys.staging(rank), text)


def available_bytes() -> int | None:
    """The host's MemAvailable (None where /proc/meminfo cannot tell)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_ahead(store, rank: int, device: torch.device) -> str | None:
    """In a parked shadow: once the trainer has published its layout, make those
    buffers on a thread of this process (never more than once). Returns a line for the
    log when something was decided now (started, or why not)."""
    if _ahead["said"] is not None or os.environ.get(ENV_AHEAD, "1") == "0":
        return None
    key = keys.staging(rank)
    if not store.check([key]):
        return None
    raw = json.loads(store.get(key))
    shapes: Shapes = {
        k: (torch.Size(s), getattr(torch, d), bool(p)) for k, (s, d, p) in raw.items()
    }
    need = sum(torch.Size(s).numel() * getattr(torch, d).itemsize for s, d, _ in raw.values())
    free = available_bytes()
    if free is not None and free - need < max(need, 8 << 30):
        _ahead["said"] = (
            f"checkpoint staging buffers not made ahead: {need / 2**30:.1f} GiB wanted, "
            f"{free / 2**30:.1f} GiB of host memory available (kept for as much again); "
            f"the promoted trainer makes them"
        )
        return _ahead["said"]
    dev = device if device.type == "cuda" else None

    def make() -> None:
        _ahead["buffers"] = HostBuffers(shapes, dev)

    th = threading.Thread(target=make, name="leto-staging-ahead", daemon=True)
    th.start()
    _ahead["thread"] = th
    _ahead["said"] = f"making {need / 2**30:.2f} GiB of checkpoint staging buffers ahead"
    return _ahead["said"]


def take_ahead(shapes: Shapes, timeout_s: float = 600.0) -> HostBuffers | None:
    """The buffers this process made ahead as a shadow, if they fit ``shapes`` (waits
    for them to be done: called on the stager's thread); None otherwise."""
    th = _ahead["thread"]
    if th is None:
        return None
    th.join(timeout_s)
    bufs, _ahead["buffers"], _ahead["thread"] = _ahead["buffers"], None, None
    if bufs is None or th.is_alive():
        return None
    if not bufs.fits(shapes):
        bufs.release()
        return None
    return bufs


class HostStager(AsyncStager):
    """Stages ``dict[str, Tensor]`` states into kept host buffers (see the module)."""

    _synchronize_after_execute = False  # the staging future says when it is done

    def __init__(
        self, state: dict[str, torch.Tensor], rank: int | None = None, at_release: bool = False
    ):
        """``at_release``: a stage's copies start when ``release`` is called (the
        checkpointer calls it after the next iteration's first writes to the host),
        not when ``stage`` is."""
        self.at_release = at_release
        self._release: threading.Event | None = None
        self._ready: torch.cuda.Event | None = None
        self.cuda = any(v.is_cuda for v in state.values())
        self._device = next((v.device for v in state.values() if v.is_cuda), None)
        self._stream = torch.cuda.Stream(self._device) if self.cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="leto-ckpt-stage")
        self._bufs: HostBuffers | None = None
        self.rank = rank
        self.made: dict | None = None  # how the buffers were made (the rank log says)
        self.last: Future | None = None  # the last stage's future

    def _make(self, shapes: Shapes, pace: float) -> dict[str, torch.Tensor]:
        """The buffers for ``shapes``: the kept ones if they fit, else those this
        process made ahead as a shadow, else new ones."""
        if self._bufs is not None and self._bufs.fits(shapes):
            return self._bufs.tensors
        if self._bufs is not None:
            self._bufs.release()
        t0 = time.perf_counter()
        bufs = take_ahead(shapes)
        how = "made ahead by the parked shadow"
        if bufs is None:
            bufs = HostBuffers(shapes, self._device, pace=pace)
            how = "made here" + (f", paced x{pace:g}" if pace and self.cuda else "")
        self._bufs = bufs
        self.made = {"how": how, "seconds": time.perf_counter() - t0, "bytes": bufs.nbytes()}
        if self.rank is not None:
            refused = f"; {bufs.refused} piece(s) not page-locked" if bufs.refused else ""
            rank_log.say(
                self.rank,
                f"checkpoint staging buffers ({bufs.nbytes() / 2**30:.2f} GiB) {how} in "
                f"{self.made['seconds']:.2f} s{refused}",
            )
        return bufs.tensors

    def prepare(self, state_dict: dict[str, torch.Tensor]) -> Future:
        """Make the buffers for ``state_dict`` in the background, paced, copying nothing
        (a copy made before a save is due would be discarded, and on a GPU the device
        synchronize of the script's next iteration waited for its 12 bytes a parameter)."""
        shapes = shapes_of(state_dict)
        self.last = self._pool.submit(self._make, shapes, PACE)
        return self.last

    def stage(self, state_dict: dict[str, torch.Tensor]) -> Future:
        """Start copying ``state_dict`` (under ``at_release``: once ``release`` is
        called); the future gives the host copy. The state must not change before the
        copy has read it (the future is done)."""
        ready = torch.cuda.Event() if self.cuda else None
        released = threading.Event()
        if self.at_release:
            self._ready, self._release = ready, released
        else:
            if ready is not None:
                ready.record(torch.cuda.current_stream(self._device))
            released.set()
        shapes = shapes_of(state_dict)

        def copy() -> dict[str, torch.Tensor]:
            _await_release(released)
            bufs = self._make(shapes, 0.0)
            if not self.cuda:
                for k, v in state_dict.items():
                    bufs[k].copy_(v)
                return bufs
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                for k, v in state_dict.items():
                    if not v.is_cuda:
                        bufs[k].copy_(v)
                        continue
                    for s, d in _pieces(v, bufs[k]):
                        d.copy_(s, non_blocking=True)
            self._stream.synchronize()
            return bufs

        self.last = self._pool.submit(copy)
        return self.last

    def release(self) -> None:
        """Let the last stage's copies start, after the work queued on the current
        stream so far (``at_release``; nothing to do otherwise, or twice)."""
        released, self._release = self._release, None
        if released is None:
            return
        if self._ready is not None:
            self._ready.record(torch.cuda.current_stream(self._device))
            self._ready = None
        released.set()

    def synchronize_staging(self) -> None:
        self.release()
        if self.last is not None:
            self.last.result()

    def close(self) -> None:
        """The protocol's: nothing (see the module docstring)."""

    def shutdown(self) -> None:
        """Wait for the last copy and release the buffers (the checkpointer, once)."""
        try:
            self.synchronize_staging()
        finally:
            self._pool.shutdown(wait=True)
            if self._bufs is not None:
                if self.cuda:
                    torch.cuda.synchronize(self._device)  # no copy still targets them
                self._bufs.release()
                self._bufs = None
