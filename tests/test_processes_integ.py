"""Trainers run the torch-elastic way: each in its own session, fenced by killing its
whole process group, so nothing a trainer started outlives it; ``leto run`` stopped by
SIGTERM stops every trainer, shadow and state manager before it exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from leto.job.store import free_port
from leto.proc import alive

pytestmark = pytest.mark.timeout(180)
SCRIPT = Path(__file__).resolve().parent / "scripts" / "spawn_child.py"
_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_what_a_test_left_running():
    # A test that fails mid-way leaves its ``leto run`` behind; stopping it here keeps
    # its trainers and its unread pipe from leaking into the next test's warnings.
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def _leto_run(
    tmp_path: Path, env: dict, script: Path = SCRIPT, stderr=None, nproc: int = 2, extra=()
) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "leto.cli", "run", "--json", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), "--shadow-level", "off", "--timeout-s", "60",
        "--log-dir", str(tmp_path / "logs"), *extra, str(script), str(tmp_path),
    ]  # fmt: skip
    env = dict(os.environ, **env, LETO_PLUGINS="faultkit.hooks")
    p = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    _STARTED.append(p)
    return p


@pytest.mark.integ
@pytest.mark.parametrize("when", ["startup", "always", "unused"])
def test_a_script_error_stops_the_job_instead_of_recovering(tmp_path, when):
    # A start-up error (here leto.Run refusing ranks that start from different weights;
    # argparse's exit code 2 likewise) stops the job at once; an exception in training is recovered once, with its
    # traceback in the failure record, and stops the job when it comes back at the
    # same place (not 100 restarts).
    p = _leto_run(tmp_path, {"LETO_TEST_RAISE": when}, SCRIPT.parent / "raise_once.py",
                  stderr=subprocess.PIPE)  # fmt: skip
    t0 = time.monotonic()
    out, err = p.communicate(timeout=150)
    assert p.returncode == 1, err[-2000:]
    assert time.monotonic() - t0 < 60, "the job did not stop promptly"
    summary = json.loads(out.strip().splitlines()[-1])
    why = summary["stopped"]
    if when == "startup":
        assert summary["recoveries"] == [] and "before it began training" in why, summary
        assert "parameter weight differs between rank 0 and rank 1" in err, err[-2000:]
        return
    if when == "unused":
        # Both ranks raise in iteration 0's step, in every generation.
        assert "raised InvalidInput again at the same place" in why, why
        assert "parameter(s) idle.bias, idle.weight received no gradient" in err, err[-2000:]
        return
    (rec,) = summary["recoveries"]
    assert rec["failed_ranks"] == [1] and "raised ValueError again at the same place" in why
    # The recovery it got first is counted as what it turned out to be.
    assert rec["cause"].startswith("a script error (ValueError), raised again"), rec

    error = rec["failures"]["1"]["error"]
    assert error["exception"] == "ValueError" and "(4, 5) was expected" in error["message"]
    assert "raise_once.py" in error["traceback"] and Path(error["file"]).is_file(), error
    # The console shows the traceback's tail and where the rest is.
    assert "ValueError: a batch of shape" in err and error["file"] in err, err[-2000:]
    assert 'raise ValueError("a batch of shape' in err and "logs in" in err, err[-2000:]


@pytest.mark.integ
def test_a_scripts_own_exit_code_is_its_verdict(tmp_path):
    # sys.exit(3) in training: not a hardware failure, not retried; leto run exits 3, as
    # torchrun returns a child's code, and says which rank exited how.
    p = _leto_run(tmp_path, {"LETO_TEST_RAISE": "exit"}, SCRIPT.parent / "raise_once.py",
                  stderr=subprocess.PIPE)  # fmt: skip
    out, err = p.communicate(timeout=150)
    assert p.returncode == 3, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["recoveries"] == [], summary["recoveries"]
    assert "rank 1 exited with code 3 in generation 0 (the script's own exit" in summary["stopped"]
    assert "stopping: the data ran out" in err, err[-2000:]  # the log's tail on the console


@pytest.mark.integ
def test_a_fatal_failure_that_repeats_falls_back_a_tier_then_stops_the_job(tmp_path):
    # The same fatal failure at the same place after every fallback (a persistent
    # fault): the first falls back to the newest checkpoint, the second to an older one,
    # the third stops the job with the chain — not max-failures restarts.
    p = _leto_run(tmp_path, {"LETO_TEST_RAISE": "fatal"}, SCRIPT.parent / "raise_once.py",
                  stderr=subprocess.PIPE, extra=("--checkpoint-interval", "1"))  # fmt: skip
    out, err = p.communicate(timeout=150)
    assert p.returncode == 13, err[-2000:]  # EXIT_FATAL
    summary = json.loads(out.strip().splitlines()[-1])
    recs = summary["recoveries"]
    assert [r["class"] for r in recs] == ["FF", "FF"], recs
    assert "older_checkpoints" not in recs[0] and recs[1]["older_checkpoints"] == 1, recs
    assert recs[1]["repeats"] == [0], recs
    why = summary["stopped"]
    assert "the same as in generations 0, 1" in why and "stuck bit" in why, why
    assert "falling back to an older checkpoint" in err, err[-2000:]


def _children(tmp_path: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in tmp_path.glob("child-*")}


@pytest.mark.integ
def test_a_fenced_or_killed_trainer_leaves_no_child_behind(tmp_path):
    plan = [{"generation": 0, "rank": 1, "at": "compute.forward@0#1"}]
    p = _leto_run(tmp_path, {"LETO_FAULT_PLAN": json.dumps(plan)})
    out, _ = p.communicate(timeout=150)
    assert p.returncode == 0, out[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["failures"] == 1, summary
    kids = _children(tmp_path)
    assert {"child-g0-r0", "child-g0-r1", "child-g1-r0", "child-g1-r1"} <= set(kids), kids
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in kids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {k: pid for k, pid in kids.items() if alive(pid)}
    assert not left, f"children outlived their trainers: {left}"


@pytest.mark.integ
def test_sigterm_stops_every_process_of_the_job(tmp_path):
    p = _leto_run(tmp_path, {"LETO_TEST_HOLD": "1"})
    deadline = time.monotonic() + 60
    while len(_children(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    kids = _children(tmp_path)
    assert len(kids) == 2, f"the trainers did not start within 60 s: {kids}"
    ours = _job_pids(tmp_path)
    assert len(ours) >= 4, f"expected 2 trainers and 2 state managers, found {ours}"
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode != 0, "leto run stopped by SIGTERM must not report success"
    deadline = time.monotonic() + 5
    left = {}
    while time.monotonic() < deadline:
        left = {pid: what for pid, what in ours.items() if alive(pid)}
        left.update({pid: k for k, pid in kids.items() if alive(pid)})
        if not left:
            break
        time.sleep(0.05)
    assert not left, f"processes left after SIGTERM: {left}"


def _job_pids(tmp_path: Path) -> dict[int, str]:
    """Trainers and state managers of this test's job (by command line and cwd)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if str(SCRIPT) in cmd and str(tmp_path) in cmd and "leto.cli" not in cmd:
            found[int(d.name)] = "trainer"
        elif "leto.memory.state_manager" in cmd and cwd.startswith(str(tmp_path)):
            found[int(d.name)] = "state manager"
    return found


