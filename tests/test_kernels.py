"""Fast kernels against the slow reference and the galois oracle.

The CPU kernel is checked for every one of the 65536 multiplier constants on a page
that holds every value of each byte (0..255 and 0..255 << 8), which exercises every
entry of its split tables; the reference kernel is checked against galois for a sample
of constants. ``generator_matrix`` and ``encode`` are recomputed independently with
galois arithmetic.
"""

from __future__ import annotations

import galois
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leto.erasure import ReedSolomon
from leto.erasure.kernels import Coefficients, CpuKernel, ReferenceKernel

GF = galois.GF(2**16)


def symbols_page(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype("<u2").view(np.uint8).copy())


def page_symbols(page: torch.Tensor) -> np.ndarray:
    return page.numpy().view("<u2").astype(np.int64)


EVERY_BYTE = np.concatenate([np.arange(256), np.arange(256) << 8, [0xFFFF, 0x8001]])


def test_cpu_kernel_equals_galois_for_every_multiplier_constant():
    kernel = CpuKernel()
    page = symbols_page(EVERY_BYTE)
    expected_d = GF(EVERY_BYTE)
    for start in range(0, 1 << 16, 8192):
        consts = np.arange(start, start + 8192)
        out = torch.empty((len(consts), page.numel()), dtype=torch.uint8)
        kernel.matmul(Coefficients(consts[:, None]), [page], list(out))
        got = out.numpy().view("<u2").astype(np.int64)
        expected = np.array(GF(consts)[:, None] * expected_d[None, :], dtype=np.int64)
        bad = np.argwhere(got != expected)
        assert bad.size == 0, (
            f"constant {consts[bad[0][0]]:#x} times {EVERY_BYTE[bad[0][1]]:#x} is wrong"
        )


def test_reference_kernel_equals_galois_on_sampled_constants():
    rng = np.random.default_rng(5)
    consts = np.concatenate([[0, 1, 2, 0xFFFF], rng.integers(0, 1 << 16, 28)])
    page = symbols_page(EVERY_BYTE[::7])
    out = torch.empty((len(consts), page.numel()), dtype=torch.uint8)
    ReferenceKernel().matmul(Coefficients(consts[:, None]), [page], list(out))
    expected = np.array(GF(consts)[:, None] * GF(EVERY_BYTE[::7])[None, :], dtype=np.int64)
    assert np.array_equal(out.numpy().view("<u2").astype(np.int64), expected)


