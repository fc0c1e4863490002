"""The discrete-event simulator against hand-computed timelines and the analytic model,
plus smoke tests of ``leto sim`` through ``register`` on a local parser."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leto.sim.cli import register
from leto.sim.events import simulate
from leto.sim.model import INTERVAL, LETO, Job, System, choose_interval, predict
from leto.sim.schedule import GCP_TRACE, Failure, Schedule, poisson, trace_window

GEMINI = System("gemini+", INTERVAL, 1.0, 35.0)
LETO_SYS = System("leto", LETO, 1.0, 35.0, 15.0, 0.006)


def _sched(*failures, duration=1000.0, world=2):
    return Schedule(tuple(Failure(t, 0, k) for t, k in failures), duration, world, {})


def test_one_failure_breakdown_matches_hand_timeline():
    # T_iter 10 s, I = 5, p = 0.3: iterations 1-4 take 10 s, iteration 5 takes 13 s, ...
    # At 100 s: 9 iterations done (93 s), 7 s into iteration 10; checkpoint 5 is usable
    # (iteration 6 completed), so 4 iterations + 7 s are lost.
    r = simulate(_sched((100.0, "HOF")), GEMINI, 10.0, 0.3, 5)
    (rec,) = r.failures
    assert (rec.lost_iterations, rec.lost_inflight_s) == (4, 7.0), rec
    assert (rec.detection_s, rec.init_s) == (1.0, 35.0), rec
    assert rec.recompute_s == pytest.approx(40.0 + 7.0), rec  # iterations 6-9, then 7 s
    assert rec.recovered and not rec.restarted
    leto = simulate(_sched((100.0, "HOF")), LETO_SYS, 10.0, 0.3, 5).failures[0]
    assert (leto.lost_iterations, leto.init_s) == (0, 15.0), leto
    inflight = 100.0 - (9 * 10.0 * (1 + LETO_SYS.omega) + 3.0)  # ω stretches each iteration
    assert leto.recompute_s == pytest.approx(inflight), leto  # only the in-flight part


def test_failure_during_recovery_restarts_it_and_is_counted():
    r = simulate(_sched((100.0, "HOF"), (105.0, "HOF")), GEMINI, 10.0, 0.3, 5)
    first, second = r.failures
    assert r.recovery_restarts == 1, r.failures
    assert second.restarted and not first.recovered
    assert (first.detection_s, first.init_s, first.recompute_s) == (1.0, 4.0, 0.0), first
    assert second.lost_iterations == 0, "the job was down: nothing more to lose"
    assert second.recompute_s == pytest.approx(47.0), second  # still owes the first's progress
    # A Leto HOF whose in-place recovery is hit by an FF escalates to the checkpoint path.
    r = simulate(_sched((100.0, "HOF"), (105.0, "FF")), LETO_SYS, 10.0, 0.3, 5)
    hof, ff = r.failures
    assert ff.restarted and ff.init_s == LETO_SYS.t_init_s and ff.lost_iterations == 4, ff
    assert r.recovery_restarts == 1


def test_failure_during_recompute_is_flagged_and_progress_still_owed():
    # Recovery of the first ends at 136 s; recompute runs until 183 s; hit it at 150 s.
    r = simulate(_sched((100.0, "HOF"), (150.0, "HOF")), GEMINI, 10.0, 0.3, 5)
    first, second = r.failures
    assert second.during_recompute and not second.restarted, second
    assert first.recompute_s == pytest.approx(14.0) and not first.recovered, first
    assert r.during_recompute == 1 and r.recovery_restarts == 0


@given(st.lists(st.floats(0.0, 2000.0), max_size=15), st.sampled_from(["HOF", "FF"]))
def test_restart_count_is_failures_inside_detection_plus_init(times, kind):
    times = sorted(times)
    r = simulate(_sched(*[(t, kind) for t in times], duration=2000.0), GEMINI, 7.0, 0.2, 4)
    outage = GEMINI.t_det_s + GEMINI.t_init_s
    expected = sum(b < a + outage for a, b in zip(times[:-1], times[1:], strict=True))
    assert r.recovery_restarts == expected, f"{r.recovery_restarts} restarts, model {expected}"
    assert 0.0 <= r.ettr <= 1.0 and r.last_iteration_end_s <= 2000.0 + 1e-9
    spent = sum(x.recovery_s for x in r.failures)
    assert spent <= 2000.0 + 1e-6, f"records claim {spent:.1f} s of a 2000 s run"


def test_no_failures_gives_the_steady_factor():
    # 1000 checkpoint periods of 5 x 10 s + 3 s: the run ends on a period boundary.
    r = simulate(Schedule((), 53_000.0, 1, {}), GEMINI, 10.0, 0.3, 5)
    steady = 10.0 / (10.0 + 3.0 / 5)
    assert r.iterations == 5000, r.iterations
    assert r.ettr == pytest.approx(steady, rel=1e-12), (r.ettr, steady)


def _tolerance(job: Job, system: System, interval: int, duration_s: float) -> float:
    """How far one simulated run may sit from Eq. 6, derived rather than picked.

    * Noise: waste is a compound Poisson sum of ~D/M recovery costs, so its standard
      deviation is sqrt((D/M) E[cost^2]); ETTR moves by (T_iter/T_eff) / D per second of
      waste. Cost = fixed + lost work, lost work uniform over 1..I completed iterations
      plus U(0,1) of the one in flight (Leto HOFs: the in-flight part only). Four sigma.
    * Overlap bias (Eq. 6 assumption 2 fails): a failure lands inside the previous
      recovery with probability <= T_max / M and then shifts the charge by <= T_max, so
      <= (T_max / M)^2, T_max the longest recovery.
    * Discretisation: the checkpointing iteration is T_ckpt longer than the average Eq. 6
      uses, shifting a failure's lost work by <= T_ckpt: <= T_ckpt / M.
    * The run ends at a whole iteration: <= T_eff / D.
    """
    p = predict(job, system, interval)
    fixed_ff = system.t_det_s + system.t_init_s
    i = interval
    e_ff = fixed_ff + (i + 1) / 2 * p.t_eff_s + 0.5 * p.t_eff_s
    var_ff = ((i * i - 1) / 12 + 1 / 12) * p.t_eff_s**2
    e2_ff = e_ff**2 + var_ff
    if system.kind == LETO:
        e_hof = system.t_det_s + system.t_init_hof_s + 0.5 * p.t_eff_s
        e2_hof = e_hof**2 + p.t_eff_s**2 / 12
        e2 = job.hof_ratio * e2_hof + (1 - job.hof_ratio) * e2_ff
    else:
        e2 = e2_ff
    n = duration_s / job.mttf_s
    sigma = (job.t_iter_s / p.t_eff_s) * math.sqrt(n * e2) / duration_s
    t_max_ff = fixed_ff + (i + 1) * p.t_eff_s
    t_max_hof = system.t_det_s + system.t_init_hof_s + p.t_eff_s
    only_hofs = system.kind == LETO and job.hof_ratio == 1.0
    t_max = t_max_hof if only_hofs else t_max_ff  # the longest recovery that can occur
    return (
        4 * sigma + (t_max / job.mttf_s) ** 2 + job.t_ckpt_s / job.mttf_s + p.t_eff_s / duration_s
    )


@pytest.mark.parametrize(
    ("system", "hof_ratio"), [(GEMINI, 0.5), (LETO_SYS, 0.0), (LETO_SYS, 0.5), (LETO_SYS, 1.0)]
)
def test_long_poisson_run_agrees_with_analytic_model(system, hof_ratio):
    mttf, duration = 5000.0, 5000.0 * 3000  # ~3000 failures
    job = Job(10.0, 0.3, mttf, hof_ratio)
    interval = choose_interval(job, system, 64)
    schedule = poisson(mttf, duration, world_size=8, hof_ratio=hof_ratio, seed=2024)
    sim = simulate(schedule, system, job.t_iter_s, job.ckpt_p, interval)
    model = predict(job, system, interval).ettr
    tol = _tolerance(job, system, interval, duration)
    assert abs(sim.ettr - model) <= tol, (
        f"{system.name} h={hof_ratio}: simulated {sim.ettr:.5f} vs Eq. 6 {model:.5f}, "
        f"|diff| {abs(sim.ettr - model):.5f} > tolerance {tol:.5f} ({len(sim.failures)} failures)"
    )
    assert tol < 0.01, f"tolerance {tol:.4f} too loose to mean anything"


def test_wasted_gpu_hours_count_every_unproductive_second():
    r = simulate(_sched((100.0, "FF"), duration=1000.0), GEMINI, 10.0, 0.3, 5, gpus=64)
    expected = (1000.0 - r.iterations * 10.0) * 64 / 3600
    assert r.wasted_gpu_hours == pytest.approx(expected), (r.wasted_gpu_hours, expected)
    assert r.recovery_gpu_hours == pytest.approx(r.failures[0].recovery_s * 64 / 3600)


# -- CLI ----------------------------------------------------------------------------------


def _cli(argv, capsys):
    ap = argparse.ArgumentParser(prog="leto")
    register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    rc = args.fn(args)
    return rc, capsys.readouterr()


def test_cli_scenarios_json_and_png(tmp_path, capsys):
    png = tmp_path / "fig14.png"
    rc, out = _cli(["sim", "scenarios", "--mttf-s", "600", "--json", "--png", str(png)], capsys)
    assert rc == 0, out.err
    rows = json.loads(out.out)
    assert len(rows) == 3 * 3 * 2 and all(0 < r["ettr"] < 1 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sweeps_and_replay(tmp_path, capsys):
    rc, out = _cli(
        ["sim", "sweep-interval", "--intervals", "1", "8", "64", "--png", str(tmp_path / "i.png")],
        capsys,
    )
    assert rc == 0 and "sweep-interval" in out.out, out.err
    rc, out = _cli(["sim", "sweep-hof", "--hof-ratio", "0", "1", "--json"], capsys)
    assert rc == 0 and len(json.loads(out.out)) == 4
    plan = tmp_path / "plan.json"
    plan.write_text(trace_window(GCP_TRACE, 44200.0, 4800.0, 8, 0.5, 0).to_json())
    rc, out = _cli(["sim", "replay", "--schedule", str(plan), "--interval", "8", "--json"], capsys)
    rows = json.loads(out.out)
    assert rc == 0 and {r["failures"] for r in rows} == {8}, rows
    rc, out = _cli(["sim", "replay", "--schedule", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and "missing.json" in out.err
