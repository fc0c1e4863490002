"""Bad command-line input is refused before anything runs, naming the argument and what
it may be; the consoles' tables fit 80 columns; the fig14 PNG is readable.

Quick: nothing here starts a job. The CLIs run in this process (torch is imported
already), so each refusal's time is the check's own; each must come in under 5 s
(issue 36: ``faultkit inject --pages -1`` ran 55 s before it failed). The runs that
start jobs (SIGTERM, the console of a failed job, faultkit's progress and clean-up)
are in test_console_integ.py.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from faultkit.cli import main as faultkit_main
from leto.cli import main as leto_main
from verifiers.cli import main as verifiers_main

LIMIT_S = 5.0


@pytest.fixture
def no_temp_leftovers(tmp_path, monkeypatch):
    """Every temporary directory goes under tmp_path/tmp; the test checks it is empty."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def refused(main, argv, capsys) -> str:
    """Run a CLI in this process; it must refuse with exit 2 in under LIMIT_S; stderr."""
    t0 = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2, f"{argv}: exit {code}, stderr {err!r}"
    assert took < LIMIT_S, f"{argv}: refused only after {took:.1f} s"
    return err


INJECT_REFUSALS = [
    (["--pages", "-1"], "--pages -1: must be in 0..64 (pages per protection group"),
    (["--pages", "65"], "--pages 65: must be in 0..64"),
    (["--iterations", "0"], "--iterations 0: must be 1 or more"),
    (["--world-size", "0"], "--world-size 0: must be 1 or more"),
    (["--rank", "2"], "--rank 2: must be in 0..1"),
    (["--rank", "-1"], "--rank -1: must be in 0..1"),
    (["--host-parity-pages", "17"], "--host-parity-pages 17: must be in 0..16"),
    (["--host-parity-pages", "-2"], "--host-parity-pages -2: must be in 0..16"),
    (["--every", "-1"], "--every -1: expected 0 (one fault, mid-run) or 1..5"),
    (["--mode", "kernel-abort", "--abort-after-blocks", "0"], "--abort-after-blocks 0: must be 1"),
    (["--mode", "corrupt-parity", "--pages", "17"], "--pages 17: must be in 0..16"),
    (["--shadow-level", "L9"], "--shadow-level 'L9': choose one of off, L1, L2, L3 or auto"),
    (["--parallel", "ddp"], "--parallel 'ddp': choose one of dp, fsdp"),
    (["--mode", "boom"], "--mode 'boom': choose one of kill"),
    (["--phase", "nowhere"], "--phase 'nowhere': choose one of"),
]


@pytest.mark.parametrize(
    ("argv", "says"), INJECT_REFUSALS, ids=[" ".join(a) for a, _ in INJECT_REFUSALS]
)
def test_faultkit_inject_refuses_a_bad_argument_before_anything_runs(
    argv, says, capsys, no_temp_leftovers
):
    err = refused(faultkit_main, ["inject", *argv], capsys)
    assert f"faultkit inject: {says}" in err, err
    assert not any(no_temp_leftovers.iterdir()), "a refused run made a work directory"


def test_world_size_zero_is_blamed_on_world_size_not_rank(capsys):
    err = refused(faultkit_main, ["inject", "--world-size", "0"], capsys)
    assert "--world-size" in err and "--rank" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_faultkit_refuses_cuda_on_a_machine_without_one(capsys):
    err = refused(faultkit_main, ["inject", "--device", "cuda"], capsys)
    assert "--device cuda: torch sees no CUDA device" in err, err


