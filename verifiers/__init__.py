"""verifiers: fault-free reference traces and bit-exact comparison of training runs.

``Recorder`` (inside each training rank) appends one line per iteration to
``rank{r}.trace.jsonl``: the loss as ``float.hex`` and the SHA-256 of every retained
tensor's bytes, optionally saving the tensors. ``compare`` (after the runs) returns a
``Verdict`` naming the first rank, iteration, tensor and byte offset that differ;
``report`` plots loss and throughput with injections and recoveries marked. The command
is ``python -m verifiers {compare,report}``; the format is in ``docs/verifiers.md``.

Not covered: tolerances (every comparison is exact), state that was never recorded.
"""

from verifiers.compare import Divergence, RerunDiffered, Verdict, compare
from verifiers.recorder import Recorder
from verifiers.trace import EVENT_INJECTION, EVENT_RECOVERED, EVENT_ROLLED_BACK, read_run


def report(*args, **kwargs):
    """``verifiers.plots.report`` (imported on first use: matplotlib costs every
    training process ~0.4 s of start-up, and only plots need it)."""
    from verifiers.plots import report as _report

    return _report(*args, **kwargs)


__all__ = [
    "EVENT_INJECTION",
    "EVENT_RECOVERED",
    "EVENT_ROLLED_BACK",
    "Divergence",
    "Recorder",
    "RerunDiffered",
    "Verdict",
    "compare",
    "read_run",
    "report",
]
