"""How this trainer is exiting: the hook that records an uncaught exception in the agent's
error file and turns a Leto failure into its exit code (``record_uncaught``, installed by
``leto.init()``), and whether it ran (``uncaught``, asked by ``leto.Run`` at exit).

Runs in the trainer. Not covered: a trainer killed by a signal (no hook runs; the agent
sees the signal).
"""

from __future__ import annotations

import json
import os
import sys
import time

from leto.errors import (
    EXIT_FATAL,
    EXIT_RECOVERABLE,
    FatalFailure,
    RecoverableFailure,
    WrongComputation,
)

_UNCAUGHT: list[str] = []  # the uncaught exception this trainer is dying of, if any


def uncaught() -> bool:
    """Whether this trainer is exiting with an uncaught exception (after the hook ran)."""
    return bool(_UNCAUGHT)


def record_uncaught(path: str | None) -> None:
    """An uncaught exception is written to ``path`` (type, message, traceback) before
    the interpreter reports it and exits, so the agent's record says why this trainer
    died (torch elastic's error files). An uncaught ``FatalFailure`` exits with
    ``EXIT_FATAL`` (the checkpoint fallback), a ``RecoverableFailure`` with
    ``EXIT_RECOVERABLE`` (recovery in place), so scripts need no handler."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        import traceback

        _UNCAUGHT.append(kind.__name__)
        try:
            if not path:
                raise OSError("no error file")
            with open(path, "w") as f:
                json.dump(
                    {
                        "exception": kind.__name__,
                        "message": str(value),
                        "traceback": "".join(traceback.format_exception(kind, value, tb)),
                        "time": time.time(),
                        "pid": os.getpid(),
                        # A wrong computation a check found: where, and who computed it.
                        **(
                            {"iteration": value.iteration, "named": value.named}
                            if isinstance(value, WrongComputation)
                            else {}
                        ),
                    },
                    f,
                )
        except OSError:
            pass  # the report below still reaches the trainer's log
        previous(kind, value, tb)
        if issubclass(kind, FatalFailure):
            # Retained state beyond repair: the agent falls back to the checkpoint.
            sys.stderr.flush()
            os._exit(EXIT_FATAL)
        if issubclass(kind, RecoverableFailure):
            sys.stderr.flush()
            os._exit(EXIT_RECOVERABLE)

    sys.excepthook = hook
