"""The update recheck (``leto.integrity.recheck``) in the updater, without ``leto run``: a
chunk recomputed from its undo copy leaves the state and parity bit-identical to an
update without it, on the fused pass and on the unfused steps; a wrong value written
into a chunk's update (faultkit's ``sdc-update`` seam) is found, named and fatal; the
sampling rule. The end-to-end path (world 1 and FSDP2, every chunk rechecked, the
checkpoint fallback, EXACT) is faultkit's ``sdc-update`` — in the CI gate's FSDP2 matrix."""

from __future__ import annotations

import json

import pytest
import torch

from leto import plugins
from leto.integrity.recheck import Recheck, WrongUpdate
from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager
from leto.update.chunk_pass import ENV
from leto.update.rmu import Updater
from tests import test_user_optim as u
from tests.pool_helpers import small_config

DIMS = (60, 1031, 37)  # several units per chunk, chunks per group (test_chunk_pass's)


def _state(tr) -> dict[str, torch.Tensor]:
    st = tr.up.state
    out = {k: v.clone() for k, v in st.flat.items()}
    for g in tr.up.groups:
        out[f"tier1/{g.gid}"] = tr.up._host_tier(g, 1).clone()
    return out


def _run(
    tmp_path, every: bool | None, flip_at: int | None = None, device: str = "cpu", undo="chunk"
) -> dict:
    """Three iterations of the script's fused AdamW on a fresh pool; ``every``: recheck
    every chunk (None: no recheck); ``flip_at``: one bit of iteration ``flip_at``'s first
    computed chunk; ``undo``: where the undo copies come from (the recheck restores a
    chunk from its copy). The state and host tier 1 after them."""
    if device == "cuda":  # the fused CUDA pass against torch's fused AdamW, bit for bit
        cfg = PoolConfig.for_cuda(0, data_pages=12, tier1_pages=3, allow_fault_injection=True)
    else:
        cfg = small_config(data_pages=12, tier1_pages=3)
    sm = start_state_manager(cfg)
    try:
        return _iterate(sm, tmp_path, every, flip_at, undo)
    finally:
        sm.stop()


