"""The one error hierarchy of Leto.

Every error says what happened, what was kept and what to do. Two families matter to
the runtime: a ``RecoverableFailure`` (hardware-operable, HOF-class) is handled in
place; a ``FatalFailure`` means retained state cannot be trusted and the job must fall
back to a checkpoint. Input errors (bad shapes, wrong dtypes, out-of-range pages) are
neither: they are caller bugs and change no state.
"""

from __future__ import annotations

# A trainer's exit code for a FatalFailure (its retained state cannot be restored): the
# agent then falls back to the checkpoint. leto.init() makes an uncaught FatalFailure
# exit with it.
EXIT_FATAL = 13
# A trainer's exit code for a RecoverableFailure raised on purpose (a replay mismatch, a
# replica that disagreed): the agent recovers in place, as for a kill — every rank may
# raise it at once, and it is not a script error.
EXIT_RECOVERABLE = 14


class LetoError(Exception):
    """Root of every error Leto raises on purpose."""


class RecoverableFailure(LetoError):
    """A hardware-operable failure (HOF): recover in place on the same hardware."""


class FatalFailure(LetoError):
    """Retained state is lost beyond repair: fall back to checkpoint recovery."""


class RetainedStateLost(FatalFailure):
    """Retained state of this rank cannot be restored exactly: use a checkpoint."""


class WrongComputation(LetoError):
    """A check found a wrong computation (gradient replay, the replica check, the update
    recheck): ``iteration`` and the ranks it ``named`` (empty when none could be). The
    trainer's error file carries both, so the agent can tell a GPU named twice
    (``leto.integrity.faulty``)."""

    def __init__(self, message: str, iteration: int | None = None, named=()):
        super().__init__(message)
        self.iteration, self.named = iteration, sorted(named)


class InvalidInput(LetoError, ValueError):
    """A caller passed something malformed; nothing was read or written."""
