"""Named ranges of Leto's work in a ``torch.profiler`` trace (``leto.<name>``): what
``bench.update_breakdown`` attributes each kernel and copy to.

Runs in the trainer (the updater and the job's per-iteration steps open them). Costs one
check of the profiler's state (~0.2 µs) when no profiler runs, and nothing else.

Not covered: work on other threads or processes (the state manager, shadows, the
agent); a range names where work was *launched*, not when the device ran it.
"""

from __future__ import annotations

import contextlib

import torch

_NONE = contextlib.nullcontext()


def leto_range(name: str):
    """Context naming the work launched inside it ``leto.<name>`` while a profiler runs."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"leto.{name}")
    return _NONE
