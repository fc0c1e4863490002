"""GF(2^16) arithmetic against the textbook definition and the galois package."""

from __future__ import annotations

import galois
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from leto.erasure import FIELD_POLY, field

GF = galois.GF(2**16)
sym = st.integers(0, 0xFFFF)


def test_field_poly_is_galois_default():
    assert int(GF.irreducible_poly) == FIELD_POLY, f"galois uses {int(GF.irreducible_poly):#x}"


@given(sym, sym)
def test_table_mul_equals_shift_and_add(a, b):
    assert field.mul(a, b) == field.mul_slow(a, b)


def test_mul_vec_equals_galois_on_a_large_sample():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1 << 16, 200_000)
    b = rng.integers(0, 1 << 16, 200_000)
    expected = np.array(GF(a) * GF(b), dtype=np.int64)
    assert np.array_equal(field.mul_vec(a, b), expected)


@given(st.integers(1, 0xFFFF))
def test_inverse(a):
    assert field.mul(a, field.inv(a)) == 1


def test_mat_inv_against_galois():
    for n in (1, 2, 5, 16):
        m = field.check_matrix(n, n)  # square Vandermonde blocks of distinct powers
        got = field.mat_inv(m)
        expected = np.array(np.linalg.inv(GF(m)), dtype=np.int64)
        assert np.array_equal(got, expected), f"n={n}"
        assert np.array_equal(field.matmul(got, m), np.eye(n, dtype=np.int64))
