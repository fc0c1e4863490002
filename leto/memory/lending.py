"""Lending reusable pool memory to the trainer's activations (paper §5.2).

Runs in the trainer. The updater's buffers (undo copy, parity buffers, gradient parity)
are reusable pool allocations needed only after backward; during the forward pass the
same pages hold activations, so retaining state costs no extra peak device memory for
them. ``Lender`` puts a ``torch.cuda.MemPool`` over those pages: a small C allocator
(``lending.c``, built with the system C compiler on first use) carves PyTorch's segment
requests out of the lent regions and sends small or non-fitting ones to cuMemAlloc.

Safety rule: nothing allocated while lending may be alive when the updater takes the
memory back. ``reclaim`` checks the pool's snapshot and raises ``LentMemoryInUse``
naming the live bytes instead of letting parity overwrite a live tensor.

Forward and backward run inside ``lend()``: allocations of every thread go to the pool
(backward runs on autograd's device thread, which ``use_mem_pool`` would miss).

Not covered: CPU tensors (no pluggable
allocator on the CPU: the CPU build tests the C allocator directly with malloc as its
fallback).
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from leto.errors import InvalidInput
from leto.native import build_shared, compiler

SOURCE = Path(__file__).with_name("lending.c")

MIN_LEND_BYTES = 4 << 20  # PyTorch's small-block segments (2 MiB) are never lent


class LentMemoryInUse(InvalidInput):
    """A tensor allocated in lent memory is still alive when the updater needs it."""


@dataclass(frozen=True)
class LendStats:
    lent_in_use_bytes: int
    lent_peak_bytes: int
    fallback_in_use_bytes: int
    fallback_peak_bytes: int
    lent_segments: int
    fallback_segments: int
    failed_segments: int
    pieces: int


def build_library() -> Path:
    """Compile lending.c once per source version (``leto.native``'s cache)."""
    cc = compiler("CC", ("cc", "gcc"), f"lending activation memory ({SOURCE.name})")
    return build_shared(
        SOURCE, "lending", cc, ["-O2", "-fPIC"], ["-ldl", "-lpthread"], timeout_s=120
    )


_WARMED: set[int] = set()  # devices whose library workspaces this process created


def warm_workspaces(device: torch.device) -> None:
    """Create, outside any lent pool, what a first forward and backward on ``device``
    allocate and keep: cuBLAS allocates its workspace (32 MiB with
    CUBLAS_WORKSPACE_CONFIG=:4096:8) at the first matmul on a stream and keeps it, per
    thread — backward's (autograd's device thread) too. Inside a pool those would be
    live bytes at ``reclaim``. Once per process and device: the first ``lend()`` runs it,
    or earlier a parked shadow (``leto.trainer.api``), so a promotion does not."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _WARMED:
        return
    dev = torch.device("cuda", idx)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(8, 8, dtype=dtype, device=dev, requires_grad=True)
        (a @ a).sum().backward()
        a.grad.sum().item()
    _WARMED.add(idx)


def load_library() -> None:
    """Build (once per source version) and load the C allocator now, not at a
    promoted trainer's first ``Lender`` (a parked shadow calls this)."""
    RegionAllocator()


class RegionAllocator:
    """ctypes view of the C allocator (one per process: its state is global)."""

    def __init__(self) -> None:
        self.path = build_library()
        self.lib = ctypes.CDLL(str(self.path))
        self.lib.leto_lend_alloc.restype = ctypes.c_void_p
        self.lib.leto_lend_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.leto_lend_free.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self.lib.leto_lend_set_regions.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_int,
            ctypes.c_size_t,
        ]
        self.lib.leto_lend_set_fallback.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def set_regions(self, regions: list[tuple[int, int]], min_bytes: int = MIN_LEND_BYTES) -> None:
        n = len(regions)
        addrs = (ctypes.c_uint64 * n)(*(a for a, _ in regions))
        sizes = (ctypes.c_size_t * n)(*(s for _, s in regions))
        rc = self.lib.leto_lend_set_regions(addrs, sizes, n, min_bytes)
        if rc == -1:
            raise LentMemoryInUse("the lent regions still have pieces handed out; free them first")
        if rc == -2:
            raise InvalidInput(f"{n} lent regions overlap or are too many (at most 8)")

    def use_libc_fallback(self) -> None:
        """CPU tests: small/non-fitting requests from malloc instead of cuMemAlloc
        (process-wide, as the allocator's state: ``use_driver_fallback`` undoes it)."""
        libc = ctypes.CDLL(None)
        self.lib.leto_lend_set_fallback(
            ctypes.cast(libc.malloc, ctypes.c_void_p), ctypes.cast(libc.free, ctypes.c_void_p)
        )

    def use_driver_fallback(self) -> None:
        """Small/non-fitting requests from cuMemAlloc (the default)."""
        self.lib.leto_lend_set_fallback(None, None)

    def alloc(self, size: int) -> int:
        return self.lib.leto_lend_alloc(size, 0, None) or 0

    def free(self, ptr: int, size: int) -> None:
        self.lib.leto_lend_free(ptr, size, 0, None)

    def stats(self) -> LendStats:
        out = (ctypes.c_uint64 * 8)()
        self.lib.leto_lend_stats(out)
        return LendStats(*(int(v) for v in out))


