"""The verifiers package: recorder, byte-exact comparison, report plots and the command.

Fast unit and property tests (one subprocess, for the SIGKILL test). Runs are written
by the real ``Recorder`` from tensors that are a function of (seed, rank, iteration),
so two runs with the same seed are byte-identical and a test changes exactly one thing.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leto.errors import InvalidInput
from verifiers import EVENT_INJECTION, EVENT_RECOVERED, Recorder, compare, read_run, report
from verifiers.cli import main
from verifiers.plots import recovery_windows, throughput_steps
from verifiers.trace import load_tensors, trace_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_tensors(seed: int, rank: int, it: int, dtype=torch.float32, shape=(3, 5)) -> dict:
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + it)
    return {
        "param": torch.randn(shape, generator=g).to(dtype),
        "exp_avg": torch.randn(7, generator=g).to(dtype),
    }


def make_loss(seed: int, rank: int, it: int) -> float:
    return 10.0 / (1 + it) + seed * 1e-3 + rank * 1e-4


def write_run(
    out: Path,
    iterations: int = 4,
    ranks: int = 2,
    seed: int = 0,
    keep: bool = True,
    dtype=torch.float32,
    shape=(3, 5),
    flip: tuple[int, int, str, int] | None = None,  # (rank, iteration, tensor, bit)
    skip: tuple[int, int] | None = None,  # (rank, iteration) not recorded
) -> None:
    for r in range(ranks):
        with Recorder(out, r, keep_tensors=keep) as rec:
            for it in range(iterations):
                if skip == (r, it):
                    continue
                ts = make_tensors(seed, r, it, dtype, shape)
                if flip is not None and flip[:2] == (r, it):
                    flip_bit(ts[flip[2]], flip[3])
                rec.record(it, make_loss(seed, r, it), ts)


def flip_bit(t: torch.Tensor, bit: int) -> None:
    u8 = t.view(-1).view(torch.uint8)
    u8[bit // 8] ^= 1 << (bit % 8)


@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    iterations=st.integers(2, 5),
    data=st.data(),
)
def test_single_flipped_bit_is_located_exactly(dtype, shape, iterations, data):
    dt = DTYPES[dtype]
    rank = data.draw(st.integers(0, 1), label="rank")
    it = data.draw(st.integers(0, iterations - 1), label="iteration")
    name = data.draw(st.sampled_from(["param", "exp_avg"]), label="tensor")
    clean = make_tensors(0, rank, it, dt, shape)[name]
    bit = data.draw(st.integers(0, clean.numel() * clean.element_size() * 8 - 1), label="bit")
    flipped = clean.clone()
    flip_bit(flipped, bit)
    a = float(clean.view(-1)[bit // 8 // clean.element_size()])
    b = float(flipped.view(-1)[bit // 8 // clean.element_size()])
    expected_diff = abs(a - b)

    with tempfile.TemporaryDirectory() as d:
        ref, run = Path(d, "ref"), Path(d, "run")
        write_run(ref, iterations, dtype=dt, shape=shape)
        write_run(run, iterations, dtype=dt, shape=shape, flip=(rank, it, name, bit))
        v = compare(ref, run)

    div = v.first_divergence
    assert not v.exact, f"a flipped bit {bit} in {name} at iteration {it} went unnoticed: {v}"
    assert div is not None, f"not exact but no divergence named: {v.describe()}"
    got = (div.rank, div.iteration, div.tensor, div.byte_offset)
    assert got == (rank, it, name, bit // 8), f"located {got}, flipped {(rank, it, name, bit)}"
    assert v.records_differing == 1, f"{v.records_differing} records differ, one bit was flipped"
    if math.isnan(expected_diff):
        assert math.isnan(div.max_abs_diff), f"expected NaN difference, got {div.max_abs_diff}"
    else:
        assert div.max_abs_diff == expected_diff, (
            f"largest |difference| {div.max_abs_diff}, expected |{a} - {b}| = {expected_diff}"
        )


def test_identical_runs_are_exact(tmp_path):
    write_run(tmp_path / "ref", iterations=5)
    write_run(tmp_path / "run", iterations=5)
    v = compare(tmp_path / "ref", tmp_path / "run")
    assert v.exact, f"identical runs judged not exact: {v.describe()}"
    assert (v.records_compared, v.iterations_compared) == (10, 5), (
        f"compared {v.records_compared} records / {v.iterations_compared} iterations, "
        "expected 10 / 5"
    )
    assert v.describe() is None and not v.notes, f"exact verdict carries {v.describe()} {v.notes}"


def test_identical_runs_without_saved_tensors_are_exact(tmp_path):
    write_run(tmp_path / "ref", keep=False)
    write_run(tmp_path / "run", keep=False)
    v = compare(tmp_path / "ref", tmp_path / "run")
    assert v.exact, f"hash-only identical runs judged not exact: {v.describe()}"
    assert not (tmp_path / "ref" / "rank0.tensors").exists(), "keep_tensors=False saved tensors"


def test_flip_without_saved_tensors_says_offset_unknown_and_why(tmp_path):
    write_run(tmp_path / "ref", keep=False)
    write_run(tmp_path / "run", keep=False, flip=(1, 2, "exp_avg", 13))
    d = compare(tmp_path / "ref", tmp_path / "run").first_divergence
    assert d is not None and (d.rank, d.iteration, d.tensor) == (1, 2, "exp_avg"), f"got {d}"
    assert d.byte_offset is None and d.max_abs_diff is None, f"offset invented: {d}"
    assert "without keep_tensors" in d.why, f"reason not given: {d.why!r}"


def test_missing_iteration_is_not_exact(tmp_path):
    write_run(tmp_path / "ref", iterations=4)
    write_run(tmp_path / "run", iterations=4, skip=(1, 2))
    v = compare(tmp_path / "ref", tmp_path / "run")
    assert not v.exact, f"a run missing rank 1 iteration 2 judged exact: {v}"
    assert v.missing == ((1, 2),), f"missing reported as {v.missing}"
    assert v.first_divergence is None, f"records that exist all match: {v.first_divergence}"
    assert "missing" in v.describe(), v.describe()


def test_loss_difference_is_reported_before_tensors(tmp_path):
    write_run(tmp_path / "ref", iterations=3)
    write_run(tmp_path / "run", iterations=2)
    with Recorder(tmp_path / "run", 0, keep_tensors=True) as rec:
        ts = make_tensors(0, 0, 2)
        flip_bit(ts["param"], 0)
        rec.record(2, math.nextafter(make_loss(0, 0, 2), 0.0), ts)
    with Recorder(tmp_path / "run", 1, keep_tensors=True) as rec:
        rec.record(2, make_loss(0, 1, 2), make_tensors(0, 1, 2))
    d = compare(tmp_path / "ref", tmp_path / "run").first_divergence
    assert d is not None and (d.iteration, d.tensor) == (2, "loss"), f"got {d}"
    assert d.differing == ("loss", "param"), f"differing items {d.differing}"
    ulp = math.ulp(make_loss(0, 0, 2))
    assert 0 < d.max_abs_diff <= ulp, f"one-ulp loss change measured as {d.max_abs_diff}"


def test_torn_last_line_is_tolerated_and_next_record_survives(tmp_path):
    write_run(tmp_path / "ref", iterations=5)
    write_run(tmp_path / "run", iterations=4)
    path = trace_path(tmp_path / "run", 0)
    line = path.read_bytes().splitlines(keepends=True)[-1]
    with open(path, "ab") as f:  # what a kill in the middle of a write would leave
        f.write(line[: len(line) // 2])
    v = compare(tmp_path / "ref", tmp_path / "run")
    assert v.missing == ((0, 4), (1, 4)), f"torn line changed the records: {v.missing}"
    assert any("torn" in n for n in v.notes), f"torn line not noted: {v.notes}"

    # The restarted rank appends after the torn fragment: its record must not be lost.
    for r in range(2):
        with Recorder(tmp_path / "run", r, keep_tensors=True) as rec:
            rec.record(4, make_loss(0, r, 4), make_tensors(0, r, 4))
    v = compare(tmp_path / "ref", tmp_path / "run")
    assert v.exact, f"record after a torn line was lost or misread: {v.describe()}"
    assert any("line 5 is not a valid trace line" in n for n in v.notes), v.notes


def test_rerun_that_differed_is_reported(tmp_path):
    write_run(tmp_path / "ref", iterations=4)
    write_run(tmp_path / "run", iterations=2)
    with Recorder(tmp_path / "run", 0, keep_tensors=True) as rec:
        bad = make_tensors(0, 0, 1)
        flip_bit(bad["exp_avg"], 42)
        rec.record(1, make_loss(0, 0, 1), bad)  # iteration 1 redone after a recovery...
        rec.record(1, make_loss(0, 0, 1), make_tensors(0, 0, 1))  # ...and once more
        for it in (2, 3):
            rec.record(it, make_loss(0, 0, it), make_tensors(0, 0, it))
    with Recorder(tmp_path / "run", 1, keep_tensors=True) as rec:
        for it in (2, 3):
            rec.record(it, make_loss(0, 1, it), make_tensors(0, 1, it))
    v = compare(tmp_path / "ref", tmp_path / "run")
    assert v.first_divergence is None, f"latest records all match: {v.first_divergence}"
    assert not v.exact, "a rerun that differed must make the verdict not exact"
    assert len(v.reruns_differed) == 1, f"reruns reported: {v.reruns_differed}"
    r = v.reruns_differed[0]
    got = (r.run, r.divergence.rank, r.divergence.iteration, r.divergence.tensor)
    assert got == ("run", 0, 1, "exp_avg"), f"rerun located as {got}"
    assert r.divergence.byte_offset == 5, f"bit 42 is in byte 5, got {r.divergence.byte_offset}"


def test_identical_rerun_is_exact(tmp_path):
    write_run(tmp_path / "ref", iterations=3)
    write_run(tmp_path / "run", iterations=3)
    with Recorder(tmp_path / "run", 1, keep_tensors=True) as rec:
        rec.record(2, make_loss(0, 1, 2), make_tensors(0, 1, 2))
    v = compare(tmp_path / "ref", tmp_path / "run")
    assert v.exact, f"an identical rerun judged not exact: {v.describe()}"


def test_record_accepts_0_dim_and_non_contiguous_tensors(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with Recorder(tmp_path / "a", 0) as rec:
        rec.record(0, 1.0, {"scalar": torch.tensor(2.5), "t": t.t()})
    with Recorder(tmp_path / "b", 0) as rec:
        rec.record(0, 1.0, {"scalar": torch.tensor(2.5), "t": t.t().contiguous()})
    v = compare(tmp_path / "a", tmp_path / "b")
    assert v.exact, f"a transposed view and its contiguous copy differ: {v.describe()}"


def test_invalid_inputs_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    write_run(tmp_path / "ref", iterations=1, ranks=1)
    with pytest.raises(InvalidInput, match=str(missing)):
        compare(tmp_path / "ref", missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match="holds no rank"):
        compare(tmp_path / "empty", tmp_path / "ref")
    with pytest.raises(InvalidInput, match="not a torch.Tensor"):
        Recorder(tmp_path / "x", 0).record(0, 1.0, {"w": [1.0]})


def test_cli_compare_exit_codes_and_json(tmp_path, capsys):
    write_run(tmp_path / "ref", iterations=3)
    write_run(tmp_path / "same", iterations=3)
    write_run(tmp_path / "bad", iterations=3, flip=(0, 1, "param", 9))
    assert main(["compare", str(tmp_path / "ref"), str(tmp_path / "same")]) == 0
    assert "EXACT" in capsys.readouterr().out
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "bad"), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == 1 and not got["exact"], f"exit {code}, verdict {got}"
    assert got["first_divergence"]["byte_offset"] == 1, got["first_divergence"]
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2 and "nope" in err, f"exit {code}, stderr {err!r}"


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_faulted_run(out: Path, clock: FakeClock) -> None:
    """Iterations 0-5 at 1 s each; fault during 6; 3 s recovery redoing iteration 5."""
    recs = [Recorder(out, r, keep_tensors=False, clock=clock) for r in range(2)]
    for it in range(6):
        clock.t += 1.0
        for r, rec in enumerate(recs):
            rec.record(it, make_loss(0, r, it), make_tensors(0, r, it))
    clock.t += 0.5
    recs[1].mark(EVENT_INJECTION, 6, point="update.optimizer")
    for rec in recs:  # the kill: every rank starts again
        rec.close()
    clock.t += 3.0
    recs = [Recorder(out, r, keep_tensors=False, clock=clock) for r in range(2)]
    for rec in recs:
        rec.mark(EVENT_RECOVERED, 5)
    for it in range(5, 10):  # iteration 5 re-run, 6 is the interrupted one
        clock.t += 1.0
        for r, rec in enumerate(recs):
            rec.record(it, make_loss(0, r, it), make_tensors(0, r, it))
    for rec in recs:
        rec.close()


def test_recovery_and_recomputation_windows(tmp_path):
    write_faulted_run(tmp_path / "run", FakeClock())
    run = read_run(tmp_path / "run")
    windows = recovery_windows(run, 0)
    assert len(windows) == 1, f"one fault, windows {windows}"
    w = windows[0]
    assert (w.start_s, w.end_s) == (1006.5, 1009.5), f"recovery window {w}"
    assert (w.recompute_end_s, w.recomputed) == (1011.5, (5, 6)), f"recomputation {w}"
    rates = [rate for _, _, rate in throughput_steps(run.traces[0], windows)]
    assert rates.count(0.0) == 1 and all(r in (0.0, 1.0) for r in rates), f"rates {rates}"


def test_report_writes_png_files(tmp_path, capsys):
    write_run(tmp_path / "ref", iterations=10)
    write_faulted_run(tmp_path / "run", FakeClock())
    paths = report(tmp_path / "ref", [tmp_path / "run"], tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["loss.png", "throughput.png"], names
    for p in paths:
        head = p.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n", f"{p} is not a PNG: {head!r}"
        assert p.stat().st_size > 5_000, f"{p} is {p.stat().st_size} bytes: an empty plot?"
    code = main(
        ["report", str(tmp_path / "ref"), str(tmp_path / "run"), "--out", str(tmp_path / "cli")]
    )
    assert code == 0 and (tmp_path / "cli" / "throughput.png").stat().st_size > 5_000
    assert (
        main(
            [
                "report",
                str(tmp_path / "ref"),
                str(tmp_path / "run"),
                "--out",
                str(tmp_path / "x"),
                "--rank",
                "7",
            ]
        )  # fmt: skip
        == 2
    )
    assert "no trace of rank 7" in capsys.readouterr().err


_CHILD = """
import sys, torch
from verifiers import Recorder
rec = Recorder(sys.argv[1], 0, keep_tensors=True)
t = torch.arange(4096, dtype=torch.float32)
print("ready", flush=True)
it = 0
while True:
    rec.record(it, float(it), {"w": t}, pad="x" * 20000)
    it += 1
