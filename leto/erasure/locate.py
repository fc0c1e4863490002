"""Silent errors in a protection group: syndromes, and the decoder that locates them.

Runs in the trainer (device pages, host parity) and in tests. Erasures are pages known
to be lost (the pool's localization names them); a *silent* error is a page whose bytes
changed without anyone noticing (a bit flip ECC missed, a stray write). The code finds
those too: a codeword is one symbol position ``s`` across the D data and H parity
pages, and its syndrome is ``S = G · data[:, s] ⊕ parity[:, s]`` (H symbols; zero when
consistent). An error of value ``e`` in column ``k`` adds ``h_k · e`` to it, where
``h_k`` is G's column for a data page and the unit vector ``u_j`` for parity page j.

Decoding, per codeword with a non-zero syndrome (on the host: only those codewords
leave the device):

* one error (H ≥ 2): in closed form. A parity page ``j`` leaves only ``S_j`` non-zero
  (G has no zero entry, so no data error does that). A data page ``i`` has
  ``G[0][i] = 1``, so ``e = S_0``, and ``S_1 / S_0 = y / (1 ⊕ y)`` with ``y = H + i``
  gives ``y = r / (1 ⊕ r)``; every other row must agree (``S_j = G[j][i] · e``).
* two errors (H ≥ 5): every pair of columns, solved on rows 0 and 1 and checked on
  the others (vectorised; only for codewords one error does not explain).
* anything else: detected, not located (``Unlocatable`` names the group and where).

Why not more: the code's distance is H + 1, so decoding up to t errors still *detects*
every pattern of up to H − t errors without mistaking it for another one; locating two
only from H = 5 keeps at least three detected, and one error with H ≥ 3 keeps two. With
H = 1 (tier 2 as XOR) nothing can be located, only detected.

Not covered: correcting the pages (``SymbolError.apply`` does it; *whether* to is the
scrubber's call, since a corrupted parameter may already have been read), the cost of
the pair search (≈ (D + H)² field operations per codeword: for rare codewords only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leto.erasure import field
from leto.erasure.codec import ReedSolomon
from leto.erasure.errors import ErasureError
from leto.erasure.pages import PageInput, as_pages, group_name, parity_page_bytes
from leto.errors import FatalFailure


@dataclass(frozen=True)
class SymbolError:
    """One located error: ``column`` (0..D-1 data page, D..D+H-1 parity page), the
    16-bit symbol position within the page, and the value XORed into it."""

    column: int
    symbol: int
    value: int

    def apply(self, page: torch.Tensor) -> None:
        """XOR the error out of ``page`` (a uint8 view of the page, in place)."""
        b = 2 * self.symbol
        page[b] ^= self.value & 0xFF
        if b + 1 < page.numel():
            page[b + 1] ^= self.value >> 8


class Unlocatable(ErasureError, FatalFailure):
    """Parity disagrees with the data in a way the code cannot attribute to pages."""

    def __init__(self, group: object, symbols: list[int], why: str):
        self.group, self.symbols = group, symbols
        shown = ", ".join(map(str, symbols[:8])) + (" ..." if len(symbols) > 8 else "")
        super().__init__(
            f"protection group {group}: parity disagrees with the data at {len(symbols)} "
            f"symbol position(s) ({shown}) and the errors cannot be located ({why}); "
            "nothing was changed. This group's retained state is not trustworthy: "
            "recover from a checkpoint."
        )


def syndromes(code: ReedSolomon, data: PageInput, parity: PageInput, *, group: object = None):
    """``(positions, S)``: the symbol positions whose syndrome is non-zero (a 1-D int64
    array) and their syndromes (an H × len(positions) int64 array), computed where the
    pages live; only those columns come to the host."""
    d = as_pages(data, code.data_pages, "data", group)
    pbytes = parity_page_bytes(d.page_bytes)
    stored = as_pages(parity, code.parity_pages, "parity", group)
    if stored.page_bytes != pbytes:
        raise ErasureError(
            f"protection group {group_name(group)}: parity pages of {stored.page_bytes} "
            f"bytes for data pages of {d.page_bytes}; expected {pbytes}"
        )
    fresh = code.encode(d.pages, group=group)  # H × pbytes, on the data's device
    for j in range(code.parity_pages):
        fresh[j] ^= stored.pages[j].to(fresh.device, non_blocking=True)
    # Parity pages have an even byte count: 16-bit symbols, little-endian. Only the
    # non-zero codewords are widened and leave the device.
    sym = fresh.view(torch.int16)
    positions = torch.nonzero(sym.ne(0).any(dim=0)).flatten()
    picked = sym[:, positions].to(torch.int64) & 0xFFFF
    return positions.cpu().numpy(), picked.cpu().numpy()


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return field.mul_vec(a, field.EXP[(field.ORDER - field.LOG[b]) % field.ORDER])


def locate(
    code: ReedSolomon, positions: np.ndarray, synd: np.ndarray, *, group: object = None
) -> list[SymbolError]:
    """The errors that explain ``synd`` (from ``syndromes``), or ``Unlocatable``."""
    D, H = code.data_pages, code.parity_pages
    if len(positions) == 0:
        return []
    if H < 2:
        raise Unlocatable(group, positions.tolist(), f"H = {H}: errors are only detected")
    g = np.asarray(code.generator_matrix(), dtype=np.int64)  # H × D
    s = np.asarray(synd, dtype=np.int64)
    out: list[SymbolError] = []
    nz = s != 0
    # A parity page: one non-zero row.
    lone = nz.sum(axis=0) == 1
    for c in np.nonzero(lone)[0]:
        j = int(np.nonzero(nz[:, c])[0][0])
        out.append(SymbolError(D + j, int(positions[c]), int(s[j, c])))
    # A data page: y = r / (1 ⊕ r), r = S_1 / S_0.
    rest = np.nonzero(~lone)[0]
    e = s[0, rest]
    r = np.where(e != 0, _div(s[1, rest], np.where(e != 0, e, 1)), 1)
    ok = (e != 0) & (r != 1)
    y = np.where(ok, _div(r, np.where(ok, r ^ 1, 1)), 0)
    col = y - H
    ok &= (col >= 0) & (col < D)
    colc = np.clip(col, 0, D - 1)
    ok &= np.all(field.mul_vec(g[:, colc], e[None, :]) == s[:, rest], axis=0)
    for k, c in enumerate(rest):
        if ok[k]:
            out.append(SymbolError(int(col[k]), int(positions[c]), int(e[k])))
    left = [int(c) for k, c in enumerate(rest) if not ok[k]]
    if left and H < 5:
        raise Unlocatable(
            group, [int(positions[c]) for c in left],
            f"more than one error in a codeword; H = {H} locates one",
        )  # fmt: skip
    for c in left:
        pair = _pair(g, s[:, c])
        if pair is None:
            raise Unlocatable(
                group, [int(positions[c]) for c in left],
                "more than two errors in a codeword",
            )  # fmt: skip
        for column, value in pair:
            out.append(SymbolError(column, int(positions[c]), value))
    return sorted(out, key=lambda x: (x.column, x.symbol))


def _pair(g: np.ndarray, s: np.ndarray) -> list[tuple[int, int]] | None:
    """Two errors ``(column, value)`` that explain the syndrome ``s``, or None."""
    H, D = g.shape
    nz = np.nonzero(s)[0]
    if len(nz) == 2:  # two parity pages (a data error touches at least H - 1 rows)
        return [(D + int(j), int(s[j])) for j in nz]
    # A data page and parity page j: the rows other than j are one data error.
    for j in range(H):
        rows = np.array([r for r in range(H) if r != j])
        r0 = rows[0]
        e = _div(np.full(D, s[r0], dtype=np.int64), g[r0])  # G has no zero entry
        fit = (e != 0) & np.all(field.mul_vec(g[rows], e[None, :]) == s[rows, None], axis=0)
        ej = s[j] ^ field.mul_vec(g[j], e)
        fit &= ej != 0
        hit = np.nonzero(fit)[0]
        if len(hit):
            a = int(hit[0])
            return [(a, int(e[a])), (D + j, int(ej[a]))]
    # Two data pages a < b: rows 0 and 1 by Cramer's rule (the determinant
    # G[1][a] ⊕ G[1][b] is never zero: row 1's entries are distinct), checked on all.
    for a in range(D - 1):
        b = np.arange(a + 1, D)
        ha, hb = g[:, a][:, None], g[:, b]
        det = ha[1] ^ hb[1]  # row 0 is all ones
        ea = _div(field.mul_vec(s[0], hb[1]) ^ s[1], det)
        eb = _div(field.mul_vec(s[0], ha[1]) ^ s[1], det)
        good = (ea != 0) & (eb != 0)
        pred = field.mul_vec(ha, ea[None, :]) ^ field.mul_vec(hb, eb[None, :])
        good &= np.all(pred == s[:, None], axis=0)
        hit = np.nonzero(good)[0]
        if len(hit):
            k = int(hit[0])
            return [(a, int(ea[k])), (int(b[k]), int(eb[k]))]
    return None
