"""A real job at leto run's default level (L3): the promoted trainers' set-up ran ahead
of their promotion while parked, up to leto.Run, and the run is bit-identical to a
fault-free one (faultkit certify, a kill in the forward/backward and in the update with
pages lost); what the set-up printed while running ahead is in each promoted trainer's
log once, after its promotion; the script's model ran forward and backward at its
trainer's shapes before that (LETO_SHAPE_WARMUP=1: on the CPU too). The job's iterations take a second (a sleep), so the
second fault's shadows have parked and seen their trainers' pace move before it strikes
(faultkit places it at iteration 8 of 16; they start after iteration 2) also on a busy
machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "paced_job.py"


def _certify(tmp_path, *script_args: str, env=None) -> tuple[dict, Path]:
    work = tmp_path / "runs"
    p = subprocess.run(
        [sys.executable, "-m", "faultkit.cli", "certify", "--nproc-per-node", "2",
         "--phases", "compute,update", "--json", "--workdir", str(work),
         "--", str(SCRIPT), "--iterations", "16", "--seconds", "1.0", *script_args],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert p.stdout, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), work


def _logs(work: Path) -> str:
    """The faulted run's agent and rank logs' last lines, for a failure's message."""
    out = []
    for f in sorted(work.glob("faulted*/logs/*.log")):
        out.append(f"--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-25:]))
    return "\n".join(out)[-20000:]


@pytest.mark.integ
@pytest.mark.timeout(300)
def test_a_set_up_that_fails_ahead_turns_it_off_and_the_run_stays_exact(tmp_path):
    # The set-up raises only where it runs ahead (a stand-in for one that needs what only
    # a promoted trainer has): that shadow ends as a recoverable failure — never a script
    # error that stops the job, also when it was promoted meanwhile — and every later
    # shadow parks in leto.init().
    v, work = _certify(tmp_path, "--fails-ahead")
    # (the whole verdict, as text: pytest shortens an object's repr, and a NOT EXACT
    # here, seen once under CI's load at 92a8079, needs its divergence to be diagnosed)
    assert v["verdict"] == "EXACT", json.dumps(v, indent=1)[:20000] + "\n" + _logs(work)
    logs = "".join(f.read_text() for f in work.glob("faulted*/logs/rank*.log"))
    assert "running the script's set-up ahead failed (the set-up raised RuntimeError" in logs
    assert "parks at leto.init() (turned off for this job: rank" in logs


@pytest.mark.integ
@pytest.mark.timeout(300)
def test_the_set_up_runs_ahead_and_the_recovery_is_exact(tmp_path):
    # With the warm-up at the script's shapes too (on by default on a GPU only).
    v, work = _certify(tmp_path, env={"LETO_SHAPE_WARMUP": "1"})
    assert v["verdict"] == "EXACT", v
    promoted = [
        f for f in sorted(work.glob("faulted*/logs/rank*.gen*.shadow.log"))
        if "promoted" in f.read_text()
    ]  # fmt: skip
    ran = [f for f in promoted if "to where it reached leto.Run; promoted" in f.read_text()]
    assert ran, "no promoted trainer had run its set-up ahead: " + "\n".join(
        f"{f.name}: {f.read_text()[-800:]}" for f in promoted
    )
    for f in ran:
        text = f.read_text()
        gen = int(f.name.split(".gen")[1].split(".")[0])
        # Held while running ahead, written once at the promotion.
        assert text.count("set-up done") == 1 and f"generation {gen}" in text, text[-2000:]
        assert "script set-up 0.00" in text, text[-2000:]  # the stage is off the path
    warmed = "ran the script's model forward and backward at its trainer's shapes"
    assert any(warmed in f.read_text() for f in ran), "\n".join(
        f"{f.name}: {f.read_text()[-800:]}" for f in ran
    )
