"""Named errors of the erasure code. Each names the group and the counts involved."""

from __future__ import annotations

from leto.errors import FatalFailure, InvalidInput, LetoError


class ErasureError(LetoError):
    """Base of every codec error."""


class TooManyErasures(ErasureError, FatalFailure):
    """More pages are lost than the code tolerates: the group cannot be rebuilt.

    This is the fatal-failure signal for retained state: fall back to a checkpoint.
    """

    def __init__(self, group: object, erased: int, tolerance: int, detail: str = ""):
        self.group = group
        self.erased = erased
        self.tolerance = tolerance
        msg = (
            f"protection group {group}: {erased} pages lost but the code tolerates at most "
            f"{tolerance}; nothing was rebuilt and the surviving pages were left untouched. "
            "Retained state of this group is lost: recover from a checkpoint."
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class PageShapeError(ErasureError, InvalidInput):
    """Pages of one call differ in size, or a page count does not match the code."""


class PageDTypeError(ErasureError, InvalidInput, TypeError):
    """Pages of one call differ in dtype or device, or a tensor is not contiguous."""


class PageRangeError(ErasureError, InvalidInput, IndexError):
    """A page index lies outside the protection group."""
