"""The error-locating decoder against an independent oracle (galois): every pattern
within the decoding radius is located exactly (page, symbol, value), every pattern
beyond it but within what the code detects is refused, never mislocated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.erasure.codec import ReedSolomon
from leto.erasure.locate import SymbolError, Unlocatable, locate, syndromes

try:  # the oracle (a dev dependency; the GPU machine may lack it: only the oracle tests skip)
    import galois

    GF = galois.GF(2**16)
except ImportError:
    galois = GF = None
oracle = pytest.mark.skipif(galois is None, reason="needs galois, the independent GF oracle")


def oracle_generator(D: int, H: int):
    """G = C_P⁻¹ · C_D for the checks C[r][i] = α^((b+r)·i), α = x, b = -((H-1)//2),
    computed by galois."""
    r = np.arange(H)[:, None] - (H - 1) // 2
    C = GF(np.full((H, D + H), 2)) ** ((r * np.arange(D + H)[None, :]) % 65535)
    return np.linalg.inv(C[:, D:]) @ C[:, :D]


def symbols(pages: torch.Tensor) -> np.ndarray:
    p = pages.view(pages.shape[0], -1, 2).to(torch.int64)
    return (p[..., 0] | (p[..., 1] << 8)).numpy()


def as_bytes(sym: np.ndarray) -> torch.Tensor:
    s = sym.astype(np.uint16)
    return torch.from_numpy(s.view(np.uint8).reshape(s.shape[0], -1).copy())


@st.composite
def case(draw, beyond: bool = False):
    H = draw(st.integers(2, 7))
    D = draw(st.integers(1, 24))
    n = draw(st.integers(1, 12))  # symbols per page
    t = 2 if H >= 5 else 1  # the decoding radius
    lo, hi = (t + 1, H - t) if beyond else (1, t)
    if lo > hi or lo > D + H:
        hi = lo = 0
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    data = rng.integers(0, 2**16, size=(D, n))
    errors = {}  # (column, symbol) -> value
    for s in sorted(rng.choice(n, size=draw(st.integers(1, n)), replace=False)):
        w = int(rng.integers(lo, hi + 1)) if hi else 0
        for c in rng.choice(D + H, size=min(w, D + H), replace=False):
            errors[(int(c), int(s))] = int(rng.integers(1, 2**16))
    return D, H, data, errors


def _corrupt(D, H, data, errors):
    g = oracle_generator(D, H)
    parity = np.array(g @ GF(data))
    d, p = data.copy(), parity.copy()
    for (c, s), v in errors.items():
        if c < D:
            d[c, s] ^= v
        else:
            p[c - D, s] ^= v
    expected = np.array(g @ GF(d) + GF(p))  # the oracle's syndromes
    return d, p, expected


@oracle
@settings(deadline=None)  # examples: the Hypothesis profile (ci 40, dev 500)
@given(case())
def test_errors_within_the_radius_are_located_exactly(c):
    D, H, data, errors = c
    d, p, expected = _corrupt(D, H, data, errors)
    code = ReedSolomon(D, H, kernel="cpu")
    pos, synd = syndromes(code, as_bytes(d), as_bytes(p))
    assert pos.tolist() == sorted({s for _, s in errors}), (pos, errors)
    assert np.array_equal(synd, expected[:, pos]), "syndromes differ from the oracle's"
    found = locate(code, pos, synd)
    assert {(e.column, e.symbol): e.value for e in found} == errors
    # Applying them restores every byte.
    dd, pp = as_bytes(d), as_bytes(p)
    for e in found:
        e.apply(dd[e.column] if e.column < D else pp[e.column - D])
    assert torch.equal(dd, as_bytes(data))
    assert torch.equal(pp, as_bytes(np.array(oracle_generator(D, H) @ GF(data))))


@oracle
@settings(deadline=None)  # examples: the Hypothesis profile (ci 40, dev 500)
@given(case(beyond=True))
def test_errors_beyond_the_radius_but_detectable_are_refused_not_mislocated(c):
    D, H, data, errors = c
    d, p, _ = _corrupt(D, H, data, errors)
    code = ReedSolomon(D, H, kernel="cpu")
    pos, synd = syndromes(code, as_bytes(d), as_bytes(p))
    if not errors:
        assert len(pos) == 0 and locate(code, pos, synd) == []
        return
    assert len(pos) > 0, "a detectable pattern left a zero syndrome"
    with pytest.raises(Unlocatable) as e:
        locate(code, pos, synd, group="g0")
    assert "protection group g0" in str(e.value) and "nothing was changed" in str(e.value)


def test_one_parity_page_cannot_locate_anything():
    code = ReedSolomon(4, 1, kernel="cpu")
    data = torch.arange(32, dtype=torch.uint8).view(4, 8)
    parity = code.encode(data)
    data[2, 3] ^= 0x10
    pos, synd = syndromes(code, data, parity)
    assert pos.tolist() == [1]
    with pytest.raises(Unlocatable, match="only detected"):
        locate(code, pos, synd)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bit_flip_in_a_page_of_a_real_group(device):
    # 1024 data pages of 4 KiB, H = 16: one flipped bit in data page 700 and one in
    # parity page 3, found by page and symbol (syndromes by the device's own kernel).
    D, H, n = 1024, 16, 4096
    code = ReedSolomon(D, H)
    data = torch.randint(
        0, 256, (D, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    data = data.to(device)
    parity = code.encode(data)
    data[700, 1001] ^= 0x04
    parity[3, 77] ^= 0x80
    found = locate(code, *syndromes(code, data, parity))
    assert found == [
        SymbolError(700, 500, 0x0400),
        SymbolError(D + 3, 38, 0x8000),
    ]  # byte 77: the high byte
