"""The open-file limit of the processes that pass page descriptors: the state manager
(one exported fd per device page, dup'ed into each reply) and its clients (a reply's
fds are all received before they are imported). A 3 B-parameter model's pool is
~22,500 2-MiB pages, a 5 B one ~40,000: past a common hard limit of 20,000, the first
attach failed with EMFILE on the H200 (docs/benchmarks.md, 2026-12-01).

Runs in every process that opens a pool connection. Not covered: pools larger than
what ``fs.nr_open`` allows (a reply is received whole; larger pages need fewer fds).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

# Enough for a reply of every page of ~120,000 pages (240 GiB of 2 MiB pages) beside
# the state manager's cached exports; far below the kernel's usual fs.nr_open (2^20).
WANT = 1 << 18


def raise_limit(want: int = WANT) -> int:
    """Raise this process's open-file limit towards ``want``: the hard limit too where
    the process may (root, CAP_SYS_RESOURCE), else the soft one up to the hard. Returns
    the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        nr_open = hard
    target = min(want, nr_open)
    if hard < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
            return target
        except (ValueError, OSError):
            pass  # not privileged: the hard limit is the ceiling
    if soft < min(target, hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(target, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def room() -> int:
    """How many more descriptors this process may open now."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] - len(os.listdir("/proc/self/fd"))