"""


def test_reader_survives_sigkill_mid_recording(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
    )
    try:
        assert proc.stdout.readline() == b"ready\n", "child did not start"
        deadline = time.monotonic() + 30
        while (
            not trace_path(tmp_path, 0).exists() or trace_path(tmp_path, 0).stat().st_size < 200_000
        ):
            assert time.monotonic() < deadline, "child recorded nothing within 30 s"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    run = read_run(tmp_path)
    recs = run.traces[0].records
    assert len(recs) >= 5, f"only {len(recs)} records read back"
    assert sorted(recs) == list(range(len(recs))), f"records are not 0..n-1: {sorted(recs)[:10]}"
    # Every record read back names a complete tensors file that matches its hash.
    for it, rec in recs.items():
        saved, why = load_tensors(tmp_path, rec)
        assert saved is not None, f"iteration {it}: {why}"


def test_the_plugin_asks_for_the_final_state_only_when_it_saves_it(tmp_path, monkeypatch):
    # Leto builds the final state (a CPU copy of every retained byte) only for an
    # observer with `final`: without LETO_VERIFY_SAVE_STATE=1 there is none to build.
    import torch

    import verifiers.plugin  # noqa: F401 - installs the observer
    from leto import plugins
    from verifiers.recorder import ENV_SAVE_STATE

    monkeypatch.delenv(ENV_SAVE_STATE, raising=False)
    obs = plugins.iteration_observer(0, tmp_path)
    assert getattr(obs, "final", None) is None
    monkeypatch.setenv(ENV_SAVE_STATE, "1")
    obs = plugins.iteration_observer(1, tmp_path)
    state = {"param": torch.arange(6, dtype=torch.float32)}
    obs.final(state)
    got = torch.load(tmp_path / "rank1.state.pt")
    assert torch.equal(got["param"], state["param"])
