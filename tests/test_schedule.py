"""Failure schedules: JSON round-trip, validation, generator statistics, trace parsing.

Fast unit and property tests; the traces are the in-repo copies in data/traces.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faultkit.schedule_cli import register
from leto.errors import InvalidInput
from leto.sim.schedule import (
    EC2_TRACE,
    GCP_TRACE,
    KINDS,
    MODES,
    Failure,
    Schedule,
    every,
    parse_trace,
    phase_names,
    poisson,
    trace_window,
)

REPO_TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"


@st.composite
def schedules(draw) -> Schedule:
    world = draw(st.integers(1, 64))
    duration = draw(st.floats(1.0, 1e7, allow_nan=False))
    times = sorted(draw(st.lists(st.floats(0.0, duration), max_size=20)))
    failures = tuple(
        Failure(
            at_s=t,
            rank=draw(st.integers(0, world - 1)),
            kind=draw(st.sampled_from(KINDS)),
            mode=draw(st.sampled_from(MODES)),
            phase=draw(st.sampled_from(phase_names())),
            pages=draw(st.integers(0, 64)),
            host_parity_pages=draw(st.integers(0, 16)),
        )
        for t in times
    )
    source = draw(
        st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3)
    )
    return Schedule(failures, duration, world, source)


@given(schedules())
def test_any_valid_schedule_survives_json_round_trip(s):
    back = Schedule.from_json(s.to_json())
    assert back == s, f"round trip changed the schedule:\n{s}\n->\n{back}"
    assert json.loads(s.to_json())["version"] == 1


def test_repo_traces_are_verbatim_copies_of_shared():
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"{SHARED_TRACES} not present (a clean clone has only its copy in data/traces)")
    for name in ("SOURCES.md", GCP_TRACE.name, EC2_TRACE.name):
        assert (REPO_TRACES / name).read_bytes() == (SHARED_TRACES / name).read_bytes(), name
    assert GCP_TRACE.parent == REPO_TRACES


# -- validation ---------------------------------------------------------------------------


def _doc(**failure) -> str:
    row = {"at_s": 1.0, "rank": 0, "kind": "HOF"} | failure
    return json.dumps(
        {
            "version": 1,
            "duration_s": 10.0,
            "world_size": 2,
            "source": {},
            "failures": [{"at_s": 0.5, "rank": 1, "kind": "FF"}, row],
        }
    )


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ({"kind": "crash"}, r"failures\[1\].*kind='crash'.*expected one of \['HOF', 'FF'\]"),
        ({"at_s": -1.0}, r"failures\[1\].*at_s=-1.0.*finite time >= 0"),
        ({"rank": 2}, r"failure #1.*rank=2 outside 0..1"),
        ({"phase": "lunch"}, r"failures\[1\].*phase='lunch'.*expected one of"),
        ({"mode": "melt"}, r"failures\[1\].*mode='melt'"),
        ({"at_s": 0.25}, r"failure #1.*before failure #0.*sorted"),
        ({"pages": -3}, r"failures\[1\].*pages=-3.*integer >= 0"),
        ({"colour": "red"}, r"failures\[1\].*unknown fields \['colour'\]"),
        ({"at_s": 11.0}, r"failure #1.*after the schedule's end"),
    ],
)
def test_invalid_failure_names_index_field_and_expectation(failure, expected):
    with pytest.raises(InvalidInput, match=expected):
        Schedule.from_json(_doc(**failure))


def test_invalid_version_and_world_are_rejected():
    with pytest.raises(InvalidInput, match="version=2: expected 1"):
        Schedule.from_json(json.dumps({"version": 2}))
    with pytest.raises(InvalidInput, match="world_size=0"):
        Schedule((), 10.0, 0)
    with pytest.raises(InvalidInput, match="not JSON"):
        Schedule.from_json("{")


# -- generators ---------------------------------------------------------------------------


def test_every_spacing_is_exact():
    s = every(600.0, 3600.0, world_size=8, hof_ratio=1.0, seed=3)
    times = [f.at_s for f in s.failures]
    assert times == [600.0 * k for k in range(1, 7)], times
    assert all(f.kind == "HOF" for f in s.failures)
    gaps = {b - a for a, b in zip(times[:-1], times[1:], strict=True)}
    assert gaps == {600.0}, gaps


def test_poisson_mean_interarrival_matches_mttf():
    # n ~ 6000 exponential gaps: the sample mean has standard error mttf/sqrt(n) ~ 1.3%;
    # four standard errors (5.2%) fails a correct generator with probability < 1e-4,
    # and the seed is fixed, so this is a deterministic check of the statistic.
    mttf = 600.0
    s = poisson(mttf, 1000 * 3600.0, world_size=8, hof_ratio=0.5, seed=7)
    n = len(s.failures)
    gaps = [b.at_s - a.at_s for a, b in zip(s.failures[:-1], s.failures[1:], strict=True)]
    mean = sum(gaps) / len(gaps)
    tol = 4 * mttf / math.sqrt(len(gaps))
    assert abs(mean - mttf) < tol, f"mean gap {mean:.1f} s vs MTTF {mttf} s (tol {tol:.1f}, n={n})"
    # Count is Poisson(duration/mttf): same four-sigma rule.
    expected = 1000 * 3600.0 / mttf
    assert abs(n - expected) < 4 * math.sqrt(expected), f"{n} failures, expected {expected}"


@pytest.mark.parametrize("ratio", [0.0, 0.1, 1 / 3, 0.5, 0.9, 1.0])
def test_realised_hof_fraction_tracks_ratio(ratio):
    s = poisson(300.0, 50 * 3600.0, world_size=4, hof_ratio=ratio, seed=11)
    n = len(s.failures)
    frac = s.hof_count / n
    assert abs(frac - ratio) <= 1 / (2 * n) + 1e-12, f"HOF fraction {frac:.4f} vs {ratio}, n={n}"
    assert s.hof_count + s.ff_count == n


def test_ranks_are_uniform_over_the_world():
    s = poisson(10.0, 10 * 8000.0, world_size=8, seed=5)
    counts = [sum(f.rank == r for f in s.failures) for r in range(8)]
    n = len(s.failures)
    # Each count is Binomial(n, 1/8); four standard deviations.
    sd = math.sqrt(n * (1 / 8) * (7 / 8))
    assert all(abs(c - n / 8) < 4 * sd for c in counts), f"rank counts {counts} of {n}"


def test_same_seed_same_schedule_other_seed_other_schedule():
    a = poisson(600.0, 36000.0, 8, 0.5, seed=1)
    assert a == poisson(600.0, 36000.0, 8, 0.5, seed=1)
    assert a != poisson(600.0, 36000.0, 8, 0.5, seed=2)


def test_at_iteration_places_failures_in_the_iteration_in_flight():
    s = every(25.0, 100.0, world_size=2, first_s=5.0)
    placed = s.at_iteration(10.0)
    assert [p.iteration for p in placed] == [0, 3, 5, 8], placed
    with pytest.raises(InvalidInput, match="iter_s=0"):
        s.at_iteration(0)


# -- traces -------------------------------------------------------------------------------


def test_gcp_trace_has_36_drops_154_instances_over_27_hours():
    tr = parse_trace(GCP_TRACE)
    lost = sum(e.instances for e in tr.preemptions)
    assert len(tr.preemptions) == 36, f"{len(tr.preemptions)} drops"
    assert lost == 154, f"{lost} instances lost"
    assert abs(tr.length_s / 3600 - 27.0) < 0.05, f"trace is {tr.length_s / 3600:.3f} h"


def test_ec2_trace_removes_are_preemptions():
    tr = parse_trace(EC2_TRACE)
    text = EC2_TRACE.read_text()
    assert sum(e.instances for e in tr.preemptions) == text.count(",remove,") == 167
    assert len(tr.preemptions) == 79, f"{len(tr.preemptions)} distinct remove times"
    assert tr.length_s == 40920.0


def test_trace_window_gives_one_failure_per_event():
    # An 80-minute GCP window with eight eviction events, like the paper's §8.2 segment.
    s = trace_window(GCP_TRACE, 44200.0, 4800.0, world_size=8, hof_ratio=0.5, seed=0)
    assert len(s.failures) == 8, [f.at_s for f in s.failures]
    assert s.hof_count == 4 and s.ff_count == 4
    assert s.source["instances"] == [8, 1, 1, 1, 3, 1, 2, 6]
    assert s.failures[0].at_s == 44339.0 - 44200.0
    ec2 = trace_window(EC2_TRACE, 0.0, 7200.0, world_size=4, hof_ratio=1.0)
    assert ec2.failures and all(0 <= f.at_s < 7200 for f in ec2.failures)


def test_trace_window_errors_say_the_trace_length():
    with pytest.raises(
        InvalidInput, match=r"past the trace's end; the trace is 97266 s \(27.02 h\)"
    ):
        trace_window(GCP_TRACE, 97000.0, 4800.0, world_size=8)
    with pytest.raises(InvalidInput, match="no preemptions in window .* 97266 s trace"):
        trace_window(GCP_TRACE, 52000.0, 3600.0, world_size=8)


def test_plan_cli_writes_schedule_and_prints_summary(tmp_path, capsys):
    ap = argparse.ArgumentParser(prog="faultkit")
    register(ap.add_subparsers(dest="command", required=True))
    out = tmp_path / "plan.json"
    args = ap.parse_args(
        [
            "plan",
            "poisson",
            "--mttf-s",
            "600",
            "--duration-s",
            "36000",
            "--world-size",
            "8",
            "--hof-ratio",
            "0.5",
            "--out",
            str(out),
        ]
    )
    assert args.fn(args) == 0
    s = Schedule.from_json(out.read_text())
    assert s.source["generator"] == "poisson" and s.hof_count == round(0.5 * len(s.failures))
    table = capsys.readouterr().out
    assert "mean_interarrival_s" in table and str(len(s.failures)) in table
    args = ap.parse_args(
        ["plan", "every", "--interval-s", "-1", "--duration-s", "10", "--world-size", "2"]
    )
    assert args.fn(args) == 2
    assert "interval_s=-1" in capsys.readouterr().err
