"""On the H200: ``leto run --shadow-level auto`` with real device memory and the native
allocation hook (issue 8's demonstration).

The job's memory demand grows past what the active trainer and its parked L3 shadow fit
together (``faultkit.job.Pressure``: in 256 MiB allocations, 512 MiB beyond the free
memory, once the shadow has parked). With fixed L3 shadows the trainer OOMs — a failure
Leto itself caused. Under the controller the hook reclaims the shadow inside the failing
allocation, the job completes bit-exactly, the agent relaunches the shadow at a lower
level, and a HOF injected afterwards recovers through it. ``LETO_TEST_FOOTPRINTS`` names
``bench/preinit_footprint.py``'s output (the suite measures it first); without it the
paper's footprints are used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from faultkit.job import JobFault, Pressure, run_job
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig
from verifiers import compare

pytestmark = pytest.mark.gpu

ITERS = 10
POOL = PoolConfig.for_cuda(0, data_pages=6, tier1_pages=2, allow_fault_injection=True)
PRESSURE = Pressure(at=3, beyond_free_mib=512, chunk_mib=256)


def _footprints() -> tuple[str, ...]:
    f = os.environ.get("LETO_TEST_FOOTPRINTS")
    return ("--preinit-footprints", f) if f else ()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    run_job(1, TrainConfig(iterations=ITERS), out, pool=POOL, device="cuda", shadow_level="off")
    return out / "train"


def test_without_the_controller_the_parked_l3_shadow_makes_the_trainer_oom(tmp_path):
    cfg = TrainConfig(iterations=ITERS)
    got = run_job(
        1, cfg, tmp_path, pool=POOL, device="cuda", shadow_level="L3", allow_failure=True,
        extra=("--max-failures", "1"), pressure=PRESSURE,
    )  # fmt: skip
    log = (tmp_path / "logs" / "rank0.gen0.active.log").read_text()
    assert "OutOfMemoryError" in log or "CUDA out of memory" in log, log[-3000:]
    assert got["failures"] >= 1, got


def test_under_the_controller_the_shadow_is_reclaimed_the_job_is_exact_and_a_hof_recovers(
    reference, tmp_path
):
    cfg = TrainConfig(iterations=ITERS)
    faults = [JobFault(0, "update.optimizer@7#1")]
    got = run_job(
        1, cfg, tmp_path, faults, pool=POOL, device="cuda", shadow_level="auto",
        extra=_footprints(), pressure=PRESSURE,
    )  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(got, indent=1, default=str))
    logs = Path(tmp_path / "logs")
    gen0 = (logs / "rank0.gen0.active.log").read_text()
    assert "OutOfMemoryError" not in gen0, gen0[-3000:]
    v = compare(reference, Path(got["out"]))
    assert v.exact, v.describe()
    (rec,) = got["recoveries"]
    assert rec["class"] == "HOF" and rec["level"] in ("L1", "L2"), rec
    pre = got["preinit"]["0"]
    acts = [(d["action"], d["level_from"], d["level_to"]) for d in pre["decisions"]]
    assert acts[0] == ("launch", None, "L3"), acts
    assert acts[1][0] == "relaunch" and acts[1][1] == "L3", acts
    assert pre["reclamations"] == 1 and not pre["emulated_device"], pre
    d = pre["decisions"][1]
    print(
        f"reclamation: {(d['free_after_bytes'] - d['free_before_bytes']) / 2**20:.0f} MiB back "
        f"in {d['latency_s'] * 1e3:.1f} ms; relaunched at {d['level_to']}; "
        f"HOF through it: {rec.get('recovery_s', float('nan')):.2f} s (fencing "
        f"{rec['fencing_s']:.2f} s, promotion {rec['promotion_s']:.2f} s; trainer steps "
        f"{json.dumps(rec.get('trainers'))})"
    )
    assert (logs / "rank0.memory.png").stat().st_size > 0
