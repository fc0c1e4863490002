"""A script whose data comes from a shuffled two-worker ``StatefulDataLoader`` given to
``leto.Run(data=...)`` (``examples/porting/loader_leto.py``) resumes at the exact next
batch after failures, with no determinism edits: killed in a micro-batch's backward
(the iteration is redone from the previous iteration's data record), in the all-reduce
(redone, though its own record was already written) and in the middle of the update
with pages lost (finished: the next iteration reads its record), and after more pages
lost than parity covers (the checkpoint fallback: checkpoints carry the data records) —
every iteration's loss and retained tensors equal the fault-free run's, and so does
each iteration's list of samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faultkit.job import JobFault, first_difference, run_job
from leto.workload.train import TrainConfig

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "porting" / "loader_leto.py"
ITERS = 6
# Pages of the first protection group's parameters and moments, a host parity page and a
# gradient page, on every rank (as tests/test_porting.py's CPU case).
LOSE = (("data", "param", (0,)), ("data", "exp_avg", (1,)), ("data", "grad", (0,)))


def _job(out: Path, faults=(), extra=()) -> dict:
    return run_job(
        2, TrainConfig(), out, faults, shadow_level="L2" if faults else "off", extra=extra,
        script=SCRIPT, script_args=["--iterations", str(ITERS), "--out", str(out / "train")],
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _job(tmp_path_factory.mktemp("loader_ref"))


def _samples(out: str, rank: int) -> dict[int, list[int]]:
    """Each iteration's samples on ``rank`` (an iteration redone: its last record)."""
    lines = (Path(out) / f"rank{rank}.samples.jsonl").read_text().splitlines()
    return {r["iteration"]: r["samples"] for r in map(json.loads, lines)}


def _same_samples(ref: dict, got: dict) -> None:
    for r in range(2):
        want, have = _samples(ref["out"], r), _samples(got["out"], r)
        assert sorted(have) == list(range(ITERS)), sorted(have)
        for t in range(ITERS):
            assert have[t] == want[t], f"rank {r} iteration {t}: {have[t]} != {want[t]}"


def test_a_stateful_loader_resumes_at_the_exact_next_batch_after_failures(reference, tmp_path):
    faults = [
        JobFault(0, "compute.backward@1#2"),  # the second micro-batch's backward
        JobFault(1, "allreduce@3#1"),  # after the data record of 3 was written
        JobFault(0, "update.optimizer@4#1", inject=LOSE),
    ]
    got = _job(tmp_path / "faulted", faults)
    assert got["injections"] == 3, got["recoveries"]
    _same_samples(reference, got)
    assert (why := first_difference(reference, got)) is None, why


def test_a_stateful_loader_resumes_exactly_from_a_checkpoint(reference, tmp_path):
    # 5 pages lost per group, H1 = 4: beyond parity, a fatal failure; every rank
    # restarts cold from the newest checkpoint (one per iteration here).
    fault = JobFault(1, "update.optimizer@3#1", lose_pages=5)
    got = _job(tmp_path / "ff", [fault], extra=("--checkpoint-interval", "1"))
    assert [r["class"] for r in got["recoveries"]] == ["HOF", "FF"], got["recoveries"]
    _same_samples(reference, got)
    assert (why := first_difference(reference, got)) is None, why
