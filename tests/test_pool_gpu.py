"""The Resilient Memory Pool on a GPU: CUDA VMM pages, lost with cuMemUnmap.

Runs on a CUDA machine (``bench/gpu_suite.sh``); skipped with a reason without CUDA.
The same cycle as the CPU tests: a trainer dies mid-write, pages are lost, the
successor localizes, re-attaches, reconstructs on the GPU and compares bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from leto.erasure import TooManyErasures
from leto.memory.client import PoolClient
from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager

pytestmark = pytest.mark.gpu
MiB = 1 << 20
PAGES = 512  # 1 GiB of 2 MiB pages
SPAWN = mp.get_context("spawn")


def gpu_pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def child_fill_protect_then_scribble(socket_path: str, token: str, n: int, ready) -> None:
    c = PoolClient.connect(socket_path, token)
    state = c.attach("state", n)
    state.copy_(gpu_pattern(n, 7))
    c.encode_parity()
    scratch = c.attach("scratch", 64 * MiB)
    torch.cuda.synchronize()
    ready.set()
    v = 0
    while True:  # in-place kernels in flight when SIGKILL lands
        v = (v + 1) % 251
        scratch.fill_(v)
        scratch.add_(1)


@pytest.fixture
def gpu_pool():
    sm = start_state_manager(PoolConfig.for_cuda(0, allow_fault_injection=True))
    yield sm
    assert sm.stop() == 0


def test_trainer_killed_mid_kernel_then_16_lost_pages_rebuilt_bit_exact(gpu_pool):
    n = PAGES * 2 * MiB
    ready = SPAWN.Event()
    child = SPAWN.Process(
        target=child_fill_protect_then_scribble,
        args=(str(gpu_pool.socket_path), gpu_pool.token, n, ready),
    )
    child.start()
    assert ready.wait(120), "child trainer never finished filling"
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    with PoolClient.connect(gpu_pool.socket_path, gpu_pool.token, role="faultkit") as f:
        f.inject_loss("data", "state", list(range(100, 116)))  # H1 = 16 pages of group 0
        f.inject_loss("tier1", 0, [5])
    with PoolClient.connect(gpu_pool.socket_path, gpu_pool.token) as c:
        report = c.localize()
        assert report["allocations"]["state"]["failed_pages"] == list(range(100, 116))
        assert report["groups"]["0"]["tier1"] == [5]
        assert report["mechanism"]["device"].startswith("cuMemUnmap")
        state = c.attach("state", n)
        c.attach("scratch", 64 * MiB)
        summary = c.reconstruct(report)
        assert summary["data_pages"] == 16 and summary["tier1_pages"] == 1
        assert torch.equal(state, gpu_pattern(n, 7)), (
            "rebuilt pool differs from what the dead trainer wrote"
        )


def test_17_lost_pages_in_a_group_is_fatal(gpu_pool):
    n = 64 * 2 * MiB
    with PoolClient.connect(gpu_pool.socket_path, gpu_pool.token) as c:
        c.attach("state", n).copy_(gpu_pattern(n, 1))
        c.encode_parity()
    with PoolClient.connect(gpu_pool.socket_path, gpu_pool.token, role="faultkit") as f:
        f.inject_loss("data", "state", list(range(17)))
    with PoolClient.connect(gpu_pool.socket_path, gpu_pool.token) as c:
        report = c.localize()
        c.attach("state", n)
        with pytest.raises(TooManyErasures, match="protection group 0: 17 pages lost"):
            c.reconstruct(report)


def test_a_premapped_shadow_remaps_lost_vmm_pages_then_rebuilds_them_bit_exact(gpu_pool):
    # leto.trainer.premap on CUDA VMM pages: the shadow imports and maps while the
    # trainer owns the pool; the owner loses pages (cuMemUnmap + release), the shadow
    # takes over and localizes, and its mapping at those addresses now holds the fresh
    # zeroed pages (its old import would have kept the lost memory readable) until
    # reconstruction rebuilds them.
    n = 64 * 2 * MiB
    t = PoolClient.connect(gpu_pool.socket_path, gpu_pool.token)
    want = gpu_pattern(n, 11)
    t.attach("state", n).copy_(want)
    t.encode_parity()
    torch.cuda.synchronize()
    s = PoolClient.connect(gpu_pool.socket_path, gpu_pool.token, role="shadow")
    free_before = torch.cuda.mem_get_info()[0]
    assert s.premap() == 1
    torch.cuda.synchronize()
    # Premapping maps memory the pool already holds: what it costs the device is page
    # tables, not the pages (the preinit footprints need no premap term; docs/preinit.md).
    cost = free_before - torch.cuda.mem_get_info()[0]
    print(f"premap device memory cost: {cost} bytes for {n} bytes of device pages mapped")
    assert cost <= 4 * MiB
    view = s.attach("state", n)
    tier1 = s.layout()[0].tier1[0]  # host parity, page-locked for the GPU while parked
    with PoolClient.connect(gpu_pool.socket_path, gpu_pool.token, role="faultkit") as f:
        f.inject_loss("data", "state", [0, 9])
        f.inject_loss("tier1", "0", [0])
    t.close()
    s.takeover()
    # As a promoted trainer: the host parity scan is left running, then settled.
    report = s.localize(defer_parity=True)
    assert s.remapped == 2 and report["allocations"]["state"]["failed_pages"] == [0, 9]
    assert view.data_ptr() == s.pages_of("state").data_ptr()
    assert int(view[: 2 * MiB].count_nonzero()) == 0  # the fresh page, not the lost one
    s.settle_localize()
    assert s.remapped == 3 and report["groups"]["0"]["tier1"] == [0]
    assert int(tier1.count_nonzero()) == 0  # remapped in place, registered again
    s.reconstruct(report)
    assert torch.equal(view, want)
    rebuilt = tier1.clone()
    s.encode_parity()
    assert torch.equal(tier1, rebuilt)  # the rebuilt parity page agrees with encoding
    s.close()
