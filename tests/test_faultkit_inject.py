"""``faultkit inject`` end to end on the CPU build: the README's main job.

The verdict tests call ``faultkit.inject.inject`` / ``run_plan`` (what the CLI's
``--json`` prints) against the session's shared fault-free reference; the CLI itself is
tested for its refusals here and for its table in tests/test_console_integ.py (one CLI
run that the stages test reads too). The update phase with 16 lost pages and the
parity store's copy-corrupt with lost pages are cases of the CI's faultkit matrix."""

from __future__ import annotations

import json

import pytest

from faultkit.inject import InjectConfig
from faultkit.inject import inject as inject_run

# Each case is a faulted `leto run` of the job (plus the shared reference once).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def verdict(inject_reference, tmp_path):
    """``verdict(**InjectConfig fields)``: one faulted run, compared with the session's
    fault-free reference of the same job."""

    def run(**kw) -> dict:
        cfg = InjectConfig(**kw)
        return inject_run(cfg, tmp_path, reference=inject_reference(cfg))

    return run


@pytest.mark.integ
def test_host_parity_pages_and_another_rank(verdict):
    v = verdict(phase="grad-parity", pages=3, host_parity_pages=1, rank=1)
    assert v["exact"] and v["host_pages_rebuilt"] == v["pages_lost_host"] == 2


@pytest.mark.integ
def test_sdc_update_is_detected_in_its_iteration_and_ends_exact(verdict):
    # One bit of rank 1's freshly updated parameters, before parity absorbs it: the scrub
    # cannot see it; the replica check must, after that very update, and the checkpoint
    # fallback redoes the iterations. World 2: no majority; the redo names rank 1.
    # (Shadows off: the fallback starts cold trainers from the checkpoint; no shadow is
    # promoted, so a parked one per rank would be a start-up for nothing.)
    v = verdict(mode="sdc-update", phase="update", rank=1, shadow_level="off")
    (flip,) = v["flipped"]
    it = int(flip["at"].split("@")[1].split("#")[0])
    assert v["detected"] and v["detected_at"] == it, v["fatal_detail"]
    assert v["suspects"] == [1] and v["named_rank"] == 1, v["suspects"]
    assert v["rolled_back"] is not None and v["rolled_back"] <= it, v["rolled_back"]
    assert v["exact"], v["first_divergence"]


@pytest.mark.integ
def test_sdc_update_without_the_replica_check_ends_not_exact(verdict):
    # What shows the check is what finds it: without it nothing does.
    # (Nothing recovers here: shadows off.)
    v = verdict(mode="sdc-update", phase="update", rank=1, replica_check=False, shadow_level="off")
    assert len(v["flipped"]) == 1 and not v["detected"] and v["scrub"] is None, v
    assert not v["exact"] and "'param' differs" in v["first_divergence"], v["first_divergence"]


@pytest.mark.integ
def test_sdc_grad_is_found_by_replay_named_redone_in_place_and_twice_is_faulty(verdict):
    # One bit of rank 1's local gradient before the all-reduce, every 2 iterations (a GPU
    # that computes wrong now and then): every replica then shares it, so neither the
    # replica check nor parity can see it. The job replays every 2nd iteration: rank 0's
    # recomputation of rank 1's micro-batch differs, rank 1's own third computation agrees
    # with rank 0's — rank 1 named — and the iteration is redone in place (its update
    # never ran): no checkpoint fallback, EXACT. Named twice, rank 1's device is reported
    # faulty (the agent's record; --exclude-faulty would stop the job there).
    v = verdict(mode="sdc-grad", phase="allreduce", rank=1, every=2)
    its = [int(f["at"].split("@")[1].split("#")[0]) for f in v["flipped"]]
    assert its == [2, 4], v["flipped"]
    assert v["detected"] and v["detected_by"] == "replay" and v["detected_at"] == 2, v
    assert v["named_rank"] == 1 and v["rolled_back"] == 2, v
    assert not v["fatal"] and v["recovery_s"] is not None, v["fatal_detail"]
    assert v["exact"], v["first_divergence"]
    (bad,) = v["faulty"]
    assert bad["rank"] == 1 and bad["device"] == "cpu", bad
    assert [d["iteration"] for d in bad["detections"]] == its, bad


