"""Process liveness, for whoever watches a process it did not start (no torch here: the
state manager imports it)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped) counts as dead — its
    memory and device contexts are gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def started_at(pid: int | str = "self") -> float | None:
    """When ``pid`` started, wall clock (``/proc``: its start in clock ticks after boot,
    plus the boot time); None where ``/proc`` does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
