"""Leto: in-place recovery for PyTorch training.

Subpackages follow the process model: ``leto.erasure`` (field, codec, kernels; used by
every process that touches parity), ``leto.memory`` (the state manager and its pool),
``leto.update`` (resumable updater), ``leto.integrity`` (the silent-corruption checks),
``leto.launch`` (what ``leto run`` runs: the agent, cells, shadows, monitor, recovery),
``leto.trainer`` (what runs in the training script: ``leto.init``, ``leto.Run``),
``leto.job`` (what both share: configuration, fault plan, store keys), ``leto.sim``
(ETTR model and simulator).
"""

__version__ = "0.1.0"


def init(prepare=None, warmup=None):
    """Start (or, for a shadow, park until promoted) this rank under ``leto run``; see
    ``leto.trainer.api.init``. Imported lazily: the state manager never imports torch."""
    from leto.trainer.api import init as _init

    return _init(prepare, warmup)


def __getattr__(name):
    # ``leto.Run`` (the script-facing API, ``leto.trainer.run``), imported on first use.
    if name == "Run":
        from leto.trainer.run import Run

        return Run
    raise AttributeError(f"module 'leto' has no attribute {name!r}")