@given(
    rows=st.integers(1, 20),
    cols=st.integers(1, 12),
    n_sym=st.integers(1, 40),
    col_offset=st.integers(0, 3),
    accumulate=st.booleans(),
    with_xor=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_cpu_kernel_equals_reference(rows, cols, n_sym, col_offset, accumulate, with_xor, seed):
    rng = np.random.default_rng(seed)
    m = Coefficients(rng.integers(0, 1 << 16, (rows, cols + col_offset)))
    ins = [symbols_page(rng.integers(0, 1 << 16, n_sym)) for _ in range(cols)]
    xs = [symbols_page(rng.integers(0, 1 << 16, n_sym)) for _ in range(cols)] if with_xor else None
    start = [symbols_page(rng.integers(0, 1 << 16, n_sym)) for _ in range(rows)]
    a = [p.clone() for p in start]
    b = [p.clone() for p in start]
    kw = dict(col_offset=col_offset, xor_with=xs, accumulate=accumulate)
    CpuKernel().matmul(m, ins, a, **kw)
    ReferenceKernel().matmul(m, ins, b, **kw)
    for r in range(rows):
        assert torch.equal(a[r], b[r]), f"row {r} differs"


@pytest.mark.parametrize("D,H", [(1, 1), (7, 3), (64, 16), (1024, 16)])
def test_generator_matrix_is_the_documented_reed_solomon_code(D, H):
    # Checks C[r][i] = α^((b+r)·i), α = x (0x2), b = -((H-1)//2); G = C_P⁻¹ · C_D.
    b = -((H - 1) // 2)
    r = np.arange(H)[:, None] + b
    C = GF(np.full((H, D + H), 2)) ** ((r * np.arange(D + H)[None, :]) % 65535)
    expected = np.array(np.linalg.inv(C[:, D:]) @ C[:, :D], dtype=np.int64)
    assert np.array_equal(np.array(ReedSolomon(D, H).generator_matrix()), expected)
    # Every codeword (data, parity) satisfies the checks.
    data = GF(np.random.default_rng(D).integers(0, 1 << 16, (D, 3)))
    word = np.concatenate([data, GF(np.array(ReedSolomon(D, H).generator_matrix())) @ data])
    assert not np.any(C @ word)


def test_every_square_submatrix_tried_is_invertible():
    # MDS: any e erased data pages must be solvable from any e surviving parity rows.
    G = GF(np.array(ReedSolomon(1024, 16).generator_matrix()))
    rng = np.random.default_rng(11)
    for e in range(1, 17):
        for _ in range(4):
            rows = np.sort(rng.choice(16, e, replace=False))
            cols = np.sort(rng.choice(1024, e, replace=False))
            assert np.linalg.matrix_rank(G[np.ix_(rows, cols)]) == e, f"singular {e}x{e} minor"


@pytest.mark.parametrize("kernel", ["cpu", "reference"])
def test_encode_equals_galois_matmul(kernel):
    D, H, n_sym = 24, 5, 96
    rng = np.random.default_rng(3)
    data = rng.integers(0, 1 << 16, (D, n_sym))
    pages = torch.from_numpy(data.astype("<u2").view(np.uint8).copy())
    parity = ReedSolomon(D, H, kernel=kernel).encode(pages)
    G = GF(np.array(ReedSolomon(D, H).generator_matrix()))
    expected = np.array(G @ GF(data), dtype=np.int64)
    assert np.array_equal(parity.numpy().view("<u2").astype(np.int64), expected)


def test_byte_order_is_little_endian_symbols():
    # Page bytes [0x34, 0x12] are the symbol 0x1234; parity row 1's product with its
    # coefficient is checked via galois.
    rs = ReedSolomon(1, 2)
    page = torch.tensor([[0x34, 0x12]], dtype=torch.uint8)
    parity = rs.encode(page)
    c = rs.generator_matrix()[1][0]
    expected = int(GF(c) * GF(0x1234))
    assert parity[1].tolist() == [expected & 0xFF, expected >> 8]
    # With one parity page the code is XOR: the parity of one page is the page itself.
    assert ReedSolomon(1, 1).encode(page)[0].tolist() == [0x34, 0x12]


@pytest.mark.parametrize("n_sym", [1, 2047, 2048, 5000])
@pytest.mark.parametrize("accumulate,with_xor", [(False, False), (True, True), (False, True)])
def test_the_c_host_kernel_equals_its_numpy_twin_across_blocks(n_sym, accumulate, with_xor):
    from leto.erasure.kernels import cpu

    if cpu.native() is None:
        pytest.skip("no C compiler here: the NumPy twin is the host kernel")
    rng = np.random.default_rng(n_sym)
    rows, cols, off = 16, 9, 5
    m = Coefficients(rng.integers(0, 1 << 16, (rows, cols + off)))
    ins = [symbols_page(rng.integers(0, 1 << 16, n_sym)) for _ in range(cols)]
    xs = [symbols_page(rng.integers(0, 1 << 16, n_sym)) for _ in range(cols)] if with_xor else None
    start = [symbols_page(rng.integers(0, 1 << 16, n_sym)) for _ in range(rows)]
    a, b = [p.clone() for p in start], [p.clone() for p in start]
    cpu._matmul_c(cpu.native(), m, ins, a, off, xs, accumulate)
    cpu._matmul_numpy(m, ins, b, off, xs, accumulate)
    for r in range(rows):
        diff = (a[r] != b[r]).nonzero()
        assert diff.numel() == 0, f"row {r} differs from byte {int(diff[0])}"


def test_leto_cpu_codec_numpy_forces_the_numpy_twin(monkeypatch):
    from leto.erasure.kernels import cpu

    monkeypatch.setenv(cpu.ENV_CPU_CODEC, "numpy")
    assert cpu.native.__wrapped__() is None