@pytest.mark.integ
def test_sdc_activation_without_replay_ends_not_exact(verdict):
    # What shows the replay is what finds it: a flipped GEMM output, --replay-every 0.
    # (Nothing recovers here: shadows off.)
    v = verdict(mode="sdc-activation", phase="compute", rank=0, replay=False, shadow_level="off")
    assert len(v["flipped"]) == 1 and not v["detected"], v
    assert not v["exact"] and "differs" in v["first_divergence"], v["first_divergence"]


def test_bad_options_are_refused_with_a_reason(capsys):
    from faultkit.cli import main

    def refused(*args: str) -> tuple[int, str, str]:
        try:  # in-process: each refusal comes before anything runs (no torch start-up cost)
            code = main(["inject", *args])
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    code, _, err = refused("--phase", "nowhere")
    assert code == 2 and "--phase 'nowhere'" in err
    code, _, err = refused("--mode", "kernel-abort", "--phase", "sync")
    assert code == 2 and "kernel-abort needs a phase that runs one of Leto's kernels" in err
    code, _, err = refused("--mode", "copy-corrupt", "--phase", "update")
    assert code == 2 and "needs a phase that copies parity" in err
    code, _, err = refused("--every", "9", "--iterations", "6")
    assert code == 2 and "--every 9" in err
    code, _, err = refused("--mode", "sdc-update", "--phase", "sync")
    assert code == 2 and "sdc-update strikes inside the update" in err, err
    code, _, err = refused("--mode", "sdc-grad", "--phase", "update")
    assert code == 2 and "give --phase allreduce" in err, err
    code, _, err = refused("--mode", "sdc-activation", "--phase", "compute", "--world-size", "1")
    assert code == 2 and "needs --world-size 2 or more" in err, err
    code, _, err = refused("--pages", "65")
    assert code == 2 and "--pages 65" in err and "D=64" in err, err
    code, _, err = refused("--parallel", "ep", "--world-size", "3")
    assert code == 2 and "must divide 8" in err, err
    # Under --json a refusal is a JSON object too.
    code, out, _ = refused("--phase", "nowhere", "--json")
    v = json.loads(out)
    assert code == 2 and v["refused"] and "--phase 'nowhere'" in v["error"], out


def test_any_phase_draws_only_phases_the_mode_can_strike():
    from faultkit.inject import COPY_PHASES, KERNEL_PHASES, _phase

    for mode, valid in (("kernel-abort", KERNEL_PHASES), ("copy-corrupt", COPY_PHASES)):
        drawn = {_phase(InjectConfig(mode=mode, seed=s), "any") for s in range(60)}
        assert drawn <= set(valid) and len(drawn) > 1, (mode, drawn)


@pytest.mark.integ
def test_kernel_abort_of_the_parity_update_with_lost_pages_is_exact(verdict):
    """The parity-update kernel stops after 3 blocks (CPU emulation of the trip-wire),
    the rank dies with it in flight, 16 pages per group are lost: still exact."""
    v = verdict(phase="parity", mode="kernel-abort", pages=16)
    assert v["exact"] and v["pages_rebuilt"] == v["pages_lost_device"] > 32, v
    (abort,) = v["kernel_abort"]
    assert abort["partial"] and abort["after_blocks"] == 3 and abort["blocks_launched"] > 3
    assert "emulation" in abort["mechanism"]
    # The page-loss mechanism that ran is named (an emulation on these kernels).
    assert v["recoveries"] == 1 and v["recovery_s"] > 0
    assert (
        "memfd truncation" in v["poison_mechanism"]["device"]
        or "HWPOISON" in v["poison_mechanism"]["device"]
    )


def test_copy_corrupt_writes_random_bytes_over_the_destination():
    import torch

    from faultkit.hooks import _corrupt

    pages = [torch.zeros(4096, dtype=torch.uint8), torch.zeros(1024, dtype=torch.float32)]
    _corrupt(pages)
    changed = [int((p.view(torch.uint8) != 0).sum()) for p in pages]
    assert all(c > 0.9 * p.numel() * p.element_size() for c, p in zip(changed, pages, strict=True))


@pytest.mark.integ
def test_a_fault_every_two_iterations_is_exact(verdict):
    v = verdict(phase="any", every=2, pages=4)
    assert v["exact"] and v["injections"] == v["recoveries"] == 2, v
    assert len(v["points"]) == 2 and v["points"][0].endswith("@2#1"), v["points"]
    # verifiers report draws from the marks: one injection and one recovery window each
    from pathlib import Path

    from verifiers.plots import recovery_windows
    from verifiers.trace import read_run

    (faulted,) = [d for d in Path(v["workdir"]).iterdir() if d.name.startswith("faulted-")]
    windows = recovery_windows(read_run(faulted / "train"), 0)
    assert [w.iteration for w in windows] == [2, 4], windows
    assert all(w.end_s is not None and w.end_s > w.start_s for w in windows), windows