def test_a_refusal_under_json_is_a_json_object(capsys):
    code = faultkit_main(["inject", "--pages", "-1", "--json"])
    v = json.loads(capsys.readouterr().out)
    assert code == 2 and v["refused"] and "--pages -1" in v["error"], v


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--world-size", "0"], "--world-size 0: must be 1 or more"),
        (["--iterations", "0"], "--iterations 0: must be 1 or more"),
        (["--phases", "update,nowhere"], "--phases: 'nowhere' is not one of"),
        (["--modes", "kill,boom"], "--modes: 'boom' is not one of"),
    ],
)
def test_faultkit_matrix_refuses_before_its_reference_run(argv, says, capsys, no_temp_leftovers):
    err = refused(faultkit_main, ["matrix", *argv], capsys)
    assert f"faultkit matrix: {says}" in err, err
    assert not any(no_temp_leftovers.iterdir())


def _schedule(tmp_path: Path, **kw) -> str:
    from leto.sim.schedule import every

    path = tmp_path / "plan.json"
    path.write_text(every(interval_s=10.0, duration_s=30.0, world_size=2, **kw).to_json())
    return str(path)


def test_faultkit_run_plan_checks_every_failure_before_its_reference_run(
    tmp_path, capsys, no_temp_leftovers
):
    bad = _schedule(tmp_path, mode="copy-corrupt", phase="update")
    err = refused(faultkit_main, ["run-plan", bad, "--iteration-s", "5"], capsys)
    assert "the schedule's failure at 10.0 s: --mode copy-corrupt needs a phase" in err, err
    ok = _schedule(tmp_path)
    err = refused(faultkit_main, ["run-plan", ok, "--iteration-s", "0"], capsys)
    assert "--iteration-s 0.0: expected a finite time > 0 s" in err, err
    err = refused(
        faultkit_main, ["run-plan", ok, "--iteration-s", "5", "--world-size", "3"], capsys
    )
    assert "--world-size is 3: give --world-size 2" in err, err
    err = refused(
        faultkit_main, ["run-plan", ok, "--iteration-s", "5", "--iterations", "0"], capsys
    )
    assert "--iterations 0: must be 1 or more" in err, err
    assert not any(no_temp_leftovers.iterdir())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--world-size", "0"],
            "faultkit plan: --world-size: world_size=0: expected an integer >= 1",
        ),
        (["--world-size", "2", "--interval-s", "0"], "faultkit plan: --interval-s: interval_s=0.0"),
        (
            ["--world-size", "2", "--hof-ratio", "1.5"],
            "faultkit plan: --hof-ratio: hof_ratio=1.5: expected a fraction in [0, 1]",
        ),
        (
            ["--world-size", "2", "--mode", "copy-corrupt", "--phase", "update"],
            "--mode copy-corrupt needs a phase that copies parity",
        ),
        (["--world-size", "2", "--mode", "boom"], "faultkit plan: --mode: failure: mode='boom'"),
    ],
)
def test_faultkit_plan_names_the_flag(argv, says, capsys):
    base = ["--interval-s", "60", "--duration-s", "600"]
    err = refused(faultkit_main, ["plan", "every", *base, *argv], capsys)
    assert says in err, err


def test_an_interrupted_job_gets_sigterm_not_sigkill(tmp_path):
    """faultkit stopped (a timeout, SIGTERM, Ctrl-C) while a job runs: its leto run agent
    gets SIGTERM and time to stop what it started (SIGKILLed, it left trainers, state
    managers and their /tmp directories behind)."""
    from faultkit.job import finish_job

    said = tmp_path / "said"
    child = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda s, f: (open({str(said)!r}, 'w').write('TERM'), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    log = open(tmp_path / "agent.log", "w")  # noqa: SIM115 - finish_job closes it
    p = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=log, text=True
    )
    p.log = log
    assert p.stdout.readline().strip() == "ready"
    with pytest.raises(subprocess.TimeoutExpired):
        finish_job([p], timeout_s=0.5)
    assert p.returncode == 0 and said.read_text() == "TERM", p.returncode