def live_bytes_in(snapshot: list[dict], regions: list[tuple[int, int]]) -> int:
    """Bytes of live blocks (allocated, or freed but still used by a stream) inside the
    regions, from a caching-allocator snapshot (``torch.cuda.memory_snapshot``)."""
    live = 0
    for seg in snapshot:
        addr = seg["address"]
        for block in seg["blocks"]:
            a = block.get("address", addr)
            addr = a + block["size"]
            if not block["state"].startswith("active"):
                continue
            if any(lo <= a < lo + n for lo, n in regions):
                live += block["size"]
    return live


class Lender:
    """Lends ``regions`` (tensors of reusable pool memory on one CUDA device) to
    activations inside ``with lender.lend():``; ``reclaim()`` hands them back."""

    def __init__(self, regions: list[torch.Tensor]):
        if not regions or any(r.device.type != "cuda" for r in regions):
            raise InvalidInput("only CUDA memory can be lent (see the module docstring)")
        self.regions = [(r.data_ptr(), r.numel() * r.element_size()) for r in regions]
        self.device = regions[0].device
        global _current
        if _current is not None:
            _current.retire()  # the C allocator is one per process: one lender at a time
        self.allocator = RegionAllocator()
        # Device memory only: a host fallback left by a CPU test in this process would
        # hand kernels host pointers (found on the H200: an illegal address in sgemm).
        self.allocator.use_driver_fallback()
        self.allocator.set_regions(self.regions)
        _current = self
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            str(self.allocator.path), "leto_lend_alloc", "leto_lend_free"
        )
        self.pool = torch.cuda.MemPool(pluggable.allocator())
        self.lent_bytes = sum(n for _, n in self.regions)

    @contextlib.contextmanager
    def lend(self):
        if self.pool is None:
            raise InvalidInput("this lender was retired: a newer updater lends its own memory")
        warm_workspaces(self.device)  # before the pool: library workspaces stay out of it
        begin = getattr(torch._C, "_cuda_beginAllocateToPool", None)
        if begin is None:  # older PyTorch: this thread only (forward activations)
            with torch.cuda.use_mem_pool(self.pool, device=self.device):
                yield
            return
        # As torch.cuda.use_mem_pool, but for every thread: backward runs on autograd's
        # device thread, and its temporaries must share the pool with the forward
        # activations they replace, or each pool keeps its own peak.
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        begin(idx, self.pool.id)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(idx, self.pool.id)
            torch._C._cuda_releasePool(idx, self.pool.id)

    def reclaim(self) -> None:
        """Raise unless every lent byte is free again (called before the buffers are
        written: the caller's stream order then keeps freed activations' last readers
        ahead of the updater's writes)."""
        live = live_bytes_in(
            torch.cuda.memory_snapshot(self.pool.id, include_traces=False), self.regions
        )
        if live:
            raise LentMemoryInUse(
                f"{live} bytes allocated during the compute phase in memory lent by the "
                "updater are still alive; the updater's buffers would overwrite them. Drop "
                "references to activations (e.g. `del logits`) before protect_grads, and create "
                "long-lived library workspaces before lending. Retained state is untouched."
            )

    def stats(self) -> LendStats:
        return self.allocator.stats()

    def retire(self) -> None:
        """Give every segment back (a new updater in this process lends new regions).
        PyTorch frees a MemPool's cached segments through the allocator when the pool
        dies, and aborts the process if a tensor of a dead pool is freed later: so
        refuse while one is alive."""
        if self.pool is None:
            return
        self.reclaim()
        torch.cuda.synchronize(self.device)
        self.pool = None


_current: Lender | None = None