@pytest.mark.integ
def test_run_plan_replays_a_schedule_and_an_ff_ends_in_the_fatal_path(inject_reference, tmp_path):
    from faultkit.inject import run_plan
    from leto.sim.schedule import Schedule, every

    base = InjectConfig()
    ref = inject_reference(base)
    hof = every(interval_s=20.0, duration_s=50.0, world_size=2, hof_ratio=1.0, seed=3)
    # Through JSON, as `faultkit run-plan FILE` reads it.
    hof = Schedule.from_json(hof.to_json())
    v = run_plan(hof, base, 10.0, tmp_path / "hof", reference=ref)
    assert v["exact"] and v["injections"] == 2 and v["ff"] == 0, v
    ff = every(interval_s=20.0, duration_s=30.0, world_size=2, hof_ratio=0.0, seed=3)
    # An FF: more pages lost than parity covers takes the fatal path, says so, restarts
    # from the newest checkpoint (none yet: the initial state) and still ends bit-exact.
    v = run_plan(ff, base, 10.0, tmp_path / "ff", reference=ref)
    assert v["fatal"] and v["ff"] == 1 and "checkpoint fallback" in v["fatal_detail"], v
    assert v["exact"], v["first_divergence"]


def test_a_group_smaller_than_the_pages_asked_is_named():
    """On a small model the last group holds fewer pages than asked: all of it is lost
    and the loss says so (losing all 6 of 6 with H1 = 16 is not the fatal path)."""
    import random

    from faultkit.loss import lose_pages

    class Pool:
        injected: list = []

        def status(self):
            return {
                "groups": [
                    {"kind": "set", "gid": 0, "tier1": 16, "members": [["param", 0, 3], ["exp_avg", 0, 3]]},
                    {"kind": "set", "gid": 1, "tier1": 16, "members": [["param", 3, 20], ["exp_avg", 3, 20]]},
                ]
            }  # fmt: skip

        def inject_loss(self, kind, name, pages):
            self.injected.append((kind, name, tuple(pages)))

    pool = Pool()
    lost = lose_pages(pool, 17, 0, random.Random(0))
    assert lost["short"] == [[0, 6]], lost
    assert lost["device"] == 6 + 17 + 1, lost  # group 0 whole, 17 of group 1, a gradient page
    # One request an allocation a group (a page each took a driver sync and a round trip
    # on the recovery's clock), the same distinct pages as before.
    data = [(n, p) for kind, n, pages in pool.injected if kind == "data" for p in pages]
    assert len(pool.injected) == 2 + 2 + 1 and len(set(data)) == len(data) == 24, pool.injected


def test_the_ci_corrupt_cut_covers_every_phase_and_both_counts(monkeypatch, tmp_path):
    # Enumeration only: each case is recorded instead of run.
    import faultkit.inject as fi

    monkeypatch.setattr(fi, "reference_run", lambda base, work: {})
    monkeypatch.setattr(fi, "inject", lambda cfg, work, reference: cfg)
    modes = ("corrupt-data", "corrupt-parity")
    base = InjectConfig(tier1_pages=4)
    both = fi.matrix(base, tmp_path, modes=modes)
    cut = fi.matrix(base, tmp_path, modes=modes, corrupt_pages="alternate")
    key = {(c.phase, c.mode, c.pages) for c in both}
    assert len(key) == len(both) == 2 * 2 * len(fi.PHASES)
    assert {(c.phase, c.mode, c.pages) for c in cut} < key and len(cut) == len(both) // 2
    for phase in fi.PHASES:  # every phase sees 1 and H1 pages, one per mode
        assert sorted(c.pages for c in cut if c.phase == phase) == [1, 4]
    for mode in modes:  # and every mode both counts
        assert {c.pages for c in cut if c.mode == mode} == {1, 4}
    assert all(c.host_parity_pages == 0 for c in cut)
    with pytest.raises(ValueError, match="--corrupt-pages 'some'"):
        fi.matrix(base, tmp_path, modes=modes, corrupt_pages="some")


