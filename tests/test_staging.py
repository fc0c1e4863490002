"""The checkpoint stager (leto.trainer.staging): what it stages is the state as it was
when staging was asked for, its buffers are made once and kept, and DCP's protocol
calls (close after a save, as torch 2.11 does) leave it usable."""

from __future__ import annotations

import time

import pytest
import torch

from leto.trainer import staging
from leto.trainer.staging import HostStager

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "rank0.param": torch.randn(1000, generator=g).to(device),
        "rank0.loop0": torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=g).to(device),
    }


# cuda: on a GPU machine (bash bench/gpu_suite.sh userpath)
@pytest.mark.parametrize("device", DEVICES)
def test_staged_bytes_are_the_state_at_staging_and_buffers_are_kept(device):
    state = _state(device)
    stager = HostStager(state)
    want = {k: v.cpu().clone() for k, v in state.items()}
    first = stager.stage(state).result(timeout=60)
    for k in state:
        assert first[k].device.type == "cpu"
        assert torch.equal(first[k].view(torch.uint8), want[k].view(torch.uint8))
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    stager.close()  # what torch 2.11's async_save calls after each save
    for v in state.values():
        v.add_(1)  # the next iteration's update
    second = stager.stage(state).result(timeout=60)
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs, "buffers were remade"
    for k, v in state.items():
        assert torch.equal(second[k].view(torch.uint8), v.cpu().view(torch.uint8))
    stager.shutdown()


def test_a_state_of_another_shape_gets_new_buffers():
    state = _state("cpu")
    stager = HostStager(state)
    stager.stage(state).result(timeout=60)
    grown = {k: torch.cat([v, v]) for k, v in state.items()}
    got = stager.stage(grown).result(timeout=60)
    assert all(torch.equal(got[k], grown[k]) for k in grown)
    stager.shutdown()


class _Store:
    """The job store's get/set/check, in memory."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def check(self, ks):
        return all(k in self.d for k in ks)


@pytest.fixture
def fresh_ahead(monkeypatch):
    monkeypatch.setattr(staging, "_ahead", {"thread": None, "buffers": None, "said": None})
    monkeypatch.setattr(staging, "available_bytes", lambda: 64 << 30)


def test_a_shadow_makes_the_published_buffers_and_the_promoted_stager_takes_them(fresh_ahead):
    state = _state("cpu")
    store = _Store()
    assert staging.make_ahead(store, 0, torch.device("cpu")) is None  # nothing published yet
    staging.publish_layout(store, 0, staging.shapes_of(state))
    said = staging.make_ahead(store, 0, torch.device("cpu"))
    assert said and "ahead" in said
    assert staging.make_ahead(store, 0, torch.device("cpu")) is None  # once
    made = staging._ahead["thread"]
    stager = HostStager(state)
    got = stager.stage(state).result(timeout=60)
    assert stager.made["how"] == "made ahead by the parked shadow", stager.made
    assert not made.is_alive()
    for k, v in state.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
    stager.shutdown()


def test_buffers_made_ahead_for_other_shapes_are_not_used(fresh_ahead):
    state = _state("cpu")
    store = _Store()
    staging.publish_layout(store, 0, staging.shapes_of(state))
    staging.make_ahead(store, 0, torch.device("cpu"))
    grown = {k: torch.cat([v, v]) for k, v in state.items()}
    stager = HostStager(grown)
    got = stager.stage(grown).result(timeout=60)
    assert stager.made["how"].startswith("made here"), stager.made
    assert all(torch.equal(got[k], grown[k]) for k in grown)
    stager.shutdown()


def test_no_buffers_ahead_when_the_host_lacks_room_for_both(fresh_ahead, monkeypatch):
    state = {"rank0.param": torch.zeros(1 << 20)}  # 4 MiB
    store = _Store()
    staging.publish_layout(store, 0, staging.shapes_of(state))
    monkeypatch.setattr(staging, "available_bytes", lambda: (8 << 30) + (2 << 20))
    said = staging.make_ahead(store, 0, torch.device("cpu"))
    assert said and "not made ahead" in said and "available" in said, said
    assert staging._ahead["thread"] is None
    assert staging.take_ahead(staging.shapes_of(state)) is None


def test_staging_ahead_can_be_turned_off(fresh_ahead, monkeypatch):
    store = _Store()
    staging.publish_layout(store, 0, staging.shapes_of(_state("cpu")))
    monkeypatch.setenv(staging.ENV_AHEAD, "0")
    assert staging.make_ahead(store, 0, torch.device("cpu")) is None
    assert staging._ahead["thread"] is None


@pytest.mark.parametrize("numel", [1, 1000, (staging.CHUNK_BYTES // 4) * 2 + 3])
def test_pieces_cover_the_tensor_once_within_one_registration_each(numel):
    src = torch.arange(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    seen = 0
    for s, d in staging._pieces(src, dst):
        assert d.numel() * d.element_size() <= staging.CHUNK_BYTES
        assert d.data_ptr() - dst.data_ptr() == seen * 4  # contiguous, in order
        d.copy_(s)
        seen += d.numel()
    assert seen == numel and torch.equal(dst, src)


@pytest.mark.parametrize("device", DEVICES)
def test_a_stage_at_release_copies_nothing_before_it_and_then_what_the_stream_left(device):
    """The checkpointer's stager starts a save's copies at ``release`` (after the next
    iteration's first writes to the host): nothing is read before, and what is read is
    the state after the work queued before the release."""
    state = _state(device)
    stager = HostStager(state, at_release=True)
    staged = stager.stage(state)
    time.sleep(0.2)  # (a stage not waiting for its release has copied by now)
    for v in state.values():
        v.add_(1)  # queued before the release: the copies come after it
    want = {k: v.cpu().clone() for k, v in state.items()}
    assert not staged.done(), "copied before the release"
    stager.release()
    got = staged.result(timeout=60)
    for k in state:
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    stager.release()  # twice: nothing
    stager.shutdown()


def test_a_stage_never_released_fails_and_says_why(monkeypatch):
    monkeypatch.setattr(staging, "RELEASE_TIMEOUT_S", 0.2)
    stager = HostStager(_state("cpu"), at_release=True)
    staged = stager.stage(_state("cpu"))
    with pytest.raises(TimeoutError, match="not released within"):
        staged.result(timeout=30)
    stager._pool.shutdown(wait=True)