def test_faultkit_workdir_is_removed_unless_kept(tmp_path, no_temp_leftovers):
    from argparse import Namespace

    from faultkit.cli_common import keep_if_not_exact as _keep_if_not_exact
    from faultkit.cli_common import workdir as _workdir

    lines: list[str] = []
    with _workdir(Namespace(workdir=None, keep=False), lines.append) as (work, _):
        (work / "reference" / "train").mkdir(parents=True)
    assert not work.exists() and "removed" in lines[-1], lines
    with _workdir(Namespace(workdir=None, keep=True), lines.append) as (kept, _):
        (kept / "reference" / "train").mkdir(parents=True)
    assert kept.is_dir() and "kept" in lines[-1] and "reference/train" in lines[-1], lines
    with _workdir(Namespace(workdir=None, keep=False), lines.append) as (bad, keep):
        (bad / "reference" / "train").mkdir(parents=True)
        _keep_if_not_exact(keep, exact=False)
    assert bad.is_dir() and "not EXACT" in lines[-1], lines
    mine = tmp_path / "mine"
    with _workdir(Namespace(workdir=str(mine), keep=False), lines.append) as (work, _):
        (work / "x").mkdir()
    assert mine.is_dir(), "a --workdir the user named was removed"
    with pytest.raises(SystemExit):  # SIGTERM's handler raises SystemExit
        with _workdir(Namespace(workdir=None, keep=False), lines.append) as (gone, _):
            (gone / "run").mkdir()
            raise SystemExit(128 + signal.SIGTERM)
    assert not gone.exists(), "SIGTERM left the temporary work directory"


def test_verifiers_compare_names_the_missing_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = refused(verifiers_main, ["compare", str(tmp_path / "empty"), "/nonexistent"], capsys)
    assert "RUN directory /nonexistent does not exist" in err, err
    err = refused(verifiers_main, ["compare", "/nonexistent", str(tmp_path / "empty")], capsys)
    assert "REF directory /nonexistent does not exist" in err, err


def test_verifiers_compare_points_below_a_faultkit_work_directory(tmp_path, capsys):
    from verifiers import Recorder

    work = tmp_path / "faultkit-x"
    for run in ("reference", "faulted-update-kill-p0-h0"):
        with Recorder(work / run / "train", 0) as r:
            r.record(0, 1.0, {"w": torch.zeros(2)})
    err = refused(verifiers_main, ["compare", str(work), str(work / "reference" / "train")], capsys)
    assert f"REF {work} holds no rank<N>.trace.jsonl" in err, err
    assert "faulted-update-kill-p0-h0/train, reference/train" in err, err
    assert f"pass e.g. {work / 'reference' / 'train'}" in err, err
    (tmp_path / "nothing").mkdir()
    err = refused(
        verifiers_main,
        ["compare", str(work / "reference" / "train"), str(tmp_path / "nothing")],
        capsys,
    )
    assert "RUN" in err and "reference/train or <faulted run>/train" in err, err


def test_leto_run_on_a_busy_port_says_which_flag(tmp_path, capsys):
    script = tmp_path / "never_started.py"
    script.write_text("raise SystemExit('the script ran')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = refused(
            leto_main,
            ["run", "--device", "cpu", "--master-port", str(port), "--log-dir",
             str(tmp_path / "logs"), str(script)],
            capsys,
        )  # fmt: skip
    line = f"leto run: port {port} on 127.0.0.1 is in use (another job?); pass --master-port PORT"
    assert line in err and "Traceback" not in err, err
    assert signal.getsignal(signal.SIGTERM) is not None  # leto run put the handlers back