def _iterate(pool, tmp_path, every, flip_at, undo) -> dict:
    tr = u.Trainer(pool, "adamw-fused", dims=DIMS, chunk_units=2, undo=undo)
    log = tmp_path / "rank0.recheck.jsonl"
    n = sum(len(tr.up.state.chunks(gi)) for gi in range(len(tr.up.groups)))
    rc = Recheck(0, n, log, every=bool(every)) if every is not None else None
    tr.up.recheck = rc
    flipped = []

    def at(name, it, dest):
        if name == plugins.SDC_POINT and it == flip_at and not flipped:
            page = list(getattr(dest, "pages", dest))[0]
            page.view(torch.uint8)[1000] ^= 1
            flipped.append(it)

    before = plugins._point_handler
    plugins.install_point_handler(at)
    try:
        for _ in range(3):
            tr.iteration()
            if rc is not None:
                rc.settle()
        assert flip_at is None or flipped, "the flip never happened: the test proves nothing"
        return {"state": _state(tr), "checked": rc.checked if rc else 0}
    finally:
        plugins.install_point_handler(before)
        tr.client.close()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("undo", ["chunk", "ahead"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_recheck_changes_no_byte_of_state_or_parity(tmp_path, monkeypatch, fused, device, undo):
    monkeypatch.setenv(ENV, fused)
    plain = _run(tmp_path, None, device=device)["state"]
    got = _run(tmp_path, True, device=device, undo=undo)
    checked = got["state"]
    assert got["checked"] >= 3 and not (tmp_path / "rank0.recheck.jsonl").exists()
    assert plain.keys() == checked.keys()
    for k in plain:
        assert torch.equal(plain[k].view(torch.uint8), checked[k].view(torch.uint8)), k


@pytest.mark.parametrize("undo", ["chunk", "ahead"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_wrong_update_is_found_named_and_fatal(tmp_path, monkeypatch, fused, device, undo):
    monkeypatch.setenv(ENV, fused)
    with pytest.raises(WrongUpdate, match=r"iteration 1: rank 0's update of chunk 0 of state"):
        _run(tmp_path, True, flip_at=1, device=device, undo=undo)
    (rec,) = [json.loads(x) for x in (tmp_path / "rank0.recheck.jsonl").read_text().splitlines()]
    assert rec["iteration"] == 1 and rec["rank"] == 0 and rec["chunk"] == 0, rec


def test_one_chunk_an_iteration_in_turn_or_every_chunk():
    rc = Recheck(0, chunks=5, log=None)
    assert [o for o in range(5) if rc.due(7, o)] == [2]  # 7 mod 5
    assert sorted({t % 5 for t in range(10) for o in range(5) if rc.due(t, o) and o == t % 5}) == [
        0, 1, 2, 3, 4,
    ]  # fmt: skip
    assert all(Recheck(0, 5, None, every=True).due(7, o) for o in range(5))


# -- the alarm policy: a disagreement repeated after the rollback is settled ----------


def _flip_recheck(monkeypatch, at_iteration: int = 1):
    """Make the recheck's own computation wrong, the same way every time (a software
    mistake in the check): its second step of ``at_iteration`` flips a bit it wrote."""
    orig = Updater._user_step

    def wrong(self, it, units, points=True):
        orig(self, it, units, points)
        if not points and it == at_iteration:
            self.state.flat["exp_avg_sq"][self.state.element_range(units)[0]].view(
                torch.int32
            ).bitwise_xor_(1)

    monkeypatch.setattr(Updater, "_user_step", wrong)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_check_that_is_wrong_twice_is_switched_off_and_the_job_goes_on(
    tmp_path, monkeypatch, fused, device, capsys
):
    monkeypatch.setenv(ENV, fused)
    plain = _run(tmp_path / "plain", None, device=device)["state"]
    _flip_recheck(monkeypatch)
    with pytest.raises(WrongUpdate):  # the first time: the rollback (a device named once)
        _run(tmp_path, True, device=device)
    got = _run(tmp_path, True, device=device)  # the redo: settled, no alarm, exact
    for k in plain:
        assert torch.equal(plain[k].view(torch.uint8), got["state"][k].view(torch.uint8)), k
    recs = [json.loads(x) for x in (tmp_path / "rank0.recheck.jsonl").read_text().splitlines()]
    assert [r.get("settled") for r in recs] == [None, "recheck"], recs
    evidence = json.loads((tmp_path / "rank0.recheck-evidence.json").read_text())
    assert evidence["exp_avg_sq"]["first"] == evidence["exp_avg_sq"]["third"], evidence
    assert evidence["exp_avg_sq"]["recheck"] != evidence["exp_avg_sq"]["first"], evidence
    err = capsys.readouterr().err
    assert "update recheck off for the rest of the job" in err and "evidence:" in err, err


def _flip_first(at_iteration: int, times: list):
    """A wrong first computation of the first chunk of ``at_iteration`` (faultkit's
    sdc-update seam), the same bit in every run: a software mistake in the update."""

    flipped = []

    def at(name, it, dest):
        if name == plugins.SDC_POINT and it == at_iteration and not flipped:
            page = list(getattr(dest, "pages", dest))[0]
            page.view(torch.uint8)[1000] ^= 1
            flipped.append(it)
            times.append(it)

    return at


@pytest.mark.parametrize("undo", ["chunk", "ahead"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_first_computation_wrong_twice_is_replaced_by_the_two_that_agree(
    tmp_path, monkeypatch, fused, device, undo
):
    monkeypatch.setenv(ENV, fused)
    plain = _run(tmp_path / "plain", None, device=device)["state"]
    times: list = []
    before = plugins._point_handler
    monkeypatch.setattr(plugins, "install_point_handler", lambda h: None)  # keep ours
    plugins._point_handler = _flip_first(1, times)
    try:
        with pytest.raises(WrongUpdate):
            _run(tmp_path, True, device=device, undo=undo)
        plugins._point_handler = _flip_first(1, times)  # the redo: the same flip again
        got = _run(tmp_path, True, device=device, undo=undo)
    finally:
        plugins._point_handler = before
    assert times.count(1) == 2, f"the flip did not repeat: the test proves nothing ({times})"
    # torch's values kept, and parity rebuilt for them: state and host parity exact.
    for k in plain:
        assert torch.equal(plain[k].view(torch.uint8), got["state"][k].view(torch.uint8)), k
    recs = [json.loads(x) for x in (tmp_path / "rank0.recheck.jsonl").read_text().splitlines()]
    assert [r.get("settled") for r in recs] == [None, "first"], recs


@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_disagreement_that_does_not_repeat_was_transient(tmp_path, monkeypatch, fused):
    monkeypatch.setenv(ENV, fused)
    with pytest.raises(WrongUpdate):
        _run(tmp_path, True, flip_at=1)
    plain = _run(tmp_path / "plain", None)["state"]
    got = _run(tmp_path, True)
    for k in plain:
        assert torch.equal(plain[k].view(torch.uint8), got["state"][k].view(torch.uint8)), k
    recs = [json.loads(x) for x in (tmp_path / "rank0.recheck.jsonl").read_text().splitlines()]
    assert [r.get("settled") for r in recs] == [None, "transient"], recs


def _faultkit_flip(tmp_path, device: str) -> dict:
    """Three iterations (no recheck), faultkit's own sdc-update flip armed at iteration
    1's first chunk; the state after them, and what a full scrub then found."""
    from faultkit import hooks
    from leto.integrity.scrub import Scrubber

    cfg = (
        PoolConfig.for_cuda(0, data_pages=12, tier1_pages=3, allow_fault_injection=True)
        if device == "cuda"
        else small_config(data_pages=12, tier1_pages=3)
    )
    sm = start_state_manager(cfg)
    before = plugins._point_handler
    plugins.install_point_handler(hooks.point)
    hooks.arm(plugins.SDC_POINT, 1, mode="corrupt:computed:1")
    try:
        tr = u.Trainer(sm, "adamw-fused", dims=DIMS, chunk_units=2)
        try:
            for _ in range(3):
                tr.iteration()
            return {"state": _state(tr), "scrub": Scrubber(tr.up).full()}
        finally:
            tr.client.close()
    finally:
        hooks.disarm()
        plugins.install_point_handler(before)
        sm.stop()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", ["1", "0"])
def test_faultkits_wrong_update_is_one_parity_agrees_with(tmp_path, monkeypatch, fused, device):
    """sdc-update emulates a wrong computation, not a damaged page: after the fused pass
    (which absorbed its values into parity as it computed them) the flip is folded into
    that parity too, so the scrub finds nothing and only a replica or the recheck can."""
    monkeypatch.setenv(ENV, fused)
    plain = _run(tmp_path / "plain", None, device=device)["state"]
    got = _faultkit_flip(tmp_path, device)
    assert got["scrub"]["repaired"] == [], got["scrub"]  # and no CorruptState raised
    differ = [k for k in plain if not torch.equal(plain[k].view(torch.uint8),
                                                  got["state"][k].view(torch.uint8))]  # fmt: skip
    assert "param" in differ, f"the flip never reached the parameters: {differ}"
