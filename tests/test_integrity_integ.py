"""Silent corruption under ``leto run``: faultkit flips bits in a live trainer's retained
pages (no unmap, no death) and the job either repairs them exactly or falls back to a
verified checkpoint — the final state bit-exact with a fault-free run either way, the
pages named in the record. Never a wrong model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faultkit.job import finish_job, start_job
from leto.workload.train import TrainConfig
from verifiers import compare
from verifiers.trace import read_run

pytestmark = pytest.mark.integ
ITERS = 5
CFG = TrainConfig(iterations=ITERS)  # test_runtime_integ's: the reference is shared
# A full pass of the background scrub every iteration (the test pools are small).
EVERY = ("--scrub-mib-per-iteration", "64")


@pytest.fixture(scope="module")
def reference(job_reference):
    return Path(job_reference(2, CFG)["out"])


def _run(tmp_path, at: str, mode: str, extra=()):
    plan = [{"generation": 0, "rank": 1, "at": at, "mode": mode}]
    (p,) = start_job(2, CFG, tmp_path, plan, shadow_level="L2", extra=(*extra, *EVERY))
    ((code, summary),) = finish_job([p], timeout_s=240)
    assert code == 0, summary
    flips = [json.loads(x) for x in (tmp_path / "aborts.jsonl").read_text().splitlines()]
    assert len(flips) == 1 and flips[0]["at"].startswith(at), flips
    scrub = tmp_path / "train" / "rank1.scrub.jsonl"
    found = [json.loads(x) for x in scrub.read_text().splitlines()] if scrub.exists() else []
    return summary, flips[0], found


def test_flipped_host_parity_is_found_by_the_scrub_and_repaired_in_place(reference, tmp_path):
    # Rank 0's tier 1 in iteration 2 after its scrub step: the update of 2 carries the
    # errors along (it loads, updates and stores that parity), so rank 0's parity digest
    # differs from rank 1's after that update (leto.integrity.replica); both ranks scrub the
    # differing group, rank 0 locates and repairs them, and the digests agree again —
    # not fatal. (With --no-replica-check the background check at 3's start flags the
    # group and 4's start repairs them.) Rank 1's tier 2,
    # which every update encodes again from tier 1 (a flip mid-run is overwritten before
    # anything reads it), in the last iteration after the first group's refresh: the
    # scrub at the end of training finds it. One job.
    plan = [
        {"generation": 0, "rank": 0, "at": "gather@2", "mode": "corrupt:tier1:2"},
        {"generation": 0, "rank": 1, "at": f"update.tier2@{ITERS - 1}#2",
         "mode": "corrupt:tier2:1"},
    ]  # fmt: skip
    (p,) = start_job(2, CFG, tmp_path, plan, shadow_level="L2", extra=EVERY)
    ((code, summary),) = finish_job([p], timeout_s=240)
    assert code == 0, summary
    assert summary["recoveries"] == [], "parity errors are repaired without a recovery"
    flips = [json.loads(x) for x in (tmp_path / "aborts.jsonl").read_text().splitlines()]
    assert sorted(f["corrupt"] for f in flips) == ["tier1", "tier2"], flips
    for rank, tier, want, when in (
        (0, "tier1", [0, 1], "replicas disagreed"),
        (1, "tier2", [-1], "at the end of training"),
    ):  # fmt: skip
        log = tmp_path / "train" / f"rank{rank}.scrub.jsonl"
        found = [json.loads(x) for x in log.read_text().splitlines()]
        assert sorted({f["page"] for f in found if f["tier"] == tier}) == want, found
        assert all(f["repaired"] and f["when"] == when for f in found), found
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()


# Two pages of parameters/optimizer state, flipped in iteration 2's update while the
# first group's first chunk is in flight (last group: its chunks are still to come):
# the scrub finds them, names them, and the checkpoint fallback (the last save,
# verified by a full scrub before it was written) replays to the same bytes. (A page
# whose own chunk is in flight is the one window parity cannot see: docs/integrity.md.
# A flip before the forward pass: tests/test_integrity_gpu.py and faultkit's matrix.)
@pytest.mark.parametrize("at,group", [("update.optimizer@2#1", -1)])
def test_flipped_device_pages_are_named_and_the_job_falls_back_to_a_verified_checkpoint(
    reference, tmp_path, at, group
):
    summary, flip, found = _run(
        tmp_path, at, f"corrupt:data:2:{group}", extra=("--checkpoint-interval", "2")
    )
    (rec,) = summary["recoveries"]
    assert rec["class"] == "FF", rec
    error = rec["failures"]["1"]["error"]
    assert error["exception"] == "CorruptState", error
    named = sorted(f["page"] for f in found if f["tier"] == "data" and not f["repaired"])
    assert named == [p["page"] for p in flip["pages"]], (found, flip)
    assert "silent corruption of retained state" in error["message"], error
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()
    # Found before the next update read it: the update of 2 carried the flipped pages
    # into parity that differs from the other replica's (leto.integrity.replica: compared at
    # the start of iteration 3's step), whose scrub of the group named them. The only
    # records the rollback superseded are iteration 2's — no update trained on the
    # corrupted state.
    undone = [
        rec.iteration for tr in read_run(tmp_path / "train").traces.values()
        for rec, _ in tr.rolled_back
    ]  # fmt: skip
    assert v.rolled_back == len(undone) and set(undone) == {2}, undone


def test_a_recovery_rebuilt_from_a_silently_corrupted_survivor_is_caught_by_verification(
    reference, tmp_path
):
    # Rank 0's first parameter page flips at the end of iteration 2's forward; rank 1
    # dies protecting 2's gradients (after the all-reduce, so rank 0 is past its forward,
    # and before the clipping all-reduce rank 0 then waits in: no scrub runs on rank 0
    # in between), and every rank loses its first exp_avg page (same group). Rank 0's
    # rebuild reads the corrupted survivor, so the rebuilt page is wrong too: the
    # verification after the rebuild (tier 1's unused rows) finds the two errors —
    # more than it locates, so nothing is patched — and the job falls back to the
    # verified checkpoint. Bit-exact in the end.
    plan = [
        {"generation": 0, "rank": 0, "at": "compute.backward@2", "mode": "corrupt:data:1"},
        {"generation": 0, "rank": 1, "at": "grad_parity@2#1",
         "inject": [["data", "exp_avg", [0]]]},
    ]  # fmt: skip
    extra = ("--checkpoint-interval", "2", "--allow-fault-injection")
    (p,) = start_job(2, CFG, tmp_path, plan, shadow_level="L2", extra=(*extra, *EVERY))
    ((code, summary),) = finish_job([p], timeout_s=240)
    assert code == 0, summary
    classes = [r["class"] for r in summary["recoveries"]]
    assert classes == ["HOF", "FF"], summary["recoveries"]
    scrub = tmp_path / "train" / "rank0.scrub.jsonl"
    found = [json.loads(x) for x in scrub.read_text().splitlines()]
    assert [f["when"] for f in found] == ["verifying the rebuilt groups"], found
    assert found[0]["tier"] == "unlocated" and not found[0]["repaired"], found
    v = compare(reference, tmp_path / "train")
    assert v.exact, v.describe()


def test_leto_pool_scrub_asks_a_running_job_and_reports_what_each_rank_found(tmp_path):
    # No checkpoints (the full scrub before a save would repair the flip before the
    # question: the test was flaky), no background scrub and no replica check (it would
    # find the replicas' parity differing after iteration 3's update and have it
    # repaired at once): rank 1's tier-1
    # pages flip at iteration 3 and stay wrong until `leto pool scrub` asks; every rank
    # answers at its next iteration's start.
    # Far more iterations than the question needs (with 80 a loaded machine once finished
    # the job before the CLI had started); the job is stopped with SIGTERM once answered.
    cfg = TrainConfig(iterations=100000)
    plan = [{"generation": 0, "rank": 1, "at": "gather@3", "mode": "corrupt:tier1:2"}]
    (p,) = start_job(2, cfg, tmp_path, plan, shadow_level="off",
                     extra=("--scrub-mib-per-iteration", "0", "--no-replica-check",
                            "--no-checkpoints"))  # fmt: skip
    losses = tmp_path / "train" / "rank1.losses.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if losses.exists() and len(losses.read_text().splitlines()) >= 5:
            break
        time.sleep(0.1)
    cli = [sys.executable, "-m", "leto.cli", "pool", "scrub", "--json", "--timeout-s", "60",
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    got = subprocess.run(cli, capture_output=True, text=True, timeout=90)
    p.send_signal(signal.SIGTERM)
    ((code, summary),) = finish_job([p], timeout_s=240)
    assert summary.get("stopped") == "SIGTERM" and not summary["recoveries"], (code, summary)
    assert got.returncode == 0, got.stderr
    ans = json.loads(got.stdout)
    assert ans["missing"] == [] and set(ans["answers"]) == {"0", "1"}, ans
    assert ans["answers"]["0"]["ok"] and ans["answers"]["0"]["repaired"] == [], ans
    r1 = ans["answers"]["1"]
    assert r1["ok"] and r1["iteration"] >= 5, r1
    assert sorted(f["page"] for f in r1["repaired"] if f["tier"] == "tier1") == [0, 1], r1
    # The answer carries the background scrub's account: off in this job, so no pass.
    assert r1["background"]["budget_bytes"] == 0 and r1["background"]["passes"] == 0, r1
