"""Tier 2 protects tier 1: lost tier-1 pages come back from tier 2, then data from tier 1."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leto.erasure import PageRangeError, PageShapeError, TooManyErasures, TwoTierCode


def setup(D=32, H1=4, H2=1, page_bytes=40, seed=0):
    code = TwoTierCode(D, H1, H2)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (D, page_bytes), dtype=torch.uint8, generator=g)
    t1, t2 = code.encode(data)
    return code, data, t1, t2


def test_tier2_with_one_page_is_xor_of_tier1():
    code, data, t1, t2 = setup()
    xor = t1[0].clone()
    for j in range(1, t1.shape[0]):
        xor ^= t1[j]
    assert torch.equal(t2[0], xor)


def test_tier2_rebuilds_a_lost_tier1_page_alongside_h1_lost_data_pages():
    code, data, t1, t2 = setup()
    want = (data.clone(), t1.clone())
    lost = [0, 9, 17, 31]  # H1 = 4 data pages, the most tier 1 tolerates
    data[lost] = 0
    t1[2] = 0xEE
    report = code.reconstruct(data, t1, t2, lost_data=lost, lost_tier1=[2])
    assert torch.equal(data, want[0]) and torch.equal(t1, want[1])
    assert report.tier1_from_tier2 == (2,)


@given(
    lost_data=st.lists(st.integers(0, 31), max_size=6, unique=True),
    lost_t1=st.lists(st.integers(0, 3), max_size=3, unique=True),
    lost_t2=st.lists(st.integers(0, 1), max_size=2, unique=True),
    seed=st.integers(0, 1000),
)
def test_rebuild_succeeds_exactly_when_decodable(lost_data, lost_t1, lost_t2, seed):
    code, data, t1, t2 = setup(H2=2, seed=seed)
    want = (data.clone(), t1.clone(), t2.clone())
    for i in lost_data:
        data[i] = 0x5A
    for j in lost_t1:
        t1[j] = 0x5A
    for j in lost_t2:
        t2[j] = 0x5A
    via_t2 = 0 < len(lost_t1) and len(lost_t1) + len(lost_t2) <= 2
    decodable = len(lost_data) + (0 if via_t2 else len(lost_t1)) <= 4
    if not decodable:
        before = (data.clone(), t1.clone(), t2.clone())
        with pytest.raises(TooManyErasures, match="protection group 3"):
            code.reconstruct(
                data, t1, t2, lost_data=lost_data, lost_tier1=lost_t1, lost_tier2=lost_t2, group=3
            )
        assert all(torch.equal(a, b) for a, b in zip((data, t1, t2), before, strict=True)), (
            "a refused rebuild wrote pages"
        )
        return
    code.reconstruct(data, t1, t2, lost_data=lost_data, lost_tier1=lost_t1, lost_tier2=lost_t2)
    assert torch.equal(data, want[0]) and torch.equal(t1, want[1]) and torch.equal(t2, want[2])


def test_paper_limit_17_data_pages_is_fatal():
    code, data, t1, t2 = setup(D=64, H1=16)
    with pytest.raises(TooManyErasures) as info:
        code.reconstruct(data, t1, t2, lost_data=range(17), group="g0")
    assert info.value.group == "g0" and info.value.erased == 17


def test_update_keeps_both_tiers_consistent():
    code, data, t1, t2 = setup()
    new = torch.randint(0, 256, (5, data.shape[1]), dtype=torch.uint8)
    old = data[10:15].clone()
    data[10:15] = new
    code.update(t1, t2, 10, old, new)
    assert code.verify(data, t1, t2)


def test_bad_indices_are_refused_before_any_write():
    code, data, t1, t2 = setup()
    with pytest.raises(PageRangeError, match="lost tier-1 page 4 outside 0..3"):
        code.reconstruct(data, t1, t2, lost_tier1=[4])


def test_wrong_tier_page_size_is_refused_before_any_write():
    code, data, t1, t2 = setup()
    short = t2[:, :-2].contiguous()
    with pytest.raises(PageShapeError, match="tier-2 pages 38"):
        code.reconstruct(data, t1, short, lost_data=[1])
