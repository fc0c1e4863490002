"""Tensor digests for traces: SHA-256 over 64 KiB leaves, the leaves hashed where the
tensor lives.

A record hashes every retained tensor of every iteration. A 1 B-parameter model keeps
~16 GB of state (parameters, gradients, two moments): one SHA-256 stream runs at
~1-2 GB/s, so a plain digest costs seconds per record. The digest here is a one-level
hash tree, ``sha256-tree-64KiB``: the SHA-256 of the concatenated SHA-256 digests of
consecutive 64 KiB leaves of the raw bytes. Every byte is still hashed with SHA-256 (a
change anywhere changes its leaf's digest and so the tensor's).

* A CPU tensor's leaves hash on all cores (hashlib releases the GIL for large buffers),
  16 MiB of leaves a task.
* A CUDA tensor's leaves hash on its GPU (``sha256_leaves.cu``, one thread a leaf, in
  the order of the current stream: after every write queued before the record); only
  the leaf digests (32 bytes per 64 KiB) come to the host. Before, the whole state was
  copied through pinned buffers and hashed on the host: on an H200 the digest of a 1 B
  job's state took ~2 s an iteration, most of `faultkit certify`'s reference run's
  excess over a plain run (docs/benchmarks.md).

Not covered: digests comparable with traces written before this scheme (trace version 2
hashed 16 MiB leaves, version 1 the plain SHA-256; the reader refuses to compare across
versions). A GPU digest needs CuPy (as Leto's GPU path does), and says so when missing.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import torch

SCHEME = "sha256-tree-64KiB"
BLOCK = 64 << 10  # bytes per leaf digest
SPAN = 16 << 20  # bytes of leaves per host task (a multiple of BLOCK)
THREADS = 128  # GPU threads per block: one leaf each

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_kernels: dict[int, object] = {}  # device index -> the loaded sha256_leaves


def _workers() -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None:
            _pool_size = max(1, min(32, len(os.sched_getaffinity(0))))
            _pool = ThreadPoolExecutor(_pool_size, thread_name_prefix="leto-digest")
        return _pool


def _kernel(index: int):
    """The compiled leaf kernel on device ``index`` (CuPy compiles it once per machine,
    and keeps it in its kernel cache)."""
    with _lock:
        if index not in _kernels:
            try:
                import cupy
            except ImportError as e:  # pragma: no cover - depends on the machine
                raise RuntimeError(
                    "the digest of a CUDA tensor needs CuPy (pip install 'leto[cuda]'), as "
                    "Leto's GPU path does; no digest was taken"
                ) from e
            src = resources.files("verifiers").joinpath("sha256_leaves.cu").read_text()
            with cupy.cuda.Device(index):
                module = cupy.RawModule(code=src, options=("-std=c++17",))
                _kernels[index] = module.get_function("sha256_leaves")
        return _kernels[index]


def prepare(device: torch.device) -> None:
    """Start the hashing threads, and on a GPU load the leaf kernel, now rather than in
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
        _kernel(device.index if device.index is not None else torch.cuda.current_device())


def _leaves(view: memoryview) -> bytes:
    return b"".join(
        hashlib.sha256(view[i : i + BLOCK]).digest() for i in range(0, len(view), BLOCK)
    )


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order as a 1-D uint8 tensor on ``t``'s device.

    ``reshape(-1)`` first because a 0-dim tensor cannot be viewed as a dtype of another
    size."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(t: torch.Tensor) -> str:
    """The ``sha256-tree-64KiB`` digest of ``t``'s raw bytes (CPU or CUDA tensor)."""
    raw = raw_bytes(t)
    if raw.device.type == "cuda":
        return hashlib.sha256(_leaves_cuda(raw)).hexdigest()
    if raw.device.type != "cpu":
        raw = raw.cpu()
    mv = memoryview(raw.numpy())
    n = raw.numel()
    spans = [_workers().submit(_leaves, mv[i : min(i + SPAN, n)]) for i in range(0, n, SPAN)]
    return hashlib.sha256(b"".join(f.result() for f in spans)).hexdigest()


def _leaves_cuda(raw: torch.Tensor) -> bytes:
    """The concatenated leaf digests of ``raw``, hashed on its GPU in stream order."""
    import cupy
    import numpy as np

    n = raw.numel()
    if n == 0:
        return b""
    index = raw.device.index if raw.device.index is not None else torch.cuda.current_device()
    leaves = -(-n // BLOCK)
    out = torch.empty(leaves * 32, dtype=torch.uint8, device=raw.device)
    fn = _kernel(index)
    with cupy.cuda.Device(index), cupy.cuda.Stream.from_external(torch.cuda.current_stream(raw.device)):
        fn(
            (-(-leaves // THREADS),),
            (THREADS,),
            (np.uint64(raw.data_ptr()), np.uint64(n), np.uint64(BLOCK), np.uint64(out.data_ptr())),
        )
    return out.cpu().numpy().tobytes()  # waits for the kernel (stream order)
