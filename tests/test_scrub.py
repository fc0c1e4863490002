"""The scrubber on a real pool (state manager, shared pages, host parity): silent
changes to host parity are found and repaired byte for byte; changes to device pages
are found, named (allocation and page) and refused — nothing patched in place — even
after updates have carried them along; the background steps cover the whole state."""

from __future__ import annotations

import pytest
import torch

from leto.integrity.scrub import CorruptState, Scrubber
from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager
from leto.update.rmu import UpdaterConfig
from tests import rmu_harness as h
from tests.pool_helpers import small_config


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def trained(request):
    # H1 = 4: a pool whose groups locate one error per codeword (and detect three). On
    # CUDA: a VMM pool, the CUDA codec, the background check on a side stream.
    if request.param == "cuda":
        cfg = PoolConfig.for_cuda(0, data_pages=8, tier1_pages=4, allow_fault_injection=True)
    else:
        cfg = small_config(data_pages=8, tier1_pages=4)
    sm = start_state_manager(cfg)
    client, up, model, t = h.start(sm, UpdaterConfig(chunk_units=1))
    for it in range(t, 2):
        h.one_iteration(up, model, it)
    try:
        yield up, model
    finally:
        client.close()
        sm.stop()


def _snapshot(up):
    return [
        ([p.clone() for p in g.data], [p.clone() for p in g.tier1], [p.clone() for p in g.tier2])
        for g in up.groups
    ]


def _flip(page: torch.Tensor, byte: int, bit: int) -> None:
    page[byte] ^= 1 << bit


def test_a_clean_state_passes_and_flipped_parity_is_repaired_exactly(trained):
    up, _ = trained
    s = Scrubber(up, budget_bytes=0)
    assert s.full()["repaired"] == []
    before = _snapshot(up)
    g = up.groups[0]
    _flip(g.tier1[2], 100, 3)  # tier 1, page 2
    _flip(g.tier1[0], 7001, 0)  # tier 1, page 0, another codeword
    _flip(g.tier2[0], 9, 6)  # tier 2
    found = s.full()["repaired"]
    assert {(f["tier"], f["page"]) for f in found} == {("tier1", 0), ("tier1", 2), ("tier2", -1)}
    assert all(f["repaired"] for f in found)
    assert [f["first_byte"] for f in found if f["tier"] == "tier1"] == [7000, 100]
    for (d, t1, t2), g in zip(before, up.groups, strict=True):
        assert all(
            torch.equal(a, b) for a, b in zip(d + t1 + t2, g.data + g.tier1 + g.tier2, strict=True)
        )
    assert s.full()["repaired"] == []


def test_a_full_scrub_locates_only_in_the_groups_whose_flag_is_set(trained, monkeypatch):
    # Scrubber.full launches every group's flag and reads them together; the locating
    # check (a host round trip and a page list a group: most of a full scrub's time at
    # 1.1 B on an H100) runs only where a flag is set.
    up, _ = trained
    s = Scrubber(up, budget_bytes=0)
    located = []
    check = s.check
    monkeypatch.setattr(s, "check", lambda gi, *a, **k: located.append(gi) or check(gi, *a, **k))
    assert s.full()["repaired"] == [] and located == []
    g = up.groups[-1]
    _flip(g.tier2[0], 11, 1)
    found = s.full()["repaired"]
    assert located == [len(up.groups) - 1]
    assert [(f["group"], f["tier"]) for f in found] == [(g.gid, "tier2")]


@pytest.mark.parametrize("updates_since", [0, 1])
def test_a_flipped_device_page_is_named_and_refused_even_after_an_update(trained, updates_since):
    up, model = trained
    g = up.groups[-1]  # on a CUDA pool (2 MiB pages) this small model has one group
    victim = len(g.data) - 1
    _flip(g.data[victim], 4097, 5)
    for it in range(2, 2 + updates_since):
        h.one_iteration(up, model, it)  # the update carries the error's syndrome along
    before = _snapshot(up)
    with pytest.raises(CorruptState) as e:
        Scrubber(up, budget_bytes=0).full()
    f = next(x for x in e.value.findings if x.tier == "data")
    assert (f.group, f.page, f.allocation) == (g.gid, victim, _alloc_of(g.members, victim))
    assert f.first_byte == 4096 and not f.repaired
    assert f"group {g.gid} {f.allocation} page {f.allocation_page}" in str(e.value)
    # Nothing was patched: every byte as the scrub found it.
    for (d, t1, t2), gg in zip(before, up.groups, strict=True):
        assert all(
            torch.equal(a, b)
            for a, b in zip(d + t1 + t2, gg.data + gg.tier1 + gg.tier2, strict=True)
        )


def _alloc_of(members, page):
    at = 0
    for name, _, count in members:
        if page < at + count:
            return name
        at += count
    raise AssertionError(page)


def test_background_steps_cover_every_group_within_one_pass(trained):
    up, _ = trained
    pb = up.state.page_bytes
    n = len(up.groups[0].data)
    s = Scrubber(up, budget_bytes=n * pb // 4)  # a quarter of a full group per step
    steps = 0
    while s.passes == 0 and steps < 100:
        s.step()
        steps += 1
    assert 4 <= steps < 100 and s.cursor == 0
    assert s.checked_bytes == sum(len(g.data) for g in up.groups) * pb
    # A flip in the last group is checked by the last step of a pass; its flag is read
    # at the step after (on CUDA the check runs on a side stream meanwhile).
    last = up.groups[-1]
    _flip(last.data[0], pb - 1, 7)
    quiet = 0
    with pytest.raises(CorruptState):
        for _ in range(steps + 2):
            s.step()
            quiet += 1
    assert quiet == steps, (quiet, steps)


def test_a_recoverys_verification_is_read_before_the_update_not_at_once(trained):
    # Scrubber.verify_later: the rebuilt groups' check launched (on CUDA beside the first
    # forward and backward), its verdict read by before_update — a flipped device page
    # raises there, as the check at once did; flipped parity is repaired there, before
    # the update reads it; a clean state passes without a finding.
    up, _ = trained
    every = list(range(len(up.groups)))
    s = Scrubber(up, budget_bytes=0)
    s.verify_later(every, when="verifying the rebuilt groups")
    assert s.settle_verified() == [] and s.settle_verified() == []  # read once
    g = up.groups[-1]
    _flip(g.tier1[1], 300, 2)
    before = [p.clone() for p in g.tier1]
    _flip(before[1], 300, 2)  # what the repair must restore
    s.verify_later(every, when="verifying the rebuilt groups")
    s.before_update()
    assert all(torch.equal(a, b) for a, b in zip(before, g.tier1, strict=True))
    assert [(f.tier, f.page) for f in s.findings] == [("tier1", 1)]
    victim = len(g.data) - 1
    _flip(g.data[victim], 4097, 5)
    got = s.verify_later(every, when="verifying the rebuilt groups")  # does not raise here
    assert got["groups"] == len(every)
    with pytest.raises(CorruptState) as e:
        s.before_update()
    assert "verifying the rebuilt groups" in str(e.value)
    assert s.settle_verified() == []  # nothing left pending after it raised
