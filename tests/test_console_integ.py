"""What ``leto run`` and ``faultkit`` say and leave behind when a job is stopped, fails,
or runs: SIGTERM is one line on the console and "SIGTERM" in the record, with every
trainer fenced and nothing left in the temporary directory; an error before
``leto.init()`` shows its traceback's tail; ``leto pool status`` finds a running job's
pools from its log directory; faultkit prints its stages as they happen and removes its
work directory, also when it is stopped.

Each test starts real jobs (integ). Every temporary directory goes under the test's own
``TMPDIR``, so "nothing left" is checked there, not in a /tmp other jobs share.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leto.cli import main as leto_main
from leto.job.config import DEFAULT_SHADOW_LEVEL
from leto.job.store import free_port
from leto.proc import alive

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


def test_sigterm_fences_every_trainer_records_it_and_leaves_nothing(tmp_path, capsys):
    tmp, logs = tmp_path / "tmp", tmp_path / "logs"
    cmd = [
        sys.executable, "-m", "leto.cli", "run", "--device", "cpu", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "--log-dir", str(logs), str(EXAMPLE),
        "--iterations", "100000",
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, env=_env(tmp), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pools = _wait_for(
            "the job's pools file", lambda: next(logs.glob("node0.pools.json"), None), 60
        )
        sm_pids = [r["state_manager_pid"] for r in json.loads(pools.read_text())["ranks"].values()]

        def training() -> dict | None:
            # leto pool status finds the pool from --log-dir alone; a retained model
            # means rank 1's trainer is past its set-up.
            if leto_main(["pool", "status", "--log-dir", str(logs), "--rank", "1", "--json"]) != 0:
                capsys.readouterr()
                return None
            status = json.loads(capsys.readouterr().out)
            return status if status["allocations"] else None

        status = _wait_for("rank 1's retained model", training, 90)
        trainer = status["owner_pid"]
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-2000:])
    assert took < 30, f"leto run took {took:.1f} s to stop"
    assert "leto run: stopped by SIGTERM; 2 trainer(s) fenced" in err, err[-2000:]
    record = json.loads((logs / "node0.recovery.json").read_text())
    assert record["stopped"] == "SIGTERM" and record["fenced"] == [0, 1], record["stopped"]
    crashes = sorted(x.name for x in logs.glob("*.error.json"))
    assert not crashes, f"fenced trainers recorded as crashes: {crashes}"
    assert not (logs / "node0.pools.json").exists(), "the pools' tokens outlived the job"
    assert not _leftovers(tmp), _leftovers(tmp)
    left = [pid for pid in [*sm_pids, trainer] if alive(pid)]
    assert not left, f"processes still running after SIGTERM: {left}"


def test_an_error_before_leto_init_shows_the_end_of_its_log(tmp_path):
    script = tmp_path / "no_data.py"
    script.write_text(
        "def load(path):\n"
        "    raise FileNotFoundError(f'no data at {path}')\n"
        "\n"
        "load('/data/shard0')\n"
        "import leto  # never reached\n"
    )
    cmd = [
        sys.executable, "-m", "leto.cli", "run", "--device", "cpu", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "--log-dir", str(tmp_path / "logs"), str(script),
    ]  # fmt: skip
    r = subprocess.run(
        cmd, env=_env(tmp_path / "tmp"), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, r.stderr[-2000:]
    line = re.search(r"leto run: the job stopped \(exit code 1\): (.*)", r.stderr)
    assert line, r.stderr[-2000:]
    assert re.match(
        r"rank \d exited with code 1 before it began training \(generation 0; "
        r"FileNotFoundError: no data at /data/shard0\)",
        line.group(1),
    ), line.group(1)
    # The traceback's tail, from the rank's log (there is no error file before init).
    assert "raise FileNotFoundError(f'no data at {path}')" in r.stderr, r.stderr[-2000:]
    assert "no traceback" not in r.stderr
    # A stopped job with no recoveries prints no table and no "0 failure(s)".
    assert "failure(s)" not in r.stdout and "┏" not in r.stdout, r.stdout
    record = json.loads((tmp_path / "logs" / "node0.recovery.json").read_text())
    assert "no data at /data/shard0" in record["stopped"], record["stopped"]


def test_a_script_that_never_reaches_leto_run_is_told_nothing_was_protected(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('trained without Leto')\n")
    cmd = [
        sys.executable, "-m", "leto.cli", "run", "--device", "cpu", "--nproc-per-node", "1",
        "--master-port", str(free_port()), "--log-dir", str(tmp_path / "logs"), str(script),
    ]  # fmt: skip
    r = subprocess.run(
        cmd, env=_env(tmp_path / "tmp"), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trained without Leto" in r.stdout, r.stdout
    assert "rank(s) 0 never reached leto.Run: nothing of their training was retained" in r.stderr, (
        r.stderr[-2000:]
    )


@pytest.fixture(scope="module")
def inject_cli(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``faultkit inject`` as a user runs it (its table on stdout, its stages on
    stderr): one run of the CLI that the two tests below read; and its TMPDIR."""
    work = tmp_path_factory.mktemp("inject_cli")
    tmp = work / "tmp"
    cmd = [sys.executable, "-m", "faultkit.cli", "inject", "--iterations", "2", "--pages", "2"]
    r = subprocess.run(cmd, env=_env(tmp), cwd=work, capture_output=True, text=True, timeout=280)
    return r, tmp


def test_faultkit_inject_table_names_the_verdict(inject_cli):
    r, _ = inject_cli
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "EXACT" in r.stdout and "first divergence" in r.stdout, r.stdout


def test_faultkit_inject_prints_its_stages_and_removes_its_work_directory(inject_cli):
    r, tmp = inject_cli
    assert r.returncode == 0 and "EXACT" in r.stdout, r.stdout + r.stderr[-2000:]
    stages = [
        "work directory",
        "reference run (fault-free, dp, 2 ranks, 2 iterations) started",
        "reference run finished in",
        "faulted run started: kill rank 0 at update.optimizer@1#1, 2 page(s) lost per group",
        "generation 0: rank 0 exited with -9",
        f"generation 1: {DEFAULT_SHADOW_LEVEL} shadows promoted",
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
