"""``faultkit certify``: the user's own script fault-free and killed at every phase, one
verdict. The placement of the faults, the arguments' paths, the hints and the verdict's
logic run without processes; one job shows the claim end to end: the llm.c-style port
(``examples/porting/shards_leto.py``) with its loader not handed over is NOT EXACT, the
first divergence named and the data hint given. That the port as written is EXACT is
the CI gate's (``.ci/run`` certifies every script of examples/porting)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from faultkit import certify as cert
from faultkit.inject import PHASES

REPO = Path(__file__).resolve().parents[1]
SHARDS = REPO / "examples" / "porting" / "shards_leto.py"
NOT_HANDED = REPO / "tests" / "scripts" / "shards_not_handed.py"


def test_faults_spread_over_the_loop_one_per_phase_ranks_taking_turns():
    faults = cert.placement(tuple(PHASES), iterations=10, world=2, h1=4)
    assert [f.at.split("@")[0] for f in faults] == list(PHASES.values())
    its = [f.iteration for f in faults]
    assert its == sorted(its) and its[0] >= 1 and its[-1] <= 9, its
    assert len(set(its)) == len(its)  # a long enough loop: one fault an iteration
    assert [f.rank for f in faults] == [0, 1] * 4
    assert all(f.lose_pages == 4 for f in faults)
    assert [f.host_parity_pages for f in faults] == [1, 0] * 4


def test_a_short_loop_is_struck_again_in_a_redone_iteration():
    faults = cert.placement(tuple(PHASES), iterations=3, world=1, h1=4)
    its = [f.iteration for f in faults]
    assert its == sorted(its) and set(its) <= {1, 2}, its
    assert all(f.rank == 0 for f in faults)
    one = cert.placement(("update",), iterations=1, world=1, h1=4)
    assert one[0].iteration == 0
    # A loop that resumes the script's own checkpoint at 1234: struck inside it.
    late = cert.placement(tuple(PHASES), iterations=10, world=2, h1=4, first=1234)
    base = cert.placement(tuple(PHASES), iterations=10, world=2, h1=4)
    assert [f.iteration - 1234 for f in late] == [f.iteration for f in base]


def test_relative_paths_that_exist_are_made_absolute(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.bin").write_bytes(b"x")
    (tmp_path / "cfg.toml").write_text("")
    args = ("--data", "data", "--config=cfg.toml", "--glob", "data/*.bin", "--out", "new", "-v")
    got, changed = cert.resolve_args(args, tmp_path)
    assert got == (
        "--data", str(tmp_path / "data"), f"--config={tmp_path / 'cfg.toml'}",
        "--glob", str(tmp_path / "data/*.bin"), "--out", "new", "-v",
    )  # fmt: skip
    assert len(changed) == 3


def test_the_hint_follows_what_differs_first():
    div = {"iteration": 4, "tensor": "loss"}
    v = {"exact": False, "first_divergence": div, "reruns_differed": [], "missing": []}
    assert cert.hint(v, 4) == cert.HINT_DATA
    assert cert.hint({**v, "first_divergence": {**div, "tensor": "param"}}, 4) == cert.HINT_STATE
    assert "before any fault struck" in cert.hint(v, 5)
    assert cert.hint({**v, "first_divergence": None, "missing": [[0, 5]]}, 4) == cert.HINT_MISSING
    assert cert.hint({**v, "exact": True}, 4) is None


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        cert.check(cert.CertifyConfig(script=str(tmp_path / "none.py")))
    s = tmp_path / "s.py"
    s.write_text("")
    with pytest.raises(ValueError, match="'backward' is not one of"):
        cert.check(cert.CertifyConfig(script=str(s), phases=("backward",)))
    with pytest.raises(ValueError, match="--time-budget"):
        cert.check(cert.CertifyConfig(script=str(s), budget_s=0))
    with pytest.raises(ValueError, match="--world-size 0"):
        cert.check(cert.CertifyConfig(script=str(s), nproc_per_node=0))
    p = subprocess.run(
        [sys.executable, "-m", "faultkit.cli", "certify", "--json", "--", str(tmp_path / "x.py")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert json.loads(p.stdout)["refused"] is True
    assert "is not a file" in p.stderr


def _fake(monkeypatch, tmp_path, unfired_at=(), ref_s=1.0, timed=False):
    """certify with the runs replaced: every faulted run exact, except that faults at
    ``unfired_at`` points never strike (leto run lists them as unfired)."""
    runs = []

    def reference_run(cfg, work):
        return {"out": str(tmp_path), "run_s": ref_s}

    def faulted_run(cfg, faults, ref, work, label):
        runs.append([f.at for f in faults])
        unfired = [{"at": f.at} for f in faults if f.at.split("@")[0] in unfired_at]
        # Each recovery its own figures (fault k in generation k): I = 0.1 k, R = 0.01 k.
        per = [
            {"class": "HOF", "init_s": 0.1 * k, "recompute_s": 0.01 * k,
             "regained_s": 0.11 * k, "recovery_s": 0.05 * k}
            for k in range(1, 1 + len(faults) - len(unfired))
        ]  # fmt: skip
        return {
            "exact": True, "verdict": {"exact": True}, "first_divergence": None,
            "fatal_detail": None, "recovery_s": max(r["regained_s"] for r in per),
            "recoveries_timed": per if timed else [], "workdir": str(work),
            "faulted_run_s": 1.0, "unfired": unfired,
        }  # fmt: skip

    monkeypatch.setattr(cert, "reference_run", reference_run)
    monkeypatch.setattr(cert, "faulted_run", faulted_run)
    monkeypatch.setattr(cert, "_iterations_of", lambda ref: (0, 10))
    script = tmp_path / "s.py"
    script.write_text("")
    return runs, str(script)


def test_a_phase_never_reached_is_named_and_the_faults_after_it_run_again(monkeypatch, tmp_path):
    runs, script = _fake(monkeypatch, tmp_path, unfired_at=("sync",))
    v = cert.certify(cert.CertifyConfig(script=script, nproc_per_node=2), tmp_path)
    assert len(runs) == 2 and len(runs[0]) == 8
    assert runs[1] == runs[0][4:]  # those after sync, which never came, in a run of their own
    assert v["unreached"] == ["sync"] and v["verdict"] == "INCOMPLETE" and not v["exact"]
    struck = [r["phase"] for r in v["faults"] if r["struck"]]
    assert struck == [p for p in PHASES if p != "sync"]


def test_every_phase_exact_is_exact_and_separately_is_one_run_each(monkeypatch, tmp_path):
    runs, script = _fake(monkeypatch, tmp_path)
    v = cert.certify(cert.CertifyConfig(script=script, nproc_per_node=2), tmp_path)
    assert v["verdict"] == "EXACT" and v["exact"] and len(runs) == 1
    runs.clear()
    v = cert.certify(cert.CertifyConfig(script=script, separately=True), tmp_path)
    assert v["verdict"] == "EXACT" and len(runs) == len(PHASES)


def test_each_fault_reports_its_own_recovery_not_the_runs_slowest(monkeypatch, tmp_path):
    _, script = _fake(monkeypatch, tmp_path, timed=True)
    v = cert.certify(cert.CertifyConfig(script=script, nproc_per_node=2), tmp_path)
    got = [(r["init_s"], r["recompute_s"], r["recovery_s"]) for r in v["faults"]]
    want = [(0.1 * k, 0.01 * k, 0.11 * k) for k in range(1, len(PHASES) + 1)]
    assert got == pytest.approx(want), got
    assert len({r["recovery_s"] for r in v["faults"]}) == len(PHASES)


def test_runs_past_the_time_budget_are_not_started(monkeypatch, tmp_path):
    runs, script = _fake(monkeypatch, tmp_path, ref_s=100.0)
    v = cert.certify(cert.CertifyConfig(script=script, budget_s=60), tmp_path)
    assert runs == [] and v["verdict"] == "INCOMPLETE" and v["not_run"] == list(PHASES)


def _certify(script: Path, tmp_path: Path, *args: str) -> tuple[int, dict]:
    p = subprocess.run(
        [sys.executable, "-m", "faultkit.cli", "certify", "--nproc-per-node", "2",
         "--phases", "compute,update", "--json", "--workdir", str(tmp_path / "runs"),
         "--", str(script), "--iterations", "6", *args],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert p.stdout, p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.integ
@pytest.mark.timeout(420)
def test_certify_names_the_divergence_of_a_loader_not_handed_over(tmp_path):
    code, v = _certify(NOT_HANDED, tmp_path, "--data", "shards")
    assert (code, v["verdict"]) == (1, "NOT EXACT"), v
    first = v["faults"][0]
    # The recovered rank read shard 0 again: its first loss after the kill differs.
    assert first["diverged_after"] and first["phase"] == "compute"
    assert v["first_divergence"].startswith(f"rank {first['rank']} iteration {first['iteration']}")
    assert "'loss' differs" in v["first_divergence"]
    assert v["hint"] == cert.HINT_DATA and "data=loader" in v["hint"]
    # The log the script opens with "w": emptied by the promoted trainers, and said.
    assert v["files_truncated"] and all(
        Path(f).name in ("train0.log", "train1.log") for f in v["files_truncated"]
    ), v["files_truncated"]


def test_the_reference_runs_line_does_not_count_a_users_scripts_iterations(
    monkeypatch, tmp_path, caplog
):
    # certify's config holds a placeholder count until the reference run has told it;
    # its first progress line said "1 iterations" for a 24-iteration script.
    import logging

    from faultkit import inject

    monkeypatch.setattr(inject, "_run", lambda cfg, out: {"run_s": 0.0})
    cfg = cert.CertifyConfig(script=str(tmp_path / "train.py"), nproc_per_node=2)
    with caplog.at_level(logging.INFO, logger="faultkit"):
        inject.reference_run(cfg.inject_config(), tmp_path)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "train.py, 2 ranks, the script's own iterations" in said, said
    assert "1 iterations" not in said, said
