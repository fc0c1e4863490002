"""Lending the updater's buffers to activations: the C region allocator on the CPU
(malloc as its fallback), the live-block check, and on the GPU the real MemPool."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.errors import InvalidInput
from leto.memory.lending import LentMemoryInUse, RegionAllocator, live_bytes_in

MiB = 1 << 20


@pytest.fixture(scope="module")
def regions():
    # Two disjoint host buffers stand in for pool regions (the allocator never touches
    # the memory it hands out, only addresses).
    bufs = [ctypes.create_string_buffer(64 * MiB), ctypes.create_string_buffer(32 * MiB)]
    return bufs, [(ctypes.addressof(b), ctypes.sizeof(b)) for b in bufs]


@pytest.fixture
def alloc(regions):
    a = RegionAllocator()
    a.use_libc_fallback()
    a.set_regions(regions[1])
    yield a
    a.set_regions([])  # refuses (and fails the test) if a piece was left handed out
    a.use_driver_fallback()  # process-wide: a later GPU test's Lender must get device memory


def inside(ptr: int, size: int, regions) -> bool:
    return any(lo <= ptr and ptr + size <= lo + n for lo, n in regions)


def test_large_segments_come_from_the_lent_regions_small_ones_do_not(alloc, regions):
    big = alloc.alloc(20 * MiB)
    small = alloc.alloc(2 * MiB)
    try:
        assert inside(big, 20 * MiB, regions[1]), "a 20 MiB segment was not lent"
        assert not inside(small, 2 * MiB, regions[1]), "a 2 MiB small-block segment was lent"
        s = alloc.stats()
        assert (s.lent_in_use_bytes, s.fallback_in_use_bytes) == (20 * MiB, 2 * MiB), s
    finally:
        alloc.free(big, 20 * MiB)
        alloc.free(small, 2 * MiB)
    assert alloc.stats().lent_in_use_bytes == 0


def test_a_segment_larger_than_any_region_falls_back(alloc, regions):
    p = alloc.alloc(80 * MiB)
    assert p and not inside(p, 80 * MiB, regions[1])
    alloc.free(p, 80 * MiB)


def test_regions_cannot_be_replaced_while_a_piece_is_handed_out(alloc, regions):
    p = alloc.alloc(8 * MiB)
    with pytest.raises(LentMemoryInUse, match="still have pieces handed out"):
        alloc.set_regions(regions[1])
    alloc.free(p, 8 * MiB)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(4, 40), st.integers(0, 1000)), min_size=1, max_size=60
    )
)
def test_pieces_never_overlap_and_freeing_everything_restores_the_regions(regions, ops):
    """Random alloc/free sequences: live pieces are disjoint and inside a region, and
    after freeing all, every region is one free piece again (coalescing works)."""
    alloc = RegionAllocator()
    alloc.use_libc_fallback()
    alloc.set_regions(regions[1])
    live: dict[int, int] = {}
    for is_alloc, mib, pick in ops:
        if is_alloc or not live:
            p = alloc.alloc(mib * MiB)
            assert p, "fallback malloc failed"
            if inside(p, mib * MiB, regions[1]):
                for q, n in live.items():
                    assert p + mib * MiB <= q or q + n <= p, f"piece {p:#x} overlaps {q:#x}"
            live[p] = mib * MiB
        else:
            q = sorted(live)[pick % len(live)]
            alloc.free(q, live.pop(q))
    for q, n in live.items():
        alloc.free(q, n)
    s = alloc.stats()
    assert s.lent_in_use_bytes == 0 and s.fallback_in_use_bytes == 0, s
    assert s.pieces == len(regions[1]), f"{s.pieces} pieces left for {len(regions[1])} regions"


def test_live_blocks_in_lent_regions_are_found_in_a_snapshot():
    regions = [(0x10000, 0x10000)]
    snapshot = [
        {
            "address": 0x10000,
            "blocks": [
                {"address": 0x10000, "size": 0x4000, "state": "inactive"},
                {"address": 0x14000, "size": 0x2000, "state": "active_allocated"},
                {"address": 0x16000, "size": 0xA000, "state": "active_pending_free"},
            ],
        },
        {"address": 0x90000, "blocks": [{"size": 0x1000, "state": "active_allocated"}]},
    ]
    assert live_bytes_in(snapshot, regions) == 0x2000 + 0xA000
    assert live_bytes_in(snapshot[1:], regions) == 0


@pytest.mark.gpu
def test_forward_activations_live_in_lent_pool_memory_and_are_checked():
    from leto.memory.lending import Lender

    cupy = pytest.importorskip("cupy")
    # Memory outside PyTorch's caching allocator, as the pool's VMM pages are (a region
    # from torch.empty would share its address with the lent segment in PyTorch's map).
    raw = cupy.cuda.Memory(256 * MiB)
    region = torch.from_dlpack(
        cupy.ndarray((256 * MiB,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(raw, 0))
    )
    lender = Lender([region])
    lo, n = region.data_ptr(), region.numel()
    with lender.lend():
        act = torch.ones(32 * MiB // 4, device="cuda")
    assert lo <= act.data_ptr() < lo + n, "a 32 MiB activation was not placed in lent memory"
    with pytest.raises(LentMemoryInUse, match="still alive"):
        lender.reclaim()
    del act
    lender.reclaim()
    assert lender.stats().lent_peak_bytes >= 32 * MiB
    second = Lender([region[: 128 * MiB]])  # a new updater in this process
    with pytest.raises(InvalidInput, match="retired"):
        with lender.lend():
            pass
    with second.lend():
        act = torch.ones(32 * MiB // 4, device="cuda")
    assert lo <= act.data_ptr() < lo + 128 * MiB
    del act
    second.reclaim()


@pytest.mark.gpu
def test_workspaces_are_warmed_once_per_device_outside_any_pool_then_lending_finds_none():
    # What a parked shadow runs: afterwards a lend's matmuls (forward and autograd's
    # backward thread) allocate no library workspace inside the lent pool.
    import cupy

    from leto.memory import lending

    dev = torch.device("cuda", torch.cuda.current_device())
    lending.load_library()
    lending.warm_workspaces(torch.device("cuda"))  # no index: the current device
    assert dev.index in lending._WARMED
    before = torch.cuda.memory_allocated(dev)
    lending.warm_workspaces(dev)  # once per device: nothing runs again
    assert torch.cuda.memory_allocated(dev) == before
    raw = cupy.cuda.Memory(64 * MiB)
    region = torch.from_dlpack(
        cupy.ndarray((64 * MiB,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(raw, 0))
    )
    lender = lending.Lender([region])
    with lender.lend():
        w = torch.ones(256, 256, device=dev, requires_grad=True)
        (w @ w).sum().backward()
    del w
    lender.reclaim()  # raises if a workspace had been created inside the pool


def test_the_lending_library_loads_ahead_of_any_lender():
    from leto.memory import lending

    lending.load_library()  # builds (cached per source version) and loads the C allocator
    assert lending.build_library().exists()


def test_the_host_fallback_of_cpu_tests_is_undone_for_device_lenders(regions):
    # The C allocator's state is process-wide: a malloc fallback left behind would give a
    # GPU lender's kernels host pointers. Without a CUDA driver the restored fallback
    # (cuMemAlloc) fails the request instead of handing out host memory.
    if ctypes.util.find_library("cuda"):
        # There cuMemAlloc succeeds; the GPU test of warmed workspaces lends with matmuls
        # after this file's CPU tests, which is where the host pointers crashed.
        pytest.skip("a CUDA driver is present: the driver fallback would succeed")
    a = RegionAllocator()
    a.use_libc_fallback()
    a.set_regions(regions[1])
    small = a.alloc(1 << 20)
    assert small and not inside(small, 1 << 20, regions[1])  # malloc'd
    a.free(small, 1 << 20)
    a.use_driver_fallback()
    failed = a.stats().failed_segments
    assert a.alloc(1 << 20) == 0
    assert a.stats().failed_segments == failed + 1
    a.set_regions([])
