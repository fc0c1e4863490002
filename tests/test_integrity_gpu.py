"""Silent corruption on the GPU: faultkit flips bits in a live trainer's VMM pages or
page-locked host parity, the scrub (CUDA codec, side-stream check) finds them: parity
repaired in place, device pages named and the job back from a verified checkpoint —
bit-exact with a fault-free run either way.

Runs on a CUDA machine (``bench/gpu_suite.sh integrity``); skipped with a reason without
CUDA. The CPU twin is ``tests/test_integrity_integ.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faultkit.job import JobFault, finish_job, plan_of, run_job, start_job
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig
from verifiers import compare

pytestmark = pytest.mark.gpu
CFG = TrainConfig(iterations=5, n_embd=256, n_layer=4, n_head=4, chunk_units=1)
# H1 = 4: one error per codeword located.
POOL = PoolConfig.for_cuda(0, data_pages=6, tier1_pages=4, allow_fault_injection=True)


def run(out, faults=(), extra=()) -> dict:
    # start_job, not run_job: a rolled-back iteration logs its loss twice, differently.
    (p,) = start_job(1, CFG, out, plan_of(faults, POOL), POOL, "cuda", "L2", extra)
    ((code, summary),) = finish_job([p], timeout_s=300)
    assert code == 0, summary
    return {**summary, "out": str(Path(out) / "train")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    got = run_job(1, CFG, tmp_path_factory.mktemp("gpuref"), pool=POOL, device="cuda")
    return Path(got["out"])


def _found(got):
    f = Path(got["out"]) / "rank0.scrub.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _exact(reference, got):
    v = compare(reference, Path(got["out"]))
    assert v.exact, v.describe()


def test_flipped_host_parity_is_repaired_in_place_on_the_gpu(reference, tmp_path):
    got = run(tmp_path, [JobFault(0, "gather@2", mode="corrupt:tier1:2")])
    assert got["recoveries"] == [], got["recoveries"]
    found = _found(got)
    assert sorted(f["page"] for f in found if f["tier"] == "tier1") == [0, 1], found
    _exact(reference, got)


@pytest.mark.parametrize("at,group", [("compute.forward@2", 0), ("update.optimizer@2#1", -1)])
def test_flipped_device_pages_fall_back_to_a_verified_checkpoint_on_the_gpu(
    reference, tmp_path, at, group
):
    fault = JobFault(0, at, mode=f"corrupt:data:2:{group}")
    got = run(tmp_path, [fault], extra=("--checkpoint-interval", "2"))
    (rec,) = got["recoveries"]
    assert rec["class"] == "FF" and rec["failures"]["0"]["error"]["exception"] == "CorruptState"
    named = sorted(f["page"] for f in _found(got) if f["tier"] == "data")
    assert named == [0, 1], _found(got)
    _exact(reference, got)
