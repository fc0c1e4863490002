"""The job store: torch.distributed's TCPStore, the only channel between node agents
and the trainers' process groups. Keys live under ``leto/``; per recovery generation
under ``leto/gen{g}/``.

Runs in agents (node 0's agent hosts the server) and in trainers (clients).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from leto.job import keys


def connect(addr: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        addr,
        port,
        is_master=is_master,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        use_libuv=True,
    )


def counter(store: dist.Store, key: str) -> int:
    return int(store.add(key, 0))


def wait_count(store: dist.Store, key: str, n: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while counter(store, key) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f} s for {what}: {counter(store, key)} of {n} ({key})"
            )
        time.sleep(0.01)


def pg_store(store: dist.Store, generation: int, attempt: str = "0.0") -> dist.PrefixStore:
    """Where generation ``generation``'s trainers form their process group. ``attempt``
    ("<checkpoint fallbacks>.<L3 shadow restarts>"): trainers started again must not
    meet the addresses that dropped L3 shadows of the same generation left in the store."""
    return dist.PrefixStore(keys.pg_prefix(generation, attempt), store)


def free_port() -> int:
    """A TCP port free on this machine now (for a job store or a test's process group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingStore:
    """A store that counts the requests made through it (the agent's monitor load on
    the job's TCPStore, reported in ``leto run``'s summary). Python-side only: it is not
    a ``dist.Store`` and must not be handed to torch.distributed."""

    REQUESTS = ("get", "set", "add", "check", "multi_get", "multi_set", "compare_set",
                "wait", "delete_key", "num_keys", "append")  # fmt: skip

    def __init__(self, store: dist.Store):
        self._store = store
        self.requests = 0
        self.since = time.monotonic()

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if name not in self.REQUESTS:
            return attr

        def counted(*args, **kwargs):
            self.requests += 1
            return attr(*args, **kwargs)

        return counted

    def rate(self) -> float:
        """Requests per second since this wrapper was made."""
        return self.requests / max(time.monotonic() - self.since, 1e-9)
