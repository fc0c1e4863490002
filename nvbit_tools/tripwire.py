"""The kernel trip-wire: faultkit's ``kernel-abort`` mode, without NVBit.

Runs in the trainer. ``arm(n)`` (faultkit's hook does it at the armed point) makes the
next of Leto's own kernels stop after ``n`` blocks, counted over every launch since
arming, and ``fire`` then SIGKILLs this process while the kernel is still in flight:
its output is genuinely partial (the first ``n`` blocks' share written, the rest not),
and nothing the host would have issued after it runs. Kernels that honour it:

* the erasure codec's GF(2^16) kernel (parity encode, incremental parity update,
  tier-2 refresh): ``gf_matmul.cu`` includes ``tripwire.cuh``;
* the parity copies (host <-> device, grad parity): while armed they run through
  ``tripwire_copy.cu``, an SM copy kernel (a DMA-engine ``copy_`` cannot be stopped
  after N blocks);
* the optimizer's chunk update: torch's AdamW/Muon compute the piece into scratch
  tensors (its arithmetic stays torch's, bit for bit) and the results land through the
  trip-wire copy, so an abort leaves the chunk's first blocks updated and the rest old.

Mechanism on CUDA: a device-memory ticket counter decides which blocks run; held
blocks poll a host-mapped release flag with ``ld.relaxed.sys`` (FACTS.md: a volatile
read took seconds to be seen) and give up after 30 s; the N-th finished block sets a
host-mapped flag that ``fire`` waits for. On the CPU backend the same calls are an
emulation: the operation's result lands tile by tile (``CPU_TILE`` bytes; for the codec
one tile column across every output page, like a CUDA block) and only the first ``n``
tiles land before the SIGKILL. ``MECHANISM`` names which one ran; each fire appends a
JSON line to ``$LETO_TRIPWIRE_LOG`` (if set) before the kill.

Not covered: torch's own kernels (forward, backward, all-reduce) — a kill with them in
flight is faultkit's ``kill`` mode on ``--device cuda``; an NVBit aborter (see
``nvbit_tools/__init__.py``) would cover them through the same ``arm``/``fire``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from importlib import resources

import torch

ENV_LOG = "LETO_TRIPWIRE_LOG"
ENV_BLOCKS = "LETO_TRIPWIRE_BLOCKS"  # N, for faultkit's hook
DEFAULT_BLOCKS = 3
CUDA_TILE = 4096  # bytes per block of tripwire_copy.cu (TW_TILE)
CPU_TILE = 1024  # bytes per emulated block
FIRE_TIMEOUT_S = 30.0
MECHANISM = {
    "cuda": "trip-wire in Leto's CUDA kernels (ticketed blocks, ld.relaxed.sys release flag)",
    "cpu": "CPU emulation: result lands in 1 KiB tiles, the first N only",
}

_after: int | None = None  # N while armed
_kill = True  # False (tests): fire releases the held blocks and raises TripwireFired
_launched: dict[int, int] = {}  # device index -> blocks launched since arming
_landed = 0  # CPU emulation: tiles landed since arming
_total = 0  # CPU emulation: tiles the operation had
_cuda: dict[int, tuple] = {}  # device index -> (state tensor, host flags, copy kernel)


class TripwireFired(Exception):
    """``fire`` with ``kill=False``: the operation stopped after N blocks; its partial
    output is in memory (``report`` says how much ran)."""

    def __init__(self, report: dict):
        super().__init__(f"trip-wire fired: {report}")
        self.report = report


def arm(after_blocks: int, kill: bool = True) -> None:
    global _after, _landed, _total, _kill
    if after_blocks < 1:
        raise ValueError(f"trip-wire: after_blocks must be at least 1, not {after_blocks}")
    _after, _landed, _total, _kill = after_blocks, 0, 0, kill
    _launched.clear()


def disarm() -> None:
    global _after
    _after = None
    _launched.clear()


def armed() -> bool:
    return _after is not None


def launch_on_torch_stream(device: torch.device):
    """CuPy launches on ``device``'s current torch stream (stream order with torch)."""
    import contextlib

    import cupy

    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(device.index))
    stack.enter_context(cupy.cuda.Stream.from_external(torch.cuda.current_stream(device)))
    return stack


def _module():
    import cupy

    here = resources.files("nvbit_tools")
    src = here.joinpath("tripwire_copy.cu").read_text()
    return cupy.RawModule(code=src, options=("-std=c++17", f"-I{here}"))


def launch_arg(device: torch.device, blocks: int) -> int:
    """The ``LetoTripwire*`` a kernel of ``blocks`` blocks about to launch on ``device``
    passes (0 when disarmed); the first launch after arming resets the device state."""
    if _after is None:
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _cuda:
        flags = torch.zeros(2, dtype=torch.int32, pin_memory=True)  # mapped: UVA
        state = torch.zeros(4, dtype=torch.int64, device=device)
        _cuda[idx] = (state, flags, _module().get_function("tripwire_copy"))
    state, flags, _ = _cuda[idx]
    if idx not in _launched:
        flags.zero_()
        host = _device_address(flags)
        state.copy_(torch.tensor([0, 0, _after, host], dtype=torch.int64))
        _launched[idx] = 0
    _launched[idx] += blocks
    return state.data_ptr()