def test_leto_pool_status_without_a_running_job_says_what_to_give(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LETO_POOL_DIR", raising=False)
    monkeypatch.delenv("LETO_POOL_TOKEN", raising=False)
    err = refused(leto_main, ["pool", "status"], capsys)
    assert "give --log-dir DIR, the --log-dir of a running leto run job" in err, err
    err = refused(leto_main, ["pool", "status", "--log-dir", str(tmp_path)], capsys)
    assert f"{tmp_path} holds no node*.pools.json" in err, err
    (tmp_path / "node0.pools.json").write_text(json.dumps({"node": 0, "ranks": {"0": {}}}))
    err = refused(leto_main, ["pool", "status", "--log-dir", str(tmp_path), "--rank", "3"], capsys)
    assert "--rank 3: the job in" in err and "has ranks 0" in err, err


def test_a_failure_without_an_error_file_shows_the_end_of_its_log(tmp_path):
    """An exception before leto.init() writes no error file (the hook is installed
    there): the console used to say only "no traceback ... its log has the rest"."""
    from leto.launch.monitor import Failure, FailureKind

    log = tmp_path / "rank0.gen0.active.log"
    lines = ["warming up"] + [f"  frame {i}" for i in range(12)] + ["OSError: no data at /x"]
    log.write_text("\n".join(lines) + "\n\n")
    f = Failure(0, FailureKind.EXIT, 1, None, str(log))
    assert f.traceback_tail().splitlines() == lines[-10:]
    assert f.first_error_line() == "OSError: no data at /x"
    assert (
        "wrote nothing"
        in Failure(0, FailureKind.EXIT, 1, None, str(tmp_path / "no")).traceback_tail()
    )


SIM = [
    ["scenarios"],
    ["sweep-interval"],
    ["sweep-hof"],
    ["h1"],
]


@pytest.mark.parametrize("argv", SIM, ids=[a[0] for a in SIM])
def test_leto_sim_tables_fit_80_columns(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert leto_main(["sim", *argv]) == 0
    out = capsys.readouterr().out
    widest = max(len(line) for line in out.splitlines())
    assert "…" not in out, f"a cell was cut:\n{out}"
    assert widest <= 80, f"a line of {widest} columns:\n{out}"


def test_leto_sim_replay_fits_80_columns_and_its_json_is_json(tmp_path, capsys, monkeypatch):
    from leto.sim.schedule import poisson

    plan = tmp_path / "plan.json"
    plan.write_text(poisson(600.0, 7200.0, world_size=8, hof_ratio=1.0, seed=0).to_json())
    monkeypatch.setenv("COLUMNS", "80")
    assert leto_main(["sim", "replay", "--schedule", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(len(x) for x in out.splitlines()) <= 80, out
    assert leto_main(["sim", "replay", "--schedule", str(plan), "--json"]) == 0

    def no_nan(name):
        raise AssertionError(f"{name} in the JSON (not JSON)")

    rows = json.loads(capsys.readouterr().out, parse_constant=no_nan)
    assert rows and all("ettr" in r for r in rows)


def test_fig14_draws_every_mttf_with_labels_that_do_not_overlap(tmp_path, monkeypatch):
    from leto.sim import plots, scenarios

    mttfs = [600.0, 1800.0, 3600.0]
    rows = scenarios.scenario_grid(
        ["deepseek_v2_1k", "deepseek_v3_16k", "deepseek_v4_128k"], mttfs, [0.0, 0.5, 1.0]
    )
    drawn = {}

    def keep(fig, path):
        drawn["fig"] = fig
        fig.tight_layout()
        fig.canvas.draw()
        return Path(path)

    monkeypatch.setattr(plots, "_save", keep)
    plots.scenario_bars(rows, tmp_path / "fig14.png")
    fig = drawn["fig"]
    panels = [ax for ax in fig.axes if ax.patches]
    assert [ax.get_title(loc="left") for ax in panels] == [
        "MTTF 10 min",
        "MTTF 30 min",
        "MTTF 60 min",
    ]
    for ax in panels:
        assert len(ax.patches) == len(rows) // len(mttfs), "a bar per system and group"
    renderer = fig.canvas.get_renderer()
    bottom = panels[-1]
    labels = [t for t in bottom.get_xticklabels() if t.get_text()]
    labels += [t for t in bottom.texts if t.get_text()]  # the deployments' names
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1 :]:
            assert not ba.overlaps(bb), f"labels {a!r} and {b!r} overlap"
