"""bench/ettr.py: the helpers that turn measurements into intervals, fault plans, ETTR and
predictions (fast), and one tiny end-to-end comparison of the three systems on the CPU
build (world size 2, one HOF): every system bit-exact, Leto ahead of torchrun + DCP, and
the prediction error computed from the measured numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import ettr
from leto.errors import InvalidInput
from leto.sim.model import INTERVAL, LETO
from leto.sim.schedule import Failure, Schedule, every

REPO = Path(__file__).resolve().parents[1]
LETO_SPEC, GEMINI, TORCHRUN = ettr.systems()


# -- calibration and intervals -------------------------------------------------------------


def _times(n: int, t_iter: float, cost: float, interval: int) -> dict[int, float]:
    """Record times of a run whose saves (after 0, interval, ...) cost ``cost`` each."""
    out, w = {}, 100.0
    for t in range(n):
        out[t] = w
        w += t_iter + (cost if t % interval == 0 else 0.0)
    return out


def test_calibrate_recovers_iteration_time_and_save_cost():
    got = ettr.calibrate(_times(40, 0.12, 0.05, 4), interval=4, warmup=4)
    assert got["t_iter_s"] == pytest.approx(0.12), got
    assert got["save_cost_s"] == pytest.approx(0.05), got
    assert got["gaps_with_save"] == 9 and got["gaps_without"] == 26, got


def test_calibrate_skips_warmup_and_clamps_noise_at_zero():
    times = _times(20, 0.1, 0.0, 4)
    times = {t: w + (5.0 if t >= 1 else 0.0) for t, w in times.items()}  # slow first gap
    got = ettr.calibrate(times, interval=4, warmup=2)
    assert got["t_iter_s"] == pytest.approx(0.1) and got["save_cost_s"] == 0.0, got
    times = {t: w - (0.01 * (t // 4) if t % 4 else 0.0) for t, w in _times(20, 0.1, 0, 4).items()}
    assert ettr.calibrate(times, 4, 2)["save_cost_s"] >= 0.0


def test_calibrate_says_when_the_run_is_too_short():
    with pytest.raises(InvalidInput, match="need at least 2 of each"):
        ettr.calibrate(_times(6, 0.1, 0.0, 4), interval=4, warmup=4)
    with pytest.raises(InvalidInput, match="not 0..N-1"):
        ettr.calibrate({0: 0.0, 2: 1.0, 3: 2.0}, interval=2, warmup=0)


def test_young_interval_per_system():
    # p = 0.05 / 0.1 = 0.5, M = 40 s: sqrt(2 * 0.5 * 40 / 0.1) = 20.
    assert ettr.young(0.05, 0.1, 40.0, 0.5, INTERVAL, 1000) == 20
    # Leto: the FF-only MTTF 40 / (1 - 0.5) = 80 s: sqrt(800) = 28.3 -> 28.
    assert ettr.young(0.05, 0.1, 40.0, 0.5, LETO, 1000) == 28
    # No FFs: no finite optimum; the largest interval (the job's length).
    assert ettr.young(0.05, 0.1, 40.0, 1.0, LETO, 120) == 120
    # A free checkpoint: every iteration.
    assert ettr.young(0.0, 0.1, 40.0, 0.0, INTERVAL, 120) == 1


# -- schedules onto iterations -------------------------------------------------------------


def test_every_k_lands_on_multiples_of_k_despite_float_rounding():
    t_iter, k = 0.16478106158273975, 33  # (33 * t) // t == 32 in floating point
    s = every(k * t_iter, 3 * k * t_iter, world_size=2, hof_ratio=1.0)
    assert [p.iteration for p in s.at_iteration(t_iter)][0] == k - 1  # the trap
    injections, notes = ettr.place(s, t_iter, iterations=3 * k)
    assert [i.iteration for i in injections] == [k, 2 * k], (injections, notes)
    assert all(i.kind == "HOF" for i in injections)
    assert len(notes) == 1 and "dropped" in notes[0], notes  # the one at 3k == the end


def test_place_moves_a_colliding_failure_to_the_next_iteration():
    s = Schedule((Failure(1.05, 0, "HOF"), Failure(1.07, 1, "FF"), Failure(1.95, 0, "HOF")), 3.0, 2)
    injections, notes = ettr.place(s, 1.0, iterations=3)
    assert [(i.iteration, i.kind) for i in injections] == [(1, "HOF"), (2, "FF")], injections
    assert any("moved to 2" in n for n in notes) and any("dropped" in n for n in notes), notes


def test_compress_scales_a_window_onto_the_job():
    s = Schedule((Failure(100.0, 0, "HOF"), Failure(4000.0, 1, "FF")), 4800.0, 2, {"g": 1})
    c = ettr.compress(s, 12.0)
    assert c.duration_s == 12.0 and [f.at_s for f in c.failures] == [0.25, 10.0], c
    assert [f.kind for f in c.failures] == ["HOF", "FF"] and c.source["time_scale"] == 12 / 4800
    with pytest.raises(InvalidInput):
        ettr.compress(s, 0.0)


def test_fault_plan_spends_two_generations_on_a_leto_ff():
    inj = [ettr.Injection(3, 1, "HOF", 0.0), ettr.Injection(6, 0, "FF", 0.0)]
    inj.append(ettr.Injection(9, 1, "HOF", 0.0))
    plan, gens = ettr.fault_plan(inj, LETO_SPEC, "update.optimizer", lose_pages=5)
    assert gens == [0, 1, 3], gens
    assert plan[1] == {
        "generation": 1,
        "rank": 0,
        "at": "update.optimizer@6#1",
        "mode": "kill",
        "lose_pages": 5,
    }
    assert "lose_pages" not in plan[0] and "lose_pages" not in plan[2]
    plan, gens = ettr.fault_plan(inj, TORCHRUN, "update.optimizer", lose_pages=5)
    assert gens == [0, 1, 2] and all("lose_pages" not in f for f in plan), plan


# -- measurements --------------------------------------------------------------------------


def test_measured_ettr_is_productive_time_over_training_wall_time():
    # 10 iterations of 1 s, one 5 s stall between 4 and 5: wall 1 + 9 + 5 = 15 s.
    hist = [(t, 10.0 + t + (5.0 if t >= 5 else 0.0)) for t in range(10)]
    m = ettr.measured_ettr(hist, 10)
    assert m["ettr"] == pytest.approx(10 / 15) and m["t_iter_s"] == pytest.approx(1.0), m
    assert m["training_wall_s"] == pytest.approx(15.0), m
    with pytest.raises(InvalidInput, match="last iteration 10"):
        ettr.measured_ettr(hist, 11)


def _summary(records):
    return {"recoveries": records, "measured": {"ettr": None}}


def test_failure_costs_split_init_and_recompute_and_merge_a_leto_ff():
    # Leto FF at iteration 4: a HOF attempt (generation 0, its promoted trainers go fatal),
    # then the fallback (generation 1) whose trainers resume at t = 110.
    recs = [
        {"generation": 0, "class": "HOF", "detected_at": 104.5, "trainers": {}},
        {"generation": 1, "class": "FF", "detected_at": 106.0, "recovery_s": 4.0},
    ]
    # Rank 0 records 0..3 at 101..104, then (restored at 2) 3 at 111, 4 at 112, 5 at 113.
    h0 = [(t, 101.0 + t) for t in range(4)] + [(3, 111.0), (4, 112.0), (5, 113.0)]
    h1 = [(it, w + 0.01) for it, w in h0]
    inj = [ettr.Injection(4, 1, "FF", 0.0)]
    (f,) = ettr.failure_costs(_summary(recs), inj, [0], LETO_SPEC, {0: h0, 1: h1}, 1.0)
    assert f["path"] == "checkpoint" and f["init_s"] == pytest.approx(5.5), f
    assert f["recompute_s"] == pytest.approx(2.01) and f["recovery_s"] == pytest.approx(7.51), f
    assert f["in_iteration_fraction"] == pytest.approx(0.5), f


def test_failure_costs_reject_a_failure_that_did_not_happen_as_planned():
    inj = [ettr.Injection(4, 1, "HOF", 0.0)]
    hist = {0: [(t, float(t)) for t in range(8)]}
    with pytest.raises(RuntimeError, match="left no recovery record"):
        ettr.failure_costs(_summary([]), inj, [0], LETO_SPEC, hist, 1.0)
    ff = [{"generation": 0, "class": "FF", "detected_at": 4.5, "recovery_s": 1.0}]
    with pytest.raises(RuntimeError, match="expected HOF"):
        ettr.failure_costs(_summary(ff), inj, [0], LETO_SPEC, hist, 1.0)


def test_failure_costs_name_an_unplanned_failure_and_its_log(tmp_path):
    (tmp_path / "rank0.gen1.active.log").write_text("Traceback\nRuntimeError: Gloo refused\n")
    recs = [
        {"generation": 0, "class": "HOF", "detected_at": 4.5, "recovery_s": 0.5},
        {
            "generation": 1,
            "class": "HOF",
            "detected_at": 6.5,
            "recovery_s": 0.5,
            "failed_ranks": [0],
        },
    ]
    summary = _summary(recs) | {"config": {"log_dir": str(tmp_path)}}
    inj = [ettr.Injection(4, 1, "HOF", 0.0)]
    hist = {0: [(t, float(t)) for t in range(8)]}
    with pytest.raises(RuntimeError, match="generation 1 failed without a planned.*Gloo refused"):
        ettr.failure_costs(summary, inj, [0], LETO_SPEC, hist, 1.0)


def test_predict_replays_failures_at_their_progress_points():
    # T_iter 1 s, free checkpoints every 4: the job completes 10 iterations at 10 s, fails
    # half-way into the next (10.5 s), rolls back to checkpoint 8, is down 5 s (15.5 s),
    # then runs 12 iterations to 20: done at 27.5 s. ETTR 20 / 27.5.
    fails = [{"iteration": 10, "rank": 0, "kind": "HOF", "path": "checkpoint"}]
    fails[0] |= {"init_s": 5.0, "in_iteration_fraction": 0.5}
    p = ettr.predict(fails, TORCHRUN, 1.0, 0.0, 4, 20, 2)
    assert p["inputs"]["failures_at_s"] == pytest.approx([10.5]), p
    assert p["ettr"] == pytest.approx(20 / 27.5, rel=1e-6), p
    # Leto's in-place path: no rollback, only the half iteration redone.
    fails[0] |= {"path": "in-place", "init_s": 0.5}
    p = ettr.predict(fails, LETO_SPEC, 1.0, 0.0, 20, 20, 2)
    assert p["ettr"] == pytest.approx(20 / 21.0, rel=1e-6), p
    assert p["inputs"]["t_init_hof_s"] == 0.5 and p["inputs"]["t_init_s"] == 0.0, p


def test_cli_rejects_bad_input_with_a_reason(capsys):
    from leto.cli import main

    def leto(*argv) -> tuple[int, str]:
        try:  # in-process: each refusal comes before anything runs
            code = main(["bench", "ettr", *argv])
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err

    code, err = leto("--iterations", "5")  # saves every 4: a 4-iteration warm-up, two saves
    assert code == 2 and "use at least 14" in err, err
    code, err = leto("--memory-dir", str(REPO))
    assert code == 2 and "not a tmpfs" in err, err
    code, err = leto("--hof-every", "0")
    assert code == 2 and "--hof-every 0" in err, err


# -- end to end ----------------------------------------------------------------------------


@pytest.mark.integ
@pytest.mark.timeout(300)  # ~90 s on an idle 2-core VM; five leto runs, two cold restarts
def test_leto_beats_torchrun_on_one_hof_and_every_system_is_exact(tmp_path):
    out = tmp_path / "ettr.json"
    res = ettr.main(
        ["--schedules", "every", "--iterations", "12", "--hof-every", "7"]
        + ["--calibration-interval", "2", "--work-dir", str(tmp_path / "w")]
        + ["--json-out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    s = res["schedules"]["every"]
    assert [i["iteration"] for i in s["injections"]] == [7], s["injections"]
    rows = s["systems"]
    assert set(rows) == {"Leto", "Gemini-style", "torchrun + DCP"}, rows.keys()
    for name, r in rows.items():
        assert r["exact"], f"{name} not bit-exact: {r['first_divergence']}"
        assert r["failures"] == 1 and r["hof"] == 1, (name, r["per_failure"])
        (f,) = r["per_failure"]
        assert f["init_s"] > 0 and f["recompute_s"] >= 0, (name, f)
        assert f["recovery_s"] == pytest.approx(f["init_s"] + f["recompute_s"]), (name, f)
        pred = r["predicted"]
        assert pred["ettr"] > 0 and math.isfinite(pred["ettr"]), (name, pred)
        assert r["prediction_error"] == pytest.approx((pred["ettr"] - r["ettr"]) / r["ettr"])
        # The simulator got the measured numbers, not defaults.
        assert pred["inputs"]["t_iter_s"] == r["t_iter_s"], (name, pred)
        assert pred["inputs"]["interval"] == r["interval"], (name, pred)
        init_key = "t_init_hof_s" if name == "Leto" else "t_init_s"
        assert pred["inputs"][init_key] == pytest.approx(f["init_s"]), (name, pred)
    assert rows["Leto"]["per_failure"][0]["path"] == "in-place"
    assert rows["Leto"]["interval"] == 12, "no FFs: Leto should checkpoint at the largest interval"
    assert rows["torchrun + DCP"]["checkpoint_dir_fs"] != "tmpfs", rows["torchrun + DCP"]
    assert rows["Gemini-style"]["checkpoint_dir_fs"] == "tmpfs", rows["Gemini-style"]
    leto, torchrun = rows["Leto"], rows["torchrun + DCP"]
    assert leto["ettr"] > torchrun["ettr"], (
        f"Leto {leto['ettr']:.1%} (init {leto['mean_init_s']:.2f} s) not above torchrun + DCP "
        f"{torchrun['ettr']:.1%} (init {torchrun['mean_init_s']:.2f} s)"
    )
    assert leto["mean_init_s"] < torchrun["mean_init_s"], (leto, torchrun)
