"""The kernel trip-wire (faultkit kernel-abort): an operation stopped after N blocks
leaves exactly the first N blocks' output and the rest untouched.

CPU tests exercise the emulation (the same calls the CUDA path makes); GPU tests run
the real trip-wire in ``gf_matmul.cu`` and ``tripwire_copy.cu`` on the H200. Every test
arms with ``kill=False``: the held blocks are released and ``TripwireFired`` is raised
instead of the SIGKILL, so the partial output can be inspected. The kill itself is
exercised end to end by faultkit's kernel-abort runs (tests/test_faultkit_inject.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.erasure.kernels.api import Coefficients
from leto.erasure.kernels.cpu import CpuKernel
from nvbit_tools import tripwire


@pytest.fixture(autouse=True)
def _disarmed():
    tripwire.disarm()
    yield
    tripwire.disarm()


def _pages(n, nbytes, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)
        for _ in range(n)
    ]


def test_disarmed_operations_never_fire():
    assert not tripwire.armed()
    assert tripwire.launch_arg(torch.device("cpu"), 10) == 0
    tripwire.fire(torch.device("cpu"))  # a no-op: the test process is still alive


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=4),
    after=st.integers(1, 12),
)
def test_cpu_land_writes_exactly_the_first_n_tiles(sizes, after):
    src = [torch.full((n,), 0xAB, dtype=torch.uint8) for n in sizes]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    tripwire.arm(after, kill=False)
    with pytest.raises(tripwire.TripwireFired) as e:
        tripwire.land(dst, src)
    written = torch.cat(dst).eq(0xAB).sum().item()
    tiles = [-(-n // tripwire.CPU_TILE) for n in sizes]
    # Tiles land page after page; the written bytes are the first N tiles' bytes.
    expect, left = 0, after
    for n, t in zip(sizes, tiles, strict=True):
        k = min(left, t)
        expect += min(n, k * tripwire.CPU_TILE)
        left -= k
    assert written == expect
    assert e.value.report["partial"] == (after < sum(tiles))
    assert e.value.report["after_blocks"] == after
    assert not tripwire.armed()


def test_cpu_codec_kernel_stops_after_n_tile_columns():
    """The parity update under the trip-wire: the first N tile columns of every parity
    page hold the new parity, the rest the old."""
    k = CpuKernel()
    coeffs = Coefficients([[1, 2, 3], [4, 5, 6]])
    nbytes = 4 * tripwire.CPU_TILE
    data = _pages(3, nbytes, 1)
    old = _pages(2, nbytes, 2)
    full = [p.clone() for p in old]
    k.matmul(coeffs, data, full, accumulate=True)
    got = [p.clone() for p in old]
    tripwire.arm(3, kill=False)  # 2 pages x 4 columns = 8 tiles; column-major: 1.5 columns
    with pytest.raises(tripwire.TripwireFired):
        k.matmul(coeffs, data, got, accumulate=True)
    T = tripwire.CPU_TILE
    assert torch.equal(got[0][: 2 * T], full[0][: 2 * T])  # columns 0, 1 of page 0
    assert torch.equal(got[1][:T], full[1][:T])  # column 0 of page 1
    assert torch.equal(got[1][T:], old[1][T:])  # column 1 of page 1 did not land
    assert torch.equal(got[0][2 * T :], old[0][2 * T :])
    assert not torch.equal(got[1][T : 2 * T], full[1][T : 2 * T])


def test_fewer_blocks_than_n_completes_the_operation():
    src, dst = [torch.ones(100, dtype=torch.uint8)], [torch.zeros(100, dtype=torch.uint8)]
    tripwire.arm(5, kill=False)
    with pytest.raises(tripwire.TripwireFired) as e:
        tripwire.land(dst, src)
    assert torch.equal(dst[0], src[0])
    assert e.value.report["partial"] is False


def test_bad_block_count_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        tripwire.arm(0)


# -- the real trip-wire on the GPU -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("launched", [64, 5])  # held back after N = 5; exactly N: whole
def test_gpu_copy_kernel_holds_blocks_after_n(launched):
    dev = torch.device("cuda", 0)
    n = launched * tripwire.CUDA_TILE
    src = [torch.full((n,), 7, dtype=torch.uint8, device=dev)]
    dst = [torch.zeros(n, dtype=torch.uint8, device=dev)]
    tripwire.arm(5, kill=False)
    with pytest.raises(tripwire.TripwireFired) as e:
        tripwire.land(dst, src)
    tiles = dst[0].view(-1, tripwire.CUDA_TILE)
    full = tiles.eq(7).all(dim=1)
    untouched = tiles.eq(0).all(dim=1)
    assert int(full.sum()) == 5, "exactly N blocks ran"
    assert bool((full | untouched).all()), "a block wrote all of its tile or nothing"
    assert e.value.report["partial"] is (launched > 5), "partial only if blocks were held"
    assert e.value.report["blocks_launched"] == launched


@pytest.mark.gpu
def test_gpu_copy_into_page_locked_host_memory():
    """The parity store copies device -> host pages registered with cudaHostRegister."""
    dev = torch.device("cuda", 0)
    n = 16 * tripwire.CUDA_TILE
    host = torch.zeros(n, dtype=torch.uint8)
    assert torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 0) == 0
    try:
        src = [torch.full((n,), 9, dtype=torch.uint8, device=dev)]
        tripwire.arm(3, kill=False)
        with pytest.raises(tripwire.TripwireFired):
            tripwire.land([host], src)
        assert int(host.view(-1, tripwire.CUDA_TILE).eq(9).all(dim=1).sum()) == 3
    finally:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


@pytest.mark.gpu
def test_gpu_codec_kernel_stops_after_n_blocks():
    from leto.erasure.kernels.cuda import THREADS, CudaKernel

    dev = torch.device("cuda", 0)
    k = CudaKernel()
    coeffs = Coefficients([[3, 5, 7, 11]] * 4)
    nbytes = 1 << 20
    data = _pages(4, nbytes, 3, dev)
    old = _pages(4, nbytes, 4, dev)
    full = [p.clone() for p in old]
    k.matmul(coeffs, data, full, accumulate=True)
    got = [p.clone() for p in old]
    tripwire.arm(7, kill=False)
    with pytest.raises(tripwire.TripwireFired) as e:
        k.matmul(coeffs, data, got, accumulate=True)
    block = k.threads * 16 if k.threads else THREADS * 16  # bytes of a page per block
    new = torch.stack([g.view(-1, block) for g in got])  # rows x blocks x bytes
    ref = torch.stack([f.view(-1, block) for f in full])
    was = torch.stack([o.view(-1, block) for o in old])
    done = new.eq(ref).all(dim=2).all(dim=0)
    kept = new.eq(was).all(dim=2).all(dim=0)
    assert int(done.sum()) == 7 and bool((done | kept).all())
    assert e.value.report["blocks_launched"] == nbytes // block
