"""What ``faultkit`` says and leaves behind: it prints its stages as they happen and
removes its work directory, also when it is stopped.

Each test starts real jobs (integ). Every temporary directory goes under the test's own
``TMPDIR``, so "nothing left" is checked there, not in a /tmp other jobs share.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"


def _env(tmp: Path) -> dict:
    tmp.mkdir(exist_ok=True)
    # The repository first on the path: the job runs from its own working directory.
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=path)


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("leto-pool-", "faultkit-")))


def _processes_under(root: Path) -> list[int]:
    """Live processes whose working directory is under ``root``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "cwd").startswith(str(root)):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _wait_for(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"waited {timeout_s:.0f} s for {what}")


def test_faultkit_inject_prints_its_stages_and_removes_its_work_directory(tmp_path):
    tmp = tmp_path / "tmp"
    cmd = [sys.executable, "-m", "faultkit.cli", "inject", "--iterations", "2", "--pages", "2"]
    r = subprocess.run(
        cmd, env=_env(tmp), cwd=tmp_path, capture_output=True, text=True, timeout=280
    )
    assert r.returncode == 0 and "EXACT" in r.stdout, r.stdout + r.stderr[-2000:]
    stages = [
        "work directory",
        "reference run (fault-free, dp, 2 ranks, 2 iterations) started",
        "reference run finished in",
        "faulted run started: kill rank 0 at update.optimizer@1#1, 2 page(s) lost per group",
        "generation 0: rank 0 exited with -9",
        "generation 1: L2 shadows promoted",
        "verdict: EXACT",
        f"removed {tmp}/faultkit-",
    ]
    at = [r.stderr.find(s) for s in stages]
    assert -1 not in at and at == sorted(at), dict(zip(stages, at, strict=True))
    assert "(removed)" in r.stdout, "the table says the work directory is gone"
    assert not _leftovers(tmp), _leftovers(tmp)


def test_faultkit_stopped_by_sigterm_stops_its_job_and_removes_its_work_directory(tmp_path):
    tmp = tmp_path / "tmp"
    cmd = [sys.executable, "-m", "faultkit.cli", "inject", "--iterations", "100000"]
    p = subprocess.Popen(
        cmd, env=_env(tmp), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        seen = []
        while not any("reference run (fault-free" in x for x in seen):
            line = p.stderr.readline()
            assert line, f"faultkit ended early: {''.join(seen)}"
            seen.append(line)
        work = Path(re.search(r"work directory (\S+)", "".join(seen)).group(1))
        # The reference job's state managers are up: something to clean up.
        _wait_for(
            "the reference job's pools",
            lambda: list(work.glob("reference/logs/node0.pools.json")),
            90,
        )
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert took < 60, f"faultkit took {took:.1f} s to stop"
    assert f"removed {work}" in err, err[-2000:]
    assert not work.exists() and not _leftovers(tmp), _leftovers(tmp)
    assert not _processes_under(work), "a process of the job outlived faultkit"
