"""Silent errors in a protection group: syndromes, and the decoder that locates them.

Runs in the trainer (device pages, host parity) and in tests. Erasures are pages known
to be lost (the pool's localization names them); a *silent* error is a page whose bytes
changed without anyone noticing (a bit flip ECC missed, a stray write). The code finds
those too: a codeword is one symbol position ``s`` across the D data and H parity
pages, and its syndrome is ``S = G · data[:, s] ⊕ parity[:, s]`` (H symbols; zero when
consistent). An error of value ``e`` in column ``k`` adds ``h_k · e`` to it, where
``h_k`` is G's column for a data page and the unit vector ``u_j`` for parity page j.

Decoding, per codeword with a non-zero syndrome (on the host: only those codewords
leave the device), works on the check sums ``σ = C_P · S``: with the code's parity
checks (``field.rs_generator``) an error of value ``e`` at position ``pos`` (data page
i at ``i``, parity page j at ``D + j``) adds ``α^((b+r)·pos) · e`` to ``σ_r``:

* one error (H ≥ 2): ``X = σ_1 / σ_0 = α^pos`` names the page and ``e = σ_0 / X^b``;
  every other row must agree (``σ_r = e · X^(b+r)``).
* two errors (H ≥ 5): the error locator ``x² = λ_1·x + λ_2`` from four consecutive
  check sums (Peterson), its two roots found among the D + H positions, the values
  from two rows, checked on all (only for codewords one error does not explain).
* anything else: detected, not located (``Unlocatable`` names the group and where).

Why not more: the code's distance is H + 1, so decoding up to t errors still *detects*
every pattern of up to H − t errors without mistaking it for another one; locating two
only from H = 5 keeps at least three detected, and one error with H ≥ 3 keeps two. With
H = 1 (tier 2 as XOR) nothing can be located, only detected.

Not covered: correcting the pages (``SymbolError.apply`` does it; *whether* to is the
scrubber's call, since a corrupted parameter may already have been read), the cost of
the root search (≈ D + H field operations per codeword: for rare codewords only).
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


def _pow(x: np.ndarray, k) -> np.ndarray:
    """x^k for non-zero field elements x and any integers k (negative too)."""
    return field.power(field.LOG[x] * np.asarray(k, dtype=np.int64))


def locate(
    code: ReedSolomon, positions: np.ndarray, synd: np.ndarray, *, group: object = None
) -> list[SymbolError]:
    """The errors that explain ``synd`` (from ``syndromes``), or ``Unlocatable``."""
    D, H = code.data_pages, code.parity_pages
    if len(positions) == 0:
        return []
    if H < 2:
        raise Unlocatable(group, positions.tolist(), f"H = {H}: errors are only detected")
    sig = field.matmul(code.parity_checks(), np.asarray(synd, dtype=np.int64))  # H × m
    b = code.first_root
    rk = np.arange(H, dtype=np.int64)[:, None] + b  # the rows' exponents b + r
    out: list[SymbolError] = []
    # One error: X = σ_1 / σ_0 = α^pos, e = σ_0 / X^b, checked on every row.
    s0, s1 = sig[0], sig[1]
    ok = (s0 != 0) & (s1 != 0)
    x = np.where(ok, _div(s1, np.where(ok, s0, 1)), 1)
    pos = field.LOG[x]
    ok &= pos < D + H
    e = np.where(ok, _div(s0, _pow(x, b)), 0)
    ok &= np.all(field.mul_vec(_pow(x[None, :], rk), e[None, :]) == sig, axis=0)
    for c in np.nonzero(ok)[0]:
        out.append(SymbolError(int(pos[c]), int(positions[c]), int(e[c])))
    left = [int(c) for c in np.nonzero(~ok)[0]]
    if left and H < 5:
        raise Unlocatable(
            group, [int(positions[c]) for c in left],
            f"more than one error in a codeword; H = {H} locates one",
        )  # fmt: skip
    for c in left:
        pair = _pair(sig[:, c], b, D + H)
        if pair is None:
            raise Unlocatable(
                group, [int(positions[c]) for c in left],
                "more than two errors in a codeword",
            )  # fmt: skip
        for column, value in pair:
            out.append(SymbolError(column, int(positions[c]), value))
    return sorted(out, key=lambda x: (x.column, x.symbol))


def _pair(sig: np.ndarray, b: int, n: int) -> list[tuple[int, int]] | None:
    """Two errors ``(position, value)`` whose check sums are ``sig`` (H ≥ 4 rows, the
    exponents b, b+1, ..), or None. With X_1, X_2 the errors' α^pos, every run of three
    consecutive sums obeys σ_(k+2) = λ_1·σ_(k+1) + λ_2·σ_k (λ_1 = X_1 + X_2,
    λ_2 = X_1·X_2): two runs give λ; X_1, X_2 are the roots of x² + λ_1·x + λ_2."""
    m = field.mul
    s0, s1, s2, s3 = (int(v) for v in sig[:4])
    det = m(s1, s1) ^ m(s0, s2)
    if det == 0:
        return None
    l1 = field.div(m(s1, s2) ^ m(s0, s3), det)
    l2 = field.div(m(s1, s3) ^ m(s2, s2), det)
    xs = field.power(np.arange(n, dtype=np.int64))
    roots = np.nonzero((field.mul_vec(xs, xs) ^ field.mul_vec(xs, l1) ^ l2) == 0)[0]
    if len(roots) != 2:
        return None
    p1, p2 = (int(r) for r in roots)
    x1, x2 = int(xs[p1]), int(xs[p2])
    # z_i = e_i · X_i^b: σ_0 = z_1 + z_2, σ_1 = z_1·X_1 + z_2·X_2.
    z1 = field.div(s1 ^ m(s0, x2), x1 ^ x2)
    z2 = s0 ^ z1
    e1 = m(z1, int(_pow(np.array(x1), -b)))
    e2 = m(z2, int(_pow(np.array(x2), -b)))
    if e1 == 0 or e2 == 0:
        return None
    rk = np.arange(len(sig), dtype=np.int64) + b
    pred = field.mul_vec(_pow(np.array([x1]), rk), e1) ^ field.mul_vec(_pow(np.array([x2]), rk), e2)
    if not np.array_equal(pred, np.asarray(sig, dtype=np.int64)):
        return None
    return [(p1, e1), (p2, e2)]
