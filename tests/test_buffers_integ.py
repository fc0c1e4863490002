"""Persistent buffers under ``leto.Run`` (``leto.trainer.buffer_state``): a BatchNorm
model with a constant persistent mask, two gloo ranks, against torchrun + DDP's default
``broadcast_buffers`` — parameters, running statistics and ``num_batches_tracked``
bit-identical fault-free, and after a rank is killed in the second micro-batch's backward
(the iteration's forwards had written the statistics: the redo starts from the
previous iteration's) with pages lost. A constant buffer that training writes, and
running statistics on a model that is not data parallel, are refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from faultkit.job import JobFault, run_job
from leto.errors import InvalidInput
from leto.trainer.buffer_state import RetainedBuffers
from leto.workload.train import TrainConfig
from tests import torchrun_reference

SCRIPT = Path(__file__).resolve().parent / "scripts" / "buffers_job.py"


def _same(a: Path, b: Path) -> None:
    for r in range(2):
        want = torch.load(a / f"rank{r}.final.pt")
        got = torch.load(b / f"rank{r}.final.pt")
        assert want.keys() == got.keys()
        for k, v in want.items():
            x, y = v.reshape(-1).view(torch.uint8), got[k].reshape(-1).view(torch.uint8)
            assert torch.equal(x, y), f"rank {r}: {k} differs from DDP's"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    outs = [tmp_path_factory.mktemp("buffers_ddp") for _ in range(torchrun_reference.ATTEMPTS)]
    attempt = torchrun_reference.run(
        "buffers_job.py",
        lambda a: ["--standalone", "--nproc-per-node", "2", str(SCRIPT), "--out", str(outs[a])],
        timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    return outs[attempt]


@pytest.mark.integ
@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", [False, True], ids=["fault-free", "killed"])
def test_running_statistics_are_ddps_bit_for_bit(ddp, tmp_path, killed):
    faults = [JobFault(1, "compute.backward@3#2", lose_pages=2)] if killed else []
    out = tmp_path / "train"
    got = run_job(
        2, TrainConfig(), tmp_path, faults, shadow_level="L2" if killed else "off",
        script=SCRIPT, script_args=["--leto", "--out", str(out)], timeout_s=240,
    )  # fmt: skip
    assert got["code"] == 0 and got["injections"] == len(faults)
    _same(ddp, out)
    stats = torch.load(out / "rank1.final.pt")
    assert int(stats["bn.num_batches_tracked"]) == 6 * 2  # two micro-batches; evals do not count


class _Written(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros(()))


def test_a_constant_buffer_training_writes_is_refused_by_name():
    m = _Written()
    kept = RetainedBuffers(m, torch.device("cpu"))
    assert kept.stats == [] and kept.state_dict() == {}
    m.seen += 1  # written in a forward, say
    with pytest.raises(InvalidInput, match="persistent buffer seen was written during training"):
        kept.state_dict()


def test_running_statistics_on_a_gpu_are_refused_before_anything_is_retained():
    with pytest.raises(
        InvalidInput, match=r"buffer 1.running_mean is written in training \(running statistics"
    ):
        RetainedBuffers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)),
                        torch.device("cuda"))  # fmt: skip
