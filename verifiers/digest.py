"""Tensor digests for traces: SHA-256 over 16 MiB blocks, hashed in parallel.

A record hashes every retained tensor of every iteration. A 1 B-parameter model keeps
~16 GB of state (parameters, gradients, two moments), and one SHA-256 stream runs at
~1 GB/s (this VM; more with SHA extensions), so a plain digest costs seconds to tens of
seconds per record: most of the third session's 23.2 s H200 recovery, which took 1.99 s
with this scheme (docs/benchmarks.md). The digest here is a one-level hash tree, ``sha256-tree-16MiB``:
the SHA-256 of the concatenated SHA-256 digests of consecutive 16 MiB blocks of the
raw bytes. Every byte is still hashed with SHA-256 (a change anywhere changes its
block's digest and so the tensor's), and blocks hash on all cores: hashlib releases
the GIL for large buffers. A CUDA tensor is staged through pinned host buffers on a
side stream, the next copy overlapping the hashing of the last.

Not covered: digests comparable with traces written before this scheme (trace
version 1 stored a plain SHA-256; the reader refuses to compare across versions).
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

SCHEME = "sha256-tree-16MiB"
BLOCK = 16 << 20  # bytes per leaf digest
STAGE = 128 << 20  # bytes per pinned staging buffer (a multiple of BLOCK)
N_STAGES = 4  # pinned buffers per device: copies run ahead of hashing by up to 3

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_staging: dict[torch.device, list[torch.Tensor]] = {}


def _workers() -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None:
            _pool_size = max(1, min(32, len(os.sched_getaffinity(0))))
            _pool = ThreadPoolExecutor(_pool_size, thread_name_prefix="leto-digest")
        return _pool


def _buffers(device: torch.device) -> list[torch.Tensor]:
    # Pinned allocation costs ~0.1 s per GB: allocated once per process and reused.
    with _lock:
        if device not in _staging:
            _staging[device] = [
                torch.empty(STAGE, dtype=torch.uint8, pin_memory=True) for _ in range(N_STAGES)
            ]
        return _staging[device]


def prepare(device: torch.device) -> None:
    """Allocate ``device``'s staging buffers and start the hashing threads now, not in
    the first digest (a parked shadow calls this: ``verifiers.plugin``). Idempotent."""
    pool = _workers()
    n = _pool_size
    # Threads start on demand, one per submit while none is idle: n tasks that wait for
    # each other start all n (a broken barrier — a thread slow to start — only means
    # fewer were started ahead).
    meet = threading.Barrier(n)

    def wait() -> None:
        try:
            meet.wait(timeout=10)
        except threading.BrokenBarrierError:
            pass

    for f in [pool.submit(wait) for _ in range(n)]:
        f.result(timeout=30)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        _buffers(device)


def _leaf(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def _root(leaves: list[Future]) -> str:
    return hashlib.sha256(b"".join(f.result() for f in leaves)).hexdigest()


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order as a 1-D uint8 tensor on ``t``'s device.

    ``reshape(-1)`` first because a 0-dim tensor cannot be viewed as a dtype of another
    size."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(t: torch.Tensor) -> str:
    """The ``sha256-tree-16MiB`` digest of ``t``'s raw bytes (CPU or CUDA tensor)."""
    raw = raw_bytes(t)
    if raw.device.type == "cuda":
        return _digest_cuda(raw)
    if raw.device.type != "cpu":
        raw = raw.cpu()
    mv = memoryview(raw.numpy())
    pool = _workers()
    n = raw.numel()
    return _root([pool.submit(_leaf, mv[i : min(i + BLOCK, n)]) for i in range(0, n, BLOCK)])


def _digest_cuda(raw: torch.Tensor) -> str:
    n, pool, bufs = raw.numel(), _workers(), _buffers(raw.device)
    stream = torch.cuda.Stream(raw.device)
    # The copies must see every write queued before the record on the caller's stream.
    stream.wait_stream(torch.cuda.current_stream(raw.device))
    leaves: list[Future] = []
    users: list[list[Future]] = [[] for _ in bufs]  # hashes still reading each buffer
    for c, start in enumerate(range(0, n, STAGE)):
        k, size = c % len(bufs), min(STAGE, n - start)
        for f in users[k]:
            f.result()  # the buffer is free again
        with torch.cuda.stream(stream):
            bufs[k][:size].copy_(raw[start : start + size], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        mv = memoryview(bufs[k].numpy())
        users[k] = [pool.submit(_leaf, mv[i : min(i + BLOCK, size)]) for i in range(0, size, BLOCK)]
        leaves += users[k]
    return _root(leaves)