def test_the_counting_store_counts_every_request_and_nothing_else():
    import torch.distributed as dist

    from leto.job.store import CountingStore

    s = CountingStore(dist.HashStore())
    s.set("a", "1")
    s.add("n", 2)
    assert s.check(["a"]) and s.get("a") == b"1"
    s.timeout  # an attribute, not a request  # noqa: B018
    assert s.requests == 4, s.requests
    assert s.rate() > 0


def test_the_trainer_environment_is_read_once_with_clear_errors():
    from leto.job.config import TrainerEnv

    with pytest.raises(ValueError, match="must run under `leto run`"):
        TrainerEnv.from_environ({})
    with pytest.raises(ValueError, match="lacks RANK"):
        TrainerEnv.from_environ({"LETO_ROLE": "active"})
    env = TrainerEnv.from_environ(
        {
            "LETO_ROLE": "shadow",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LETO_GENERATION": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "LETO_POOL_SOCKET": "/tmp/s",
            "LETO_POOL_TOKEN": "t",
            "LETO_PROMOTE_FD": "7",
            "LETO_CHECKPOINT_INTERVAL": "5",
        }  # fmt: skip
    )
    assert (env.rank, env.generation, env.promote_fd, env.checkpoint_interval) == (1, 3, 7, 5)
    with pytest.raises(AttributeError):
        env.rank = 0  # frozen


