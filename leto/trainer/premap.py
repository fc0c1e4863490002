"""A parked shadow's view of its rank's pool, mapped ahead of a promotion.

Runs in an L2/L3 shadow while it parks. It connects to the state manager as a shadow
(``leto.memory.client.PoolClient.premap``): every page of every allocation imported and
mapped, host parity mapped and page-locked for the GPU, and again every ``every_s`` for
what the trainer allocated since (and for pages localization replaced since). Nothing
reads a page's contents: the trainer owns them. On promotion the same connection takes
the pool over and localizes; pages the localization replaced are mapped again before
anything can touch them, so the promoted trainer attaches without importing a page.

A state manager that cannot be reached, or an error while premapping, costs only the
head start: the shadow drops its premapped view (said in its log) and connects cold at
promotion, as without premapping.
"""

from __future__ import annotations

import sys
import time

from leto.memory.backends.cuda import CudaError
from leto.memory.client import PoolClient
from leto.memory.errors import PoolError

# What premapping may meet: the pool (refusals, timeouts), the socket, and the CUDA
# driver importing or pinning a page. Any of them costs only the head start.
_COSTS_THE_HEAD_START = (PoolError, OSError, CudaError)


class Premap:
    def __init__(self, socket_path: str, token: str, timeout_s: float, rank: int):
        self.socket_path, self.token, self.timeout_s = socket_path, token, timeout_s
        self.rank = rank
        self.client: PoolClient | None = None
        self.calls = 0
        self.seconds = 0.0  # spent premapping while parked
        self.why_not: str | None = None  # set when premapping was given up

    def tick(self) -> None:
        """Map what is new; never raises (a failure drops the premapped view)."""
        if self.why_not is not None:
            return
        t0 = time.perf_counter()
        try:
            if self.client is None:
                self.client = PoolClient.connect(
                    self.socket_path, self.token, role="shadow", timeout_s=self.timeout_s
                )
            self.client.premap()
            self.calls += 1
        except _COSTS_THE_HEAD_START as e:
            self.drop(f"premapping failed ({type(e).__name__}: {e})")
        finally:
            self.seconds += time.perf_counter() - t0

    def drop(self, why: str) -> None:
        self.why_not = why
        print(f"rank {self.rank}: shadow: {why}; will attach cold", file=sys.stderr, flush=True)
        if self.client is not None:
            try:
                self.client.close()
            except _COSTS_THE_HEAD_START:
                pass
            self.client = None

    def promote(self) -> PoolClient | None:
        """The premapped client, now the pool's trainer (None: attach cold)."""
        self.tick()  # what the trainer allocated in its last moments
        if self.client is None:
            return None
        try:
            self.client.takeover()
        except _COSTS_THE_HEAD_START as e:
            self.drop(f"taking the pool over on the premapped connection failed ({e})")
            return None
        return self.client

    def summary(self) -> dict:
        c = self.client
        return {
            "premapped": c is not None,
            "premap_calls": self.calls,
            "premap_s": self.seconds,
            "premapped_allocations": len(c.mapped) if c is not None else 0,
            **({"premap_dropped": self.why_not} if self.why_not else {}),
        }
