"""Leto: in-place recovery for PyTorch training.

Subpackages follow the process model: ``leto.erasure`` (field, codec, kernels; used by
every process that touches parity), ``leto.memory`` (the state manager and its pool),
``leto.update`` (resumable updater), ``leto.runtime`` (launcher, cells, shadows,
monitor), ``leto.sim`` (ETTR model and simulator).
"""

__version__ = "0.1.0"


def init(prepare=None, warmup=None):
    """Start (or, for a shadow, park until promoted) this rank under ``leto run``; see
    ``leto.runtime.api.init``. Imported lazily: the state manager never imports torch."""
    from leto.runtime.api import init as _init

    return _init(prepare, warmup)


def __getattr__(name):
    # ``leto.Run`` (the script-facing API, ``leto.runtime.run``), imported on first use.
    if name == "Run":
        from leto.runtime.run import Run

        return Run
    raise AttributeError(f"module 'leto' has no attribute {name!r}")
