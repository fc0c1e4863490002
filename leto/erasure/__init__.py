"""Two-tier Reed–Solomon erasure code over GF(2^16) for protection groups of pages.

Public API::

    from leto.erasure import ReedSolomon, TwoTierCode, FIELD_POLY

``ReedSolomon(data_pages, parity_pages)`` is a systematic MDS code: any ``parity_pages``
erased pages of a group (data or parity) are rebuilt from the survivors.
``TwoTierCode`` stacks a second code over the tier-1 parity pages (paper §4.1).

Byte order: a page's bytes are read as little-endian 16-bit field symbols, symbol
``s = byte[2s] | byte[2s+1] << 8``. A page of odd length ends with a half symbol
whose high byte is taken as zero; its parity pages are then one byte longer
(``parity_page_bytes``) so that no parity bit is dropped.

Not covered here: where pages live and how they are found to be lost
(``leto.memory``), and when parity is consistent with data (``leto.update``). The codec
does not detect corruption by itself: ``reconstruct`` trusts the pages it is told are
intact; use ``verify`` to check a group.
"""

from leto.erasure.codec import ReedSolomon
from leto.erasure.errors import (
    ErasureError,
    PageDTypeError,
    PageRangeError,
    PageShapeError,
    TooManyErasures,
)
from leto.erasure.field import FIELD_POLY, SYMBOL_BYTES
from leto.erasure.two_tier import TwoTierCode

__all__ = [
    "FIELD_POLY",
    "SYMBOL_BYTES",
    "ErasureError",
    "PageDTypeError",
    "PageRangeError",
    "PageShapeError",
    "ReedSolomon",
    "TooManyErasures",
    "TwoTierCode",
]