def test_a_matrix_runs_sdc_update_once_at_the_update_phase():
    import faultkit.inject as fi

    cases = fi.matrix_cases(InjectConfig(), modes=("kill", "sdc-update"), losses="alternate")
    assert [c for c in cases if c[1] == "sdc-update"] == [("update", "sdc-update", 0, 0)]


def test_the_ci_loss_cuts_run_every_phase_and_every_loss(monkeypatch, tmp_path):
    # Enumeration only, as above: the parallel jobs' CI cut (kill, --losses alternate) and
    # the example job's (--losses pairs).
    import faultkit.inject as fi

    monkeypatch.setattr(fi, "reference_run", lambda base, work: {})
    monkeypatch.setattr(fi, "inject", lambda cfg, work, reference: cfg)
    base = InjectConfig(tier1_pages=4, parallel="fsdp")
    full = fi.matrix(base, tmp_path, modes=("kill",))
    cut = fi.matrix(base, tmp_path, modes=("kill",), losses="alternate")
    key = {(c.phase, c.pages, c.host_parity_pages) for c in full}
    assert len(key) == len(full) == 4 * len(fi.PHASES)
    assert {(c.phase, c.pages, c.host_parity_pages) for c in cut} < key
    assert sorted(c.phase for c in cut) == sorted(fi.PHASES)  # every phase once
    losses = [(c.pages, c.host_parity_pages) for c in cut]
    assert {x: losses.count(x) for x in losses} == {(0, 0): 2, (4, 1): 2, (0, 1): 2, (4, 0): 2}
    assert all(c.parallel == "fsdp" for c in cut)
    # The example job's cut (--losses pairs): two losses per phase, each at half of them.
    pairs = fi.matrix(base, tmp_path, modes=("kill",), losses="pairs")
    assert len(pairs) == 2 * len(fi.PHASES)
    for phase in fi.PHASES:
        got = {(c.pages, c.host_parity_pages) for c in pairs if c.phase == phase}
        assert got in ({(0, 0), (4, 1)}, {(0, 1), (4, 0)}), (phase, got)
    losses = [(c.pages, c.host_parity_pages) for c in pairs]
    assert {x: losses.count(x) for x in losses} == {x: len(fi.PHASES) // 2 for x in set(losses)}
    assert len(set(losses)) == 4
    with pytest.raises(ValueError, match="--losses 'half'"):
        fi.matrix(base, tmp_path, modes=("kill",), losses="half")


@pytest.mark.parametrize("mode", ["kill", "kill-synced"])
def test_a_kill_mode_ends_the_process_at_the_armed_point_and_nowhere_else(mode):
    import signal
    import subprocess
    import sys

    src = (
        "from faultkit import hooks\n"
        f"hooks.arm('update.optimizer', 4, 2, mode={mode!r})\n"
        "hooks.point('update.optimizer', 4)\n"  # the first hit: not the armed one
        "hooks.point('update.optimizer', 3)\n"
        "print('reached', flush=True)\n"
        "hooks.point('update.optimizer', 4)\n"
        "print('survived', flush=True)\n"
    )
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    assert p.stdout == "reached\n", p.stdout


def test_ranks_sharing_a_gpu_and_every_rank_failing_are_refused_with_a_reason(capsys):
    # Issue 47: --ranks-per-gpu (gloo on one GPU) and --all-ranks, refused before anything
    # runs, the flag, the parallelism and the missing collective named.
    from faultkit.cli import main

    def refused(*args: str) -> tuple[int, str]:
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err

    code, err = refused("inject", "--ranks-per-gpu", "2")
    assert code == 2 and "--ranks-per-gpu 2 shares GPUs" in err and "--device cuda" in err, err
    code, err = refused("matrix", "--ranks-per-gpu", "0")
    assert code == 2 and "--ranks-per-gpu 0" in err, err
    # The parallelism's refusal comes before the device is looked at (none here).
    code, err = refused("inject", "--device", "cuda", "--ranks-per-gpu", "2", "--parallel", "pp")
    assert code == 2 and "pipeline parallelism" in err and "send/recv" in err, err
    code, err = refused("matrix", "--device", "cuda", "--ranks-per-gpu", "2", "--parallel", "titan")
    assert code == 2 and "torchtitan" in err and "PREMUL_SUM" in err, err
    code, err = refused("inject", "--all-ranks", "--mode", "sdc-update", "--phase", "update")
    assert code == 2 and "--all-ranks fails every rank" in err, err
    code, err = refused("inject", "--all-ranks", "--world-size", "1")
    assert code == 2 and "--world-size 2 or more" in err, err


def test_every_rank_failing_is_one_generation_and_beyond_h1_one_case_a_phase():
    import faultkit.inject as fi
    from faultkit.job import POOL, JobFault, plan_of

    faults = [
        JobFault(0, "update.optimizer@2#1", lose_pages=POOL.tier1_pages + 1),
        JobFault(1, "update.optimizer@2#1", with_previous=True),
        JobFault(1, "compute.forward@4#1"),
        JobFault(0, "compute.forward@4#1", with_previous=True),
    ]
    # The fatal first failure takes two generations (the fallback is the second).
    assert [(e["generation"], e["rank"]) for e in plan_of(faults, POOL)] == [
        (0, 0), (0, 1), (2, 1), (2, 0)
    ]  # fmt: skip
    cases = fi.matrix_cases(InjectConfig(), phases=("compute", "update"), losses="beyond")
    assert cases == [("compute", "kill", 17, 16), ("update", "kill", 17, 16)], cases
    with pytest.raises(ValueError, match="expected all, pairs, alternate or beyond"):
        fi.matrix_cases(InjectConfig(), losses="some")


def test_a_fault_armed_for_parked_shadows_waits_for_them_before_it_strikes(capsys):
    # ``when="parked"``: at the armed point the trainer's wait (leto.plugins.wait_parked,
    # installed by its context) runs first; a wait that gave up is said, and the fault
    # strikes anyway. "now" never waits.
    from faultkit import hooks
    from leto import plugins

    calls = []
    for when, parked in (("parked", True), ("parked", False), ("now", True)):
        calls.clear()
        plugins.install_parked_wait(lambda p=parked: calls.append("wait") or p)
        try:
            hooks.arm("update.optimizer", 2, 1, mode="raise", when=when)
            hooks.point("update.optimizer", 1)  # not the armed iteration: no wait
            assert calls == []
            with pytest.raises(hooks.InjectedCrash):
                hooks.point("update.optimizer", 2)
        finally:
            hooks.disarm()
            plugins.install_parked_wait(None)
        assert calls == (["wait"] if when == "parked" else []), (when, calls)
        said = capsys.readouterr().err
        assert ("did not all park" in said) == (when == "parked" and not parked), said
    with pytest.raises(ValueError, match="when='later'"):
        hooks.arm("sync", 1, when="later")


def test_the_wait_for_parked_shadows_needs_every_ranks_next_shadow():
    import time as _time
    from datetime import timedelta

    import torch.distributed as dist

    from leto.job import keys
    from leto.job.store import free_port
    from leto.trainer.api import Context

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    ctx = Context.__new__(Context)
    ctx.generation, ctx.world_size, ctx.store = 3, 2, store
    store.set(keys.parked(4, 0), "{}")
    t0 = _time.monotonic()
    assert ctx.wait_successors_parked(0.3) is False  # rank 1's shadow of generation 4: not yet
    assert _time.monotonic() - t0 >= 0.3
    store.set(keys.parked(3, 1), "{}")  # another generation's does not count
    assert ctx.wait_successors_parked(0.2) is False
    store.set(keys.parked(4, 1), "{}")
    assert ctx.wait_successors_parked(5.0) is True


def test_the_wait_for_parked_shadows_waits_for_their_run_ahead_at_l3():
    # What a failure meets in a job that has run a while: the L3 shadows' set-up run
    # ahead to leto.Run (or their reason not to), once their trainer finished an iteration.
    from datetime import timedelta

    import torch.distributed as dist

    from leto.job import keys
    from leto.job.store import free_port
    from leto.trainer.api import Context
    from leto.trainer.first_iteration import Pace

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    ctx = Context.__new__(Context)
    ctx.generation, ctx.world_size, ctx.store, ctx.pace = 3, 2, store, Pace()
    for r in (0, 1):
        store.set(keys.parked(4, r), '{"pid": 1, "level": "L3"}')
    ctx.pace.began(7)  # in its first iteration: no shadow runs ahead yet
    assert ctx.wait_successors_parked(1.0) is True
    ctx.pace.began(8)
    assert ctx.wait_successors_parked(0.3) is False, "parked, not yet run ahead"
    store.set(keys.ahead_settled(4, 0), "ran ahead: reached leto.Run")
    store.set(keys.ahead_settled(4, 1), "parks: no room")
    assert ctx.wait_successors_parked(5.0) is True
