"""Properties of ``leto.erasure.ReedSolomon`` on the host (the CPU kernel).

Every claim is checked bit for bit with ``torch.equal`` on the raw bytes.
"""

from __future__ import annotations

import random
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leto.erasure import (
    PageDTypeError,
    PageRangeError,
    PageShapeError,
    ReedSolomon,
    TooManyErasures,
)
from leto.errors import FatalFailure


def random_pages(count: int, page_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, page_bytes), dtype=torch.uint8, generator=g)


@st.composite
def groups(draw):
    D = draw(st.integers(1, 40))
    H = draw(st.integers(1, 8))
    page_bytes = draw(st.integers(1, 70))  # odd lengths included
    seed = draw(st.integers(0, 2**31))
    return D, H, page_bytes, seed


@st.composite
def erasure_sets(draw, D, H):
    """None, all parity, a consecutive run, first and last page, exactly H, or random."""
    n = D + H
    kind = draw(st.sampled_from(["none", "all_parity", "run", "ends", "exactly_h", "random"]))
    if kind == "none":
        return []
    if kind == "all_parity":
        return list(range(D, n))
    if kind == "run":
        length = draw(st.integers(1, H))
        start = draw(st.integers(0, n - length))
        return list(range(start, start + length))
    if kind == "ends":
        return sorted({0, D - 1} if H >= 2 else {0})
    if kind == "exactly_h":
        return draw(st.lists(st.integers(0, n - 1), min_size=H, max_size=H, unique=True))
    return draw(st.lists(st.integers(0, n - 1), max_size=H, unique=True))


@given(groups(), st.data())
def test_reconstruct_restores_original_bytes(g, data):
    D, H, page_bytes, seed = g
    rs = ReedSolomon(D, H)
    pages = random_pages(D, page_bytes, seed)
    parity = rs.encode(pages)
    erased = data.draw(erasure_sets(D, H))
    damaged, damaged_parity = pages.clone(), parity.clone()
    for i in erased:  # erased contents are garbage, not zeros, to prove they are unused
        target = damaged[i] if i < D else damaged_parity[i - D]
        target.copy_(torch.randint(0, 256, target.shape, dtype=torch.uint8))
    rs.reconstruct(damaged, damaged_parity, erased)
    assert torch.equal(damaged, pages), f"data differs after rebuilding {erased}"
    assert torch.equal(damaged_parity, parity), f"parity differs after rebuilding {erased}"


@given(groups())
def test_more_than_h_erasures_is_fatal_and_writes_nothing(g):
    D, H, page_bytes, seed = g
    rs = ReedSolomon(D, H)
    pages = random_pages(D, page_bytes, seed)
    parity = rs.encode(pages)
    rng = random.Random(seed)
    erased = rng.sample(range(D + H), H + 1)  # D >= 1, so H + 1 pages always exist
    before = (pages.clone(), parity.clone())
    with pytest.raises(TooManyErasures) as info:
        rs.reconstruct(pages, parity, erased, group=7)
    assert isinstance(info.value, FatalFailure)
    assert info.value.erased == H + 1 and info.value.tolerance == H
    assert "protection group 7" in str(info.value) and f"{H + 1} pages lost" in str(info.value)
    assert torch.equal(pages, before[0]) and torch.equal(parity, before[1])


@given(groups(), st.data())
def test_update_equals_reencoding(g, data):
    D, H, page_bytes, seed = g
    rs = ReedSolomon(D, H)
    pages = random_pages(D, page_bytes, seed)
    parity = rs.encode(pages)
    first = data.draw(st.integers(0, D - 1))
    count = data.draw(st.integers(1, D - first))
    new = random_pages(count, page_bytes, seed + 1)
    old = pages[first : first + count].clone()
    pages[first : first + count] = new
    rs.update(parity, first, old, new)
    assert torch.equal(parity, rs.encode(pages))
    assert rs.verify(pages, parity)


@given(groups())
def test_verify_detects_any_single_flipped_bit(g):
    D, H, page_bytes, seed = g
    rs = ReedSolomon(D, H)
    pages = random_pages(D, page_bytes, seed)
    parity = rs.encode(pages)
    assert rs.verify(pages, parity)
    rng = random.Random(seed)
    i, b, bit = rng.randrange(D), rng.randrange(page_bytes), rng.randrange(8)
    pages[i, b] ^= 1 << bit
    assert not rs.verify(pages, parity), f"flip of bit {bit} in page {i} byte {b} went unseen"


def _special_floats() -> list[float]:
    nan_payload = struct.unpack("<f", struct.pack("<I", 0x7FC12345))[0]
    return [0.0, -0.0, float("inf"), float("-inf"), nan_payload, 1e-45, -3.4e38]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]
)
def test_any_dtype_round_trips_bit_exactly(dtype):
    D, H = 12, 4
    rs = ReedSolomon(D, H)
    raw = random_pages(D, 64, 3)
    pages = raw.view(dtype) if dtype != torch.bool else (raw & 1).bool()
    if dtype.is_floating_point:
        sp = torch.tensor(_special_floats(), dtype=torch.float32).to(dtype)
        pages[0, : sp.numel()] = sp
    original = pages.clone()
    parity = rs.encode(pages)
    for i in (0, 5, 11):
        pages[i].view(torch.uint8).fill_(0xAB)
    rs.reconstruct(pages, parity, [0, 5, 11, D + 2])
    assert torch.equal(pages.view(torch.uint8), original.view(torch.uint8))


