"""The checkpoint stager (leto.trainer.staging): what it stages is the state as it was
when staging was asked for, its buffers are made once and kept, and DCP's protocol
calls (close after a save, as torch 2.11 does) leave it usable."""

from __future__ import annotations

import pytest
import torch

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
