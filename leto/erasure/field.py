"""Arithmetic in GF(2^16) with the field polynomial x^16 + x^5 + x^3 + x^2 + 1.

Runs in whichever process calls it (trainer, state manager, tests); host-side only.
``FIELD_POLY = 0x1002D`` is the default irreducible polynomial of ``galois.GF(2**16)``,
so the ``galois`` package serves as an independent oracle in the tests. The generator
``x`` (0x2) is primitive for this polynomial, which the log/exp tables rely on (checked
at import: the exp table must visit every non-zero element once).

Why GF(2^16): a protection group needs more distinct field elements than D + H pages
(1024 + 16 by default), which rules out GF(2^8); GF(2^16) leaves room for groups up to
65535 pages while its multiplication tables (split into 8- or 4-bit halves) still fit
in caches and GPU shared memory. The paper used GF(2^32), which buys nothing here.

Not covered: bulk page arithmetic (see ``leto.erasure.kernels``).
"""

from __future__ import annotations

import numpy as np

FIELD_BITS = 16
FIELD_SIZE = 1 << FIELD_BITS  # number of elements, 65536
FIELD_POLY = 0x1002D
SYMBOL_BYTES = 2
ORDER = FIELD_SIZE - 1  # multiplicative group order, 65535


def mul_slow(a: int, b: int) -> int:
    """Carry-less multiply then reduce modulo FIELD_POLY: the textbook definition."""
    product = 0
    while b:
        if b & 1:
            product ^= a
        b >>= 1
        a <<= 1
        if a & FIELD_SIZE:
            a ^= FIELD_POLY
    return product


def _build_tables() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(2 * ORDER, dtype=np.uint32)
    log = np.zeros(FIELD_SIZE, dtype=np.int64)
    x = 1
    for i in range(ORDER):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & FIELD_SIZE:
            x ^= FIELD_POLY
    if x != 1 or len(set(exp[:ORDER].tolist())) != ORDER:
        raise AssertionError("0x2 is not primitive for FIELD_POLY; the tables are wrong")
    exp[ORDER:] = exp[:ORDER]  # so exp[log a + log b] needs no modulo
    return exp, log


EXP, LOG = _build_tables()


def mul(a: int, b: int) -> int:
    if a == 0 or b == 0:
        return 0
    return int(EXP[LOG[a] + LOG[b]])


def inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^16)")
    return int(EXP[(ORDER - LOG[a]) % ORDER])


def div(a: int, b: int) -> int:
    return mul(a, inv(b))


def mul_vec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise product of two integer arrays of field elements (broadcasting)."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    out = EXP[LOG[a] + LOG[b]].astype(np.int64)
    return np.where((a == 0) | (b == 0), 0, out)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over the field for small host matrices (coefficients, not pages)."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul shapes {a.shape} and {b.shape} do not chain")
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.int64)
    for k in range(a.shape[1]):
        out ^= mul_vec(a[:, k : k + 1], b[k : k + 1, :])
    return out


def mat_inv(m: np.ndarray) -> np.ndarray:
    """Inverse of a square matrix over the field by Gauss–Jordan elimination."""
    m = np.array(m, dtype=np.int64)
    n = m.shape[0]
    if m.shape != (n, n):
        raise ValueError(f"matrix of shape {m.shape} is not square")
    aug = np.concatenate([m, np.eye(n, dtype=np.int64)], axis=1)
    for col in range(n):
        pivots = np.nonzero(aug[col:, col])[0]
        if len(pivots) == 0:
            raise ZeroDivisionError("matrix is singular over GF(2^16)")
        p = col + int(pivots[0])
        if p != col:
            aug[[col, p]] = aug[[p, col]]
        aug[col] = mul_vec(aug[col], inv(int(aug[col, col])))
        factors = aug[:, col].copy()
        factors[col] = 0
        aug ^= mul_vec(factors[:, None], aug[col][None, :])
    return aug[:, n:]


def first_root(parity_pages: int) -> int:
    """``b``: the code's parity checks are at α^b .. α^(b+H-1), centred on α^0 so the
    fused update's Horner steps (multiplies by α^-(b+r)) are the cheapest shifts."""
    return -((parity_pages - 1) // 2)


def power(exponent: np.ndarray | int) -> np.ndarray:
    """α^exponent for any integer exponents (negative ones too)."""
    return EXP[np.mod(np.asarray(exponent, dtype=np.int64), ORDER)].astype(np.int64)


def check_matrix(columns: int, parity_pages: int) -> np.ndarray:
    """The H × n parity checks ``C[r][i] = α^((b+r)·i)``: a codeword c (data at
    positions 0..D-1, parity page j at D+j) satisfies C · c = 0."""
    r = np.arange(parity_pages, dtype=np.int64)[:, None] + first_root(parity_pages)
    return power(r * np.arange(columns, dtype=np.int64)[None, :])


def rs_generator(data_pages: int, parity_pages: int) -> np.ndarray:
    """The H × D generator of a systematic Reed–Solomon code: ``G = C_P⁻¹ · C_D``.

    The code is every word c of D data and H parity symbols with ``C · c = 0`` for the
    H consecutive powers α^b .. α^(b+H-1) of the primitive element α (``check_matrix``).
    Any H columns of C form a Vandermonde matrix of distinct powers of α (times a
    diagonal), so any H lost pages decode (MDS) for D + H ≤ 65535; its parity is
    ``p = C_P⁻¹ · C_D · d``. The structure is what makes the fused update cheap: the
    parity change of a run of pages is ``C_P⁻¹ · (Σ_k α^((b+r)·k) · Δ_k)``, and the sum
    is a Horner scheme whose steps multiply by α^±1, α^±2 (shifts), not by arbitrary
    constants (``leto.update.chunk_pass``). With H = 1 the parity is the XOR of the data
    pages. Plain Vandermonde *generators* are avoided: 3 divides 65535, so some of their
    minors vanish; the check matrix has no such problem.
    """
    if data_pages < 1 or parity_pages < 1:
        raise ValueError(
            f"need at least one data and one parity page, got D={data_pages}, H={parity_pages}"
        )
    if data_pages + parity_pages > ORDER:
        raise ValueError(
            f"D + H = {data_pages + parity_pages} exceeds {ORDER}, the most GF(2^16) allows"
        )
    c = check_matrix(data_pages + parity_pages, parity_pages)
    return matmul(mat_inv(c[:, data_pages:]), c[:, :data_pages])