def test_a_fault_plan_meeting_a_pool_with_nothing_attached_does_not_crash_the_agent():
    # A trainer that died before it attached its state leaves an empty pool: the plan's
    # page loss is refused and reported, the agent goes on (it crashed here before).
    from types import SimpleNamespace

    import faultkit.hooks  # noqa: F401 - registers the page-loss plugin, as leto run loads it
    from leto.launch.recovery import Recovery
    from leto.memory.launch import start_state_manager
    from tests.pool_helpers import small_config

    sm = start_state_manager(small_config())
    try:
        plan = [
            {"generation": 0, "rank": 0, "at": "update.optimizer@1#1", "lose_pages": 2,
             "inject": [["data", "grad", [1]]]}
        ]  # fmt: skip
        cells = [SimpleNamespace(rank=0, sm=sm)]
        lost = Recovery(None, cells, None, None, plan).lose(0)
    finally:
        sm.stop()
    assert lost["device"] == 0 and len(lost["refused"]) == 1, lost
    assert "grad" in lost["refused"][0] or "allocation" in lost["refused"][0], lost


@pytest.mark.integ
def test_a_script_resumes_from_its_own_torch_checkpoint_bit_identically(tmp_path):
    # The script's own resume (nanoGPT-style): model, optimizer and scheduler states
    # loaded before leto.Run, start_iteration= where they ended; the run then equals
    # the same script in plain PyTorch, bytes and optimizer state_dict.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import own_loop as job
    finally:
        sys.path.pop(0)
    model, opt, sched = job.build()
    for t in range(job.ITERS):
        if t == 2:
            ckpt = tmp_path / "ckpt.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "iteration": 2}, ckpt)  # fmt: skip
        # Iterations 0-1 on other data: a run that ignored the checkpoint would differ.
        job.one(model, opt, sched, t + 1000 if t < 2 else t)
    env = {"LETO_TEST_CKPT": str(ckpt)}
    p = _leto_run(tmp_path, env, SCRIPT.parent / "own_loop.py", nproc=1)
    out, _ = p.communicate(timeout=150)
    assert p.returncode == 0, out[-2000:]
    got = torch.load(tmp_path / "rank0.final.pt")
    assert got["iterations"] == job.ITERS - 2  # run.state starts empty on a fresh pool
    for n, v in model.named_parameters():
        assert torch.equal(got["params"][n].view(torch.uint8), v.detach().view(torch.uint8)), n
    want = opt.state_dict()
    assert got["optimizer"]["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            g = got["optimizer"]["state"][i][k]
            assert torch.equal(g.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    # The same resume without start_iteration= is refused at start-up, naming it (the
    # loop would restart at 0 with step-2 optimizer state).
    again = tmp_path / "forgot"
    again.mkdir()
    env = {"LETO_TEST_CKPT": str(ckpt), "LETO_TEST_FORGET_START": "1"}
    p = _leto_run(again, env, SCRIPT.parent / "own_loop.py", stderr=subprocess.PIPE, nproc=1)
    out, err = p.communicate(timeout=150)
    assert p.returncode != 0, out[-2000:]
    assert "pass start_iteration=" in err, err[-2000:]


@pytest.mark.integ
def test_a_compiled_model_trains_and_recovers_exactly(tmp_path):
    # torch.compile (dynamo + AOTAutograd) under leto.Run, with an eval pass at the top
    # of every iteration, killed in the middle of iteration 2's update and restarted cold
    # (it compiles again: the hang timeout spares a generation's first iteration): the
    # same bytes as the compiled script in plain PyTorch, and run.state retained.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import own_loop as job
    finally:
        sys.path.pop(0)
    model, opt, sched = job.build(compiled=True)
    for t in range(job.ITERS):
        job.one(model, opt, sched, t)
    plan = [{"generation": 0, "rank": 0, "at": "update.optimizer@2#1"}]
    env = {"LETO_TEST_COMPILE": "1", "LETO_FAULT_PLAN": json.dumps(plan)}
    p = _leto_run(tmp_path, env, SCRIPT.parent / "own_loop.py", nproc=1)
    out, _ = p.communicate(timeout=150)
    assert p.returncode == 0, out[-2000:]
    assert len(json.loads(out.strip().splitlines()[-1])["recoveries"]) == 1
    got = torch.load(tmp_path / "rank0.final.pt")
    # run.state came back with the loop: the restarted process counted on from 3.
    assert got["iterations"] == job.ITERS, got["iterations"]
    for n, v in model.named_parameters():
        assert torch.equal(got["params"][n].view(torch.uint8), v.detach().view(torch.uint8)), n


@pytest.mark.integ
def test_without_checkpoints_a_fatal_failure_restarts_from_the_first_iteration(tmp_path):
    # --no-checkpoints (benchmarks at sizes whose checkpoints outgrow the disk): nothing
    # is saved, the fallback restarts every rank from iteration 0, and the same fatal
    # failure again stops the job — there is no older tier to try.
    p = _leto_run(tmp_path, {"LETO_TEST_RAISE": "fatal"}, SCRIPT.parent / "raise_once.py",
                  stderr=subprocess.PIPE, extra=("--no-checkpoints",))  # fmt: skip
    out, err = p.communicate(timeout=150)
    assert p.returncode == 13, err[-2000:]  # EXIT_FATAL
    summary = json.loads(out.strip().splitlines()[-1])
    (rec,) = summary["recoveries"]
    assert rec["class"] == "FF", rec
    assert {t["next_iteration"] for t in rec["trainers"].values()} == {0}, rec
    assert "a restart from the first iteration was tried" in summary["stopped"], summary
    assert "falling back to the first iteration (--no-checkpoints)" in err, err[-2000:]
    assert not (tmp_path / "logs" / "checkpoints").exists()


@pytest.mark.integ
def test_leto_run_m_runs_a_module_as_python_m_does(tmp_path):
    # leto run -m pkg.job: each trainer runs the module as __main__, its file as argv[0],
    # the working directory first on sys.path (what torchrun -m does); a module that is
    # not there stops nothing but leto run, before any process starts.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "job.py").write_text(
        "import sys\nprint('ran', __name__, sys.argv[1:], sys.argv[0], sys.path[0])\nsys.exit(7)\n"
    )
    p = _leto_run(tmp_path, {}, "pkg.job", stderr=subprocess.PIPE, nproc=1, extra=("-m",))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 7, err[-2000:]  # the module's own exit code
    log = (tmp_path / "logs" / "rank0.gen0.active.log").read_text()
    job = tmp_path / "pkg" / "job.py"
    assert f"ran __main__ ['{tmp_path}'] {job} {tmp_path}" in log, log[-2000:]
    bad = subprocess.run(
        [sys.executable, "-m", "leto.cli", "run", "-m", "pkg.not_there"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "module pkg.not_there cannot be found" in bad.stderr, bad.stderr
    assert not (tmp_path / "leto-run").exists()  # nothing started


def test_ranks_per_gpu_places_local_ranks_on_shared_gpus_over_gloo():
    # leto run --ranks-per-gpu 2 (testing with fewer GPUs than ranks): local ranks 0 and 1
    # train on GPU 0 and keep their pools there, 2 and 3 on GPU 1, over gloo (NCCL refuses
    # two ranks on one GPU); 1 is the usual one GPU a rank over NCCL. On a GPU machine:
    # bash bench/gpu_suite.sh world2-shared.
    import types

    from leto.job.config import RunConfig, TrainerEnv
    from leto.launch.agent import Agent
    from leto.trainer.api import placement

    got = [placement("cuda", r, 2, 2) for r in range(4)]
    assert [(str(d), b) for d, b in got] == [
        ("cuda:0", "gloo"), ("cuda:0", "gloo"), ("cuda:1", "gloo"), ("cuda:1", "gloo")
    ]  # fmt: skip
    assert [str(placement("cuda", r, 1, 4)[0]) for r in range(4)] == [f"cuda:{r}" for r in range(4)]
    assert placement("cuda", 1, 1, 4)[1] == "nccl"
    assert placement("cpu", 1, 1, 0) == (torch.device("cpu"), "gloo")
    cfg = RunConfig(device="cuda", nproc_per_node=4, ranks_per_gpu=2)
    pools = [Agent._pool(types.SimpleNamespace(cfg=cfg), lr).device for lr in range(4)]
    assert pools == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"], pools
    with pytest.raises(ValueError, match="needs --device cuda"):
        RunConfig(device="cpu", ranks_per_gpu=2)
    with pytest.raises(ValueError, match="at least 1"):
        RunConfig(device="cuda", ranks_per_gpu=0)
    base = {"LETO_ROLE": "active", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "LETO_GENERATION": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1",
            "LETO_POOL_SOCKET": "/tmp/s", "LETO_POOL_TOKEN": "t"}  # fmt: skip
    assert TrainerEnv.from_environ(base).ranks_per_gpu == 1
    assert TrainerEnv.from_environ({**base, "LETO_RANKS_PER_GPU": "2"}).ranks_per_gpu == 2