def _device_address(t: torch.Tensor) -> int:
    """Where a kernel reaches ``t``: its address, or for page-locked host memory (the
    pool's host parity pages are cudaHostRegister-ed) the mapped device address."""
    if t.is_cuda:
        return t.data_ptr()
    import cupy

    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(t.data_ptr())
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise RuntimeError(f"trip-wire copy: host memory at {t.data_ptr():#x}: {e}") from None
    if not attrs.devicePointer:
        raise RuntimeError(
            f"trip-wire copy: host memory at {t.data_ptr():#x} is not page-locked and mapped "
            "for the GPU; the trip-wire copy kernel cannot reach it"
        )
    return attrs.devicePointer


def land(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], columns: bool = False):
    """Copy ``src`` into ``dst`` through the trip-wire, then ``fire``. ``columns``: the
    CPU emulation lands tile k of every page before tile k+1 (the codec's block shape)."""
    global _landed, _total
    if _after is None:
        raise RuntimeError("trip-wire: land() while disarmed")
    if any(t.device.type == "cuda" for t in (*dst, *src)):
        import numpy as np

        for d, s in zip(dst, src, strict=True):
            nbytes = d.numel() * d.element_size()
            blocks = -(-nbytes // CUDA_TILE)
            dev = d.device if d.is_cuda else s.device
            tw = launch_arg(dev, blocks)
            _, _, kernel = _cuda[dev.index]
            with launch_on_torch_stream(dev):
                kernel(
                    (blocks,),
                    (256,),
                    (
                        np.uint64(_device_address(d)),
                        np.uint64(_device_address(s)),
                        np.int64(nbytes),
                        np.uint64(tw),
                    ),
                )
        fire(next(t.device for t in (*dst, *src) if t.is_cuda))
        return
    raw_d = [d.reshape(-1).view(torch.uint8) for d in dst]
    raw_s = [s.reshape(-1).view(torch.uint8) for s in src]
    tiles = [-(-d.numel() // CPU_TILE) for d in raw_d]
    order = (
        [(k, i) for k in range(max(tiles)) for i in range(len(raw_d)) if k < tiles[i]]
        if columns
        else [(k, i) for i in range(len(raw_d)) for k in range(tiles[i])]
    )
    _total += len(order)
    for k, i in order:
        if _landed >= _after:
            break
        a = k * CPU_TILE
        raw_d[i][a : a + CPU_TILE] = raw_s[i][a : a + CPU_TILE]
        _landed += 1
    fire(torch.device("cpu"))


def cpu_blocks(total: int) -> int:
    """The CPU emulation of a kernel of ``total`` blocks of independent threads (the
    resumable chunk pass's): how many of its blocks run before the trip-wire holds the
    rest (``fire`` then kills, as on the GPU)."""
    global _landed, _total
    if _after is None:
        raise RuntimeError("trip-wire: cpu_blocks() while disarmed")
    n = min(total, max(_after - _landed, 0))
    _landed += n
    _total += total
    return n


def fire(device: torch.device) -> None:
    """Wait until N blocks finished (or everything launched did: fewer than N blocks),
    then SIGKILL this process with the rest held in flight."""
    if _after is None:
        return
    if device.type == "cuda":
        state, flags, _ = _cuda[device.index]
        done_all = torch.cuda.Event()
        done_all.record(torch.cuda.current_stream(device))
        view = flags.numpy()  # reads the pinned page every time
        deadline = time.monotonic() + FIRE_TIMEOUT_S
        complete = False
        while not view[0]:
            if done_all.query():
                complete = True  # fewer than N blocks were launched: nothing held
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"trip-wire: {_after} blocks did not finish within {FIRE_TIMEOUT_S} s"
                )
            time.sleep(0.0005)
        launched = _launched.get(device.index, 0)
        report = {
            "mechanism": MECHANISM["cuda"],
            "after_blocks": _after,
            "blocks_launched": launched,
            # Exactly N blocks launched: the flag rises with nothing held back.
            "partial": not complete and launched > _after,
        }
    else:
        report = {
            "mechanism": MECHANISM["cpu"],
            "after_blocks": _after,
            "blocks_launched": _total,
            "partial": _landed < _total,
        }
    if not _kill:
        if device.type == "cuda":
            flags[1] = 1  # held blocks exit without writing
            torch.cuda.synchronize(device)
        disarm()
        raise TripwireFired(report)
    line = json.dumps({"pid": os.getpid(), **report})
    print(f"faultkit kernel-abort: {line}", file=sys.stderr, flush=True)
    if os.environ.get(ENV_LOG):
        with open(os.environ[ENV_LOG], "a") as f:
            f.write(line + "\n")
    os.kill(os.getpid(), signal.SIGKILL)
