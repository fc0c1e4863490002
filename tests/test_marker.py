"""The progress marker's record: slots round-trip, a torn slot leaves the older one, and
the loss — outside the CRC so that a GPU can copy it in from the device — comes back
with the state it was written with."""

from __future__ import annotations

import math

import pytest
import torch

from leto.update.marker import RECORD_BYTES, Marker, MarkerState, Phase, Step


def _marker(device_writes=None) -> tuple[Marker, torch.Tensor, list[torch.Tensor]]:
    pin = device_writes is not None
    record = torch.zeros(RECORD_BYTES, dtype=torch.uint8, pin_memory=pin)
    mirrors = [torch.zeros(RECORD_BYTES, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    return Marker(record, mirrors, stream_writes=device_writes), record, mirrors


def test_the_newest_slot_is_read_back_with_its_loss():
    m, record, mirrors = _marker()
    m.write(MarkerState(3, Phase.GRADS_PROTECTED, loss=2.5))
    m.write(MarkerState(3, Phase.UPDATE, Step.UNDO_DONE, group=1, chunk=4, loss=-0.125))
    got = Marker(record, mirrors).read()
    assert (got.iteration, got.phase, got.step, got.group, got.chunk, got.loss) == (
        3, Phase.UPDATE, Step.UNDO_DONE, 1, 4, -0.125
    ), got  # fmt: skip
    assert all(torch.equal(x, record) for x in mirrors), "the parity mirrors differ"


def test_a_torn_slot_leaves_the_older_one():
    m, record, mirrors = _marker()
    m.write(MarkerState(5, Phase.SYNCED, loss=1.0))  # slot 1
    m.write(MarkerState(5, Phase.UPDATE, loss=1.0))  # slot 0
    record[8] ^= 0xFF  # inside slot 0's CRC'd fields
    got = Marker(record, mirrors).read()
    assert got.phase is Phase.SYNCED and got.loss == 1.0, got


def test_the_loss_is_outside_the_crc():
    m, record, mirrors = _marker()
    m.write(MarkerState(1, Phase.DONE, loss=float("nan")))
    before = Marker(record, mirrors).read()
    assert before is not None and math.isnan(before.loss)
    record[(before.seq % 2) * 64 + 48 : (before.seq % 2) * 64 + 56] = torch.tensor(
        [0.75], dtype=torch.float64
    ).view(torch.uint8)
    after = Marker(record, mirrors).read()
    assert after is not None and after.loss == 0.75, after


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_loss_is_copied_from_the_device_in_stream_order():
    from leto.update.marker import StreamOrderedWrites

    dev = torch.device("cuda", 0)
    m, record, mirrors = _marker(StreamOrderedWrites(dev))
    loss = torch.full((), 3.0, device=dev)
    torch.cuda._sleep(50_000_000)  # the loss is not ready when the writes are queued
    loss.mul_(0.5)
    m.device_loss = (7, loss.double())
    m.write(MarkerState(7, Phase.GRADS_PROTECTED))
    m.write(MarkerState(7, Phase.SYNCED))
    torch.cuda.synchronize(dev)
    got = Marker(record, mirrors).read()
    assert (got.phase, got.loss) == (Phase.SYNCED, 1.5), got
