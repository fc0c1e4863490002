"""The progress marker: which step of an iteration a rank has completed.

Runs in the trainer; lives in a pool *record* (host memory, parity-protected: its
protection group has one data page and XOR parity, so the parity pages are byte copies
of the record and every write goes to the record and then to each parity page).

Two slots, each ``seq | fields | crc32 | loss``; a write goes to slot ``seq % 2``, so a
write torn by a crash leaves the other slot, one step older, as the newest valid one.
The iteration's loss sits outside the CRC: on a GPU it is copied into the slot from the
device (``Marker.device_loss``), so the host never waits for the backward pass to learn
it — the update is queued while backward still runs, as under torchrun. It is a report
(the loss log, the verifiers' trace), never an input to training. The
updater is built so that resuming from one step older is always correct (every step
is idempotent given the state the previous marker names).

On a GPU the marker must not run ahead of the device work it describes, yet the host
must not wait for the GPU at every step. ``StreamOrderedWrites`` makes each write two
asynchronous copies on the current stream (pinned staging → device staging → the
page-locked record and its parity), so the bytes land exactly when the preceding
kernels have finished; a crash drops the copies not yet run, leaving an older marker.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, replace

import torch

from leto.errors import RetainedStateLost

MAGIC = 0x4C45544F  # "LETO"
_FMT = struct.Struct("<IQqBBBxiid")  # magic, seq, iteration, phase, step, auth, group, chunk, clip
LOSS_OFFSET = 48  # float64 after the CRC (8-byte aligned)
SLOT_BYTES = 64
RECORD_BYTES = 2 * SLOT_BYTES


class Phase(enum.IntEnum):
    COMPUTE = 0  # forward/backward/all-reduce of `iteration`; model state untouched
    GRADS_PROTECTED = 1  # gradients of `iteration` have parity in host memory
    SYNCED = 2  # global sync done; `clip` holds the clipping coefficient
    UPDATE = 3  # updating: `group`, `chunk`, `step`, `auth` say where
    DONE = 4  # `iteration` complete; the next one starts from scratch


class Step(enum.IntEnum):
    LOAD = 0  # group's host tier-1 parity authoritative; loading it to the device
    START = 1  # chunk `chunk` not begun; parity in buffer `auth` covers chunks < chunk
    UNDO_DONE = 2  # undo buffer holds chunk's old contents
    UPDATE_DONE = 3  # chunk updated; scratch parity being computed
    PARITY_DONE = 4  # scratch parity complete (commit pending)
    STORE = 5  # all chunks committed; copying parity buffer `auth` to host
    TIER2 = 6  # host tier 1 authoritative (buffer `auth` holds the same bytes); refreshing tier 2


class Auth(enum.IntEnum):
    HOST = 0
    A = 1
    B = 2
    C = 3  # three device buffers: a group's pair, and the next group's prefetch


@dataclass(frozen=True)
class MarkerState:
    iteration: int
    phase: Phase
    step: Step = Step.LOAD
    auth: Auth = Auth.HOST
    group: int = 0  # index into the updater's group order
    chunk: int = 0
    clip: float = 1.0
    loss: float = float("nan")  # the iteration's loss, kept so a finished update can report it
    seq: int = 0

    def but(self, **kw) -> MarkerState:
        return replace(self, **kw)

    def next_iteration(self) -> int:
        """The first iteration this rank has not completed."""
        return self.iteration + 1 if self.phase is Phase.DONE else self.iteration


def _pack(s: MarkerState) -> bytes:
    body = _FMT.pack(
        MAGIC,
        s.seq,
        s.iteration,
        int(s.phase),
        int(s.step),
        int(s.auth),
        s.group,
        s.chunk,
        s.clip,
    )
    slot = (body + struct.pack("<I", zlib.crc32(body))).ljust(LOSS_OFFSET, b"\0")
    return (slot + struct.pack("<d", s.loss)).ljust(SLOT_BYTES, b"\0")


def _unpack(raw: bytes) -> MarkerState | None:
    body, crc = raw[: _FMT.size], raw[_FMT.size : _FMT.size + 4]
    if struct.unpack("<I", crc)[0] != zlib.crc32(body):
        return None
    magic, seq, it, phase, step, auth, group, chunk, clip = _FMT.unpack(body)
    (loss,) = struct.unpack_from("<d", raw, LOSS_OFFSET)
    if magic != MAGIC:
        return None
    try:
        return MarkerState(it, Phase(phase), Step(step), Auth(auth), group, chunk, clip, loss, seq)
    except ValueError:
        return None


class StreamOrderedWrites:
    """Marker writes in CUDA stream order (targets must be page-locked host memory)."""

    SLOTS = 1024

    def __init__(self, device: torch.device):
        self.host = torch.empty((self.SLOTS, SLOT_BYTES), dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty((self.SLOTS, SLOT_BYTES), dtype=torch.uint8, device=device)
        self.events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.k = 0

    def __call__(
        self, data: bytes, targets: list[torch.Tensor], loss: torch.Tensor | None = None
    ) -> None:
        """``loss``: a float64 device scalar copied into the slot's loss bytes, in stream
        order (after the work that computed it)."""
        k = self.k % self.SLOTS
        self.k += 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # that slot's copies were queued SLOTS writes ago
        self.host[k].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.dev[k].copy_(self.host[k], non_blocking=True)
        if loss is not None:
            self.dev[k][LOSS_OFFSET : LOSS_OFFSET + 8].copy_(loss.reshape(1).view(torch.uint8))
        for t in targets:
            t.copy_(self.dev[k], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[k] = ev


class Marker:
    def __init__(
        self,
        record: torch.Tensor,
        mirrors: list[torch.Tensor],
        stream_writes: StreamOrderedWrites | None = None,
    ):
        if record.numel() < RECORD_BYTES or any(m.numel() < RECORD_BYTES for m in mirrors):
            raise ValueError(f"marker needs {RECORD_BYTES} bytes in its record and every mirror")
        self.record = record
        self.mirrors = mirrors
        self.stream_writes = stream_writes
        # (iteration, float64 device scalar): the loss every write of that iteration copies
        # from the device (stream-ordered writes only); the host state's loss is NaN then.
        self.device_loss: tuple[int, torch.Tensor] | None = None
        self.state = self.read()

    def read(self) -> MarkerState | None:
        """The newest valid slot, or None on a fresh record (host memory, read now:
        call it when no stream-ordered write is pending, as at recovery)."""
        raw = bytes(self.record[:RECORD_BYTES].numpy())
        slots = [_unpack(raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]) for i in range(2)]
        valid = [s for s in slots if s is not None]
        return max(valid, key=lambda s: s.seq) if valid else None

    def write(self, state: MarkerState) -> MarkerState:
        seq = (self.state.seq + 1) if self.state is not None else 1
        state = state.but(seq=seq)
        raw = _pack(state)
        off = (seq % 2) * SLOT_BYTES
        # Record first, then its parity copies: a crash in between leaves parity one
        # write behind, which is as safe as a torn record slot.
        targets = [t[off : off + SLOT_BYTES] for t in [self.record, *self.mirrors]]
        if self.stream_writes is not None:
            dl = self.device_loss
            self.stream_writes(raw, targets, dl[1] if dl and dl[0] == state.iteration else None)
        else:
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            for t in targets:
                t.copy_(data)
        self.state = state
        return state


# The three device parity buffers a marker's ``auth`` names, rotating over groups.
BUFFERS = (Auth.A, Auth.B, Auth.C)


def start_buffer(gi: int) -> Auth:
    """The buffer group ``gi``'s parity is loaded (or prefetched) into."""
    return BUFFERS[gi % 3]


def scratch_buffer(gi: int, auth: Auth) -> Auth:
    """The other buffer of group ``gi``'s pair {gi % 3, (gi + 2) % 3}: never the next
    group's start buffer ((gi + 1) % 3), so the prefetch cannot clobber it."""
    pair = (BUFFERS[gi % 3], BUFFERS[(gi + 2) % 3])
    if auth not in pair:
        raise RetainedStateLost(f"marker names buffer {auth.name}, not one of group {gi}'s pair")
    return pair[1] if auth is pair[0] else pair[0]
