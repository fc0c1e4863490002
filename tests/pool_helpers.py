"""Shared pieces of the memory-pool tests: a small pool config, child trainers, and a
socket pair with page descriptors for the protocol's tests.

Child processes are module-level functions started with the spawn context, taking
picklable arguments only (they are real, separate trainers).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import torch

from leto.memory.client import PoolClient
from leto.memory.config import PoolConfig

PAGE = 8192


@contextlib.contextmanager
def seqpacket_pair(n_pages: int = 0, timeout_s: float | None = 10):
    """The pool protocol's transport (an AF_UNIX SOCK_SEQPACKET pair, the reading end
    with a timeout) and ``n_pages`` memfds standing for pages; all closed afterwards."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.settimeout(timeout_s)
    pages: list[int] = []
    try:
        pages += [os.memfd_create(f"page{i}") for i in range(n_pages)]
        yield a, b, pages
    finally:
        for fd in pages:
            os.close(fd)
        a.close()
        b.close()


def small_config(**kw) -> PoolConfig:
    base = dict(
        page_bytes=PAGE, data_pages=16, tier1_pages=4, tier2_pages=1, allow_fault_injection=True
    )
    base.update(kw)
    return PoolConfig(**base)


def pattern(n_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=g)


def child_fill_then_scribble(socket_path: str, token: str, n_bytes: int, seed: int, ready) -> None:
    """Fill 'state' with a known pattern, report, then write 'scratch' until killed."""
    c = PoolClient.connect(socket_path, token)
    state = c.attach("state", n_bytes)
    state.copy_(pattern(n_bytes, seed))
    scratch = c.attach("scratch", n_bytes)
    ready.set()
    v = 0
    while True:  # SIGKILL arrives in the middle of one of these writes
        v = (v + 1) % 251
        scratch.fill_(v)


def child_hold_pool(socket_path: str, token: str, ready) -> None:
    """Own the pool and keep a page mapped, doing nothing else."""
    c = PoolClient.connect(socket_path, token)
    c.attach("held", PAGE)[:] = 1
    ready.set()
    time.sleep(600)