def test_nan_payload_and_negative_zero_bits_survive():
    rs = ReedSolomon(3, 2)
    bits = torch.tensor([0x7FC12345, 0x80000000, 0xFFFFFFFF, 0x7F800001], dtype=torch.int64)
    page = bits.to(torch.int32).view(torch.float32)
    pages = torch.stack([page, page.clone(), page.clone()])
    parity = rs.encode(pages)
    pages[1].view(torch.int32).fill_(0)
    rs.reconstruct(pages, parity, [1])
    assert torch.equal(pages[1].view(torch.int32), bits.to(torch.int32))


def test_pages_as_a_list_of_separate_tensors():
    rs = ReedSolomon(5, 2)
    pages = [torch.randn(33) for _ in range(5)]  # 132 bytes each, separate allocations
    parity = rs.encode(pages)
    original = [p.clone() for p in pages]
    pages[2].zero_()
    pages[4].zero_()
    rs.reconstruct(pages, parity, [2, 4])
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(pages, original, strict=True)
    )


def test_generator_matrix_shape_and_one_parity_page_is_xor():
    rs = ReedSolomon(1024, 16)
    g = rs.generator_matrix()
    assert len(g) == 16 and all(len(r) == 1024 for r in g)
    assert all(isinstance(c, int) and 0 <= c < 65536 for r in g for c in r)
    assert ReedSolomon(1024, 1).generator_matrix() == [[1] * 1024]


def test_largest_group_is_accepted_and_one_more_is_refused():
    ReedSolomon(65535 - 16, 16)
    with pytest.raises(ValueError, match="65535"):
        ReedSolomon(65535 - 15, 16)


def test_mismatched_page_sizes_are_named():
    rs = ReedSolomon(3, 2)
    pages = [
        torch.zeros(8, dtype=torch.uint8),
        torch.zeros(8, dtype=torch.uint8),
        torch.zeros(9, dtype=torch.uint8),
    ]
    with pytest.raises(PageShapeError, match="group 4: data page 2 has 9 bytes, page 0 has 8"):
        rs.encode(pages, group=4)


def test_wrong_page_count_is_named():
    with pytest.raises(PageShapeError, match="expected 3 data pages, got 2"):
        ReedSolomon(3, 2).encode(torch.zeros(2, 8, dtype=torch.uint8))


def test_mismatched_dtypes_are_named():
    rs = ReedSolomon(2, 1)
    with pytest.raises(PageDTypeError, match="page 1 has dtype torch.int32"):
        rs.encode([torch.zeros(2), torch.zeros(2, dtype=torch.int32)])
    parity = rs.encode(torch.zeros(2, 8))
    with pytest.raises(
        PageShapeError,
        match="old pages are 32 bytes of torch.float32, new pages 32 bytes of torch.int32",
    ):
        rs.update(parity, 0, torch.zeros(1, 8), torch.zeros(1, 8, dtype=torch.int32))


def test_wrong_parity_size_is_named_and_nothing_changes():
    rs = ReedSolomon(2, 2)
    pages = torch.zeros(2, 7, dtype=torch.uint8)
    parity = torch.zeros(2, 7, dtype=torch.uint8)
    with pytest.raises(PageShapeError, match="parity pages are 7 bytes, expected 8"):
        rs.encode(pages, out=parity)


def test_out_of_range_pages_are_named():
    rs = ReedSolomon(4, 2)
    pages = random_pages(4, 16, 0)
    parity = rs.encode(pages)
    snapshot = parity.clone()
    with pytest.raises(PageRangeError, match="data pages 3..4 are outside 0..3"):
        rs.update(parity, 3, pages[:2], pages[:2])
    with pytest.raises(PageRangeError, match="erased page index 6 outside 0..5"):
        rs.reconstruct(pages, parity, [6])
    with pytest.raises(PageRangeError, match="names a page twice"):
        rs.reconstruct(pages, parity, [1, 1])
    assert torch.equal(parity, snapshot)


def test_non_contiguous_pages_are_refused():
    rs = ReedSolomon(2, 1)
    with pytest.raises(PageDTypeError, match="not contiguous"):
        rs.encode([torch.zeros(4, 4).t(), torch.zeros(4, 4)])


def test_slices_takes_and_joins_of_checked_page_lists_are_the_same_views_and_encode_the_same():
    # What the updater builds its per-chunk lists from (no per-page checks): the views
    # must be the very page tensors, in order, so parity computed from them is the
    # parity of the pages.
    from leto.erasure.pages import PageList, as_pages

    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (5, 64), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=g)
    pa, pb = as_pages(a, None, "data", 0), as_pages(b, None, "data", 0)
    joined = PageList.join([pa[1:4], pb])
    assert [t.data_ptr() for t in joined.pages] == [
        *(a[i].data_ptr() for i in (1, 2, 3)),
        *(b[i].data_ptr() for i in range(3)),
    ]
    taken = joined.take([5, 0, 3])
    assert [t.data_ptr() for t in taken.pages] == [
        b[2].data_ptr(),
        a[1].data_ptr(),
        b[0].data_ptr(),
    ]
    rs = ReedSolomon(6, 2)
    checked = as_pages(list(joined.pages), 6, "data", 0)  # the same pages, checked one by one
    assert torch.equal(rs.encode(joined), rs.encode(checked))
    assert torch.equal(rs.encode(joined), rs.encode(torch.cat([a[1:4], b])))
    with pytest.raises(TypeError, match="a PageList is sliced"):
        joined[0]
    other = as_pages(torch.zeros(2, 32, dtype=torch.uint8), None, "data", 0)
    with pytest.raises(PageShapeError, match="group 7: data part 1 has 32-byte"):
        PageList.join([pa, other], "data", 7)
