"""Errors of the memory pool. Each says what happened, what was kept and what to do."""

from __future__ import annotations

from leto.errors import InvalidInput, LetoError


class PoolError(LetoError):
    """Base of every pool error raised on the trainer side."""


class PoolProtocolError(PoolError, InvalidInput):
    """A message was malformed, oversized, truncated or out of order. Nothing changed."""


class PoolAuthError(PoolError):
    """The peer is not allowed: wrong user, wrong job token or wrong role."""


class FencedError(PoolError):
    """This trainer's epoch is stale: a successor owns the pool. It must stop writing."""


class PoolOwnedError(PoolError):
    """A live trainer owns the pool; attach with takeover=True to fence it."""


class AllocationMismatch(PoolError, InvalidInput):
    """An allocation exists under this name with another size or kind. Nothing changed."""


class PoolTimeout(PoolError, TimeoutError):
    """A blocking pool operation did not finish in time."""


class PoolFdLimit(PoolError):
    """A reply's page descriptors do not fit this process's open-file limit."""


class RemoteError(PoolError):
    """The state manager refused a request; ``code`` names the reason."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(f"state manager refused [{code}]: {message}")


def remote_error(code: str, message: str) -> PoolError:
    """The trainer-side exception for an ERROR reply with ``code``."""
    cls = {
        "fenced": FencedError,
        "owned": PoolOwnedError,
        "auth": PoolAuthError,
        "forbidden": PoolAuthError,
        "mismatch": AllocationMismatch,
        "protocol": PoolProtocolError,
        "order": PoolProtocolError,
        "version": PoolProtocolError,
        "fd-limit": PoolFdLimit,
        "timeout": PoolTimeout,
    }.get(code)
    if cls is None:
        return RemoteError(code, message)
    err = cls(f"state manager refused [{code}]: {message}")
    err.code = code
    return err
