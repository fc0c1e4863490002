"""Faulty devices (``leto.integrity.faulty``): a GPU the checks named twice is reported and,
with ``--exclude-faulty``, left out of a restart. The agent's side, on the error files the
trainers write; the trainers' side (the error file's ``named``) is in test_monitor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from leto.errors import InvalidInput
from leto.integrity import faulty
from leto.job.config import RunConfig
from leto.launch.agent import Agent
from leto.launch.monitor import Failure, FailureKind


def _error(exception: str, iteration: int, named: list[int]) -> dict:
    return {"exception": exception, "message": "m", "traceback": "", "iteration": iteration,
            "named": named}  # fmt: skip


def test_a_device_is_faulty_when_two_detections_name_it():
    t = faulty.Tally("node-a", {0: "cuda:0", 1: "cuda:1"})
    # Every rank's error file reports the same replay mismatch: one detection.
    assert t.observe(0, [_error("ReplayMismatch", 2, [1])] * 2) == []
    assert t.observe(0, [None, {"exception": "ValueError", "message": "x"}]) == []
    # The same iteration again after its redo is a second computation gone wrong.
    (rec,) = t.observe(1, [_error("ReplayMismatch", 2, [1])])
    assert rec["node"] == "node-a" and rec["rank"] == 1 and rec["device"] == "cuda:1"
    assert [d["generation"] for d in rec["detections"]] == [0, 1]
    assert t.observe(2, [_error("WrongUpdate", 5, [1])]) == []  # reported once
    assert [r["rank"] for r in t.faulty()] == [1]


def test_only_this_nodes_devices_are_reported():
    t = faulty.Tally("node-b", {2: "cuda:0", 3: "cuda:1"})
    t.observe(0, [_error("ReplicaDisagreement", 4, [0])])
    assert t.observe(1, [_error("ReplicaDisagreement", 9, [0])]) == []
    assert t.faulty() == []


def test_the_record_round_trips_and_picks_the_gpus_left(tmp_path, monkeypatch):
    faulty.append(tmp_path, [{"node": "a", "rank": 1, "device": "cuda:1", "detections": []}])
    faulty.append(tmp_path, [{"node": "b", "rank": 0, "device": "cuda:0", "detections": []}])
    assert faulty.excluded(tmp_path, "a") == {"1"}
    assert faulty.excluded(tmp_path / "none", "a") == set()
    assert faulty.visible_devices(["0", "1", "2"], {"1"}, 2) == "0,2"
    with pytest.raises(InvalidInput, match=r"leave 1 for 2 rank\(s\) a node; nothing started"):
        faulty.visible_devices(["0", "1"], {"1"}, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert faulty.node_gpus() == ["3", "5"]
    assert faulty.device_of("cuda", 1) == "cuda:5" and faulty.device_of("cpu", 1) == "cpu"
    # --ranks-per-gpu 2: local ranks 0 and 1 share the first visible GPU, 2 and 3 the next.
    assert [faulty.device_of("cuda", lr, 2) for lr in range(4)] == ["cuda:3"] * 2 + ["cuda:5"] * 2
    assert faulty.visible_devices(["0", "1", "2"], {"1"}, 4, ranks_per_gpu=2) == "0,2"
    with pytest.raises(InvalidInput, match=r"leave 1 for 4 rank\(s\) a node, 2 a GPU"):
        faulty.visible_devices(["0", "1"], {"1"}, 4, ranks_per_gpu=2)
    (tmp_path / faulty.FILE).write_text('{"not": "a list"}')
    with pytest.raises(InvalidInput, match="not a list of faulty-device records"):
        faulty.excluded(tmp_path, "a")


@pytest.mark.parametrize("exclude", [False, True])
def test_the_agent_reports_a_device_named_twice_and_stops_only_if_asked(tmp_path, exclude):
    agent = Agent(
        RunConfig(nproc_per_node=2, log_dir=str(tmp_path), exclude_faulty=exclude), ["t.py"]
    )
    agent._place()
    dead = [Failure(0, FailureKind.EXIT, 13, _error("WrongUpdate", 3, [0]))]
    assert agent._faulty(0, dead) is None and not (tmp_path / faulty.FILE).exists()
    why = agent._faulty(1, [Failure(0, FailureKind.EXIT, 13, _error("WrongUpdate", 7, [0]))])
    (rec,) = json.loads((tmp_path / faulty.FILE).read_text())
    assert rec["rank"] == 0 and rec["device"] == "cpu"
    assert [d["iteration"] for d in rec["detections"]] == [3, 7]
    assert agent.summary(1)["faulty"] == [rec]
    if exclude:
        assert "named as computing wrong twice: iteration 3" in why, why
        assert "the job stops, keeping its checkpoints" in why, why
    else:
        assert why is None


def test_leto_run_refuses_an_unreadable_faulty_devices_file_and_starts_nothing(tmp_path):
    import subprocess
    import sys

    (tmp_path / faulty.FILE).write_text('{"x": 1}')
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    r = subprocess.run(
        [sys.executable, "-m", "leto.cli", "run", "--exclude-faulty", "--device", "cpu",
         "--log-dir", str(tmp_path), str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "is not a list of faulty-device records" in r.stderr, r.stderr
    assert "nothing was excluded and nothing started" in r.stderr, r.stderr


def test_a_fault_plan_entry_that_never_fired_is_reported(tmp_path, monkeypatch, capsys):
    from leto.launch.recovery import FailureClass, RecoveryRecord
    from leto.run_cli import _print_summary

    plan = [{"generation": 0, "rank": 0, "at": "update.optimizer@2#1"},
            {"generation": 1, "rank": 1, "at": "sync@40#1"}]  # fmt: skip
    monkeypatch.setenv("LETO_FAULT_PLAN", json.dumps(plan))
    cfg = RunConfig(nproc_per_node=2, log_dir=str(tmp_path), allow_fault_injection=True)
    agent = Agent(cfg, ["t.py"])
    agent._place()
    agent.records = [RecoveryRecord(0, FailureClass.HOF, 0.0, 0.0, 0.0, "L2", [0, 1])]
    summary = agent.summary(1)
    assert [f["generation"] for f in summary["unfired_faults"]] == [1]
    summary["measured"] = {"ettr": None, "why": "test"}
    _print_summary(summary, cfg, 0)
    err = capsys.readouterr().err
    assert "fault-plan entry for generation 1 (rank 1 at sync@40#1" in err, err
    assert err.count("never fired") == 1, err  # the entry that struck is not listed


def test_an_entry_past_the_loops_end_is_named_with_the_loops_end():
    from leto.job.fault_plan import past_the_end

    plan = [{"generation": 0, "rank": 0, "at": "update.optimizer@2#1"},
            {"generation": 1, "rank": 1, "at": "sync@40#1"},
            {"generation": 2, "rank": 0, "at": "compute.forward@12"}]  # fmt: skip
    said = past_the_end(plan, 12)
    assert len(said) == 2, said
    assert "generation 1 (rank 1 at sync@40#1) cannot fire" in said[0]
    assert "before iteration 40 (it runs iterations below 12)" in said[0]
    assert "compute.forward@12" in said[1]  # the loop's end is exclusive
    assert past_the_end(plan, 41) == []


def test_a_set_up_run_ahead_is_said_below_the_recovery_table(tmp_path, capsys):
    from leto.run_cli import _print_summary

    cfg = RunConfig(nproc_per_node=2, log_dir=str(tmp_path))
    trainers = {
        "0": {"resume_s": 0.2, "ran_ahead_to": "reached leto.Run", "ran_ahead_s": 0.4},
        "1": {"resume_s": 0.1, "ran_ahead_to": "opens /x/train.log for writing"},
    }
    summary = {
        "failures": 1, "measured": {"ettr": None, "why": "test"},
        "recoveries": [{"class": "HOF", "failed_ranks": [1], "level": "L3", "recovery_s": 0.3,
                        "fencing_s": 0.01, "promotion_s": 0.02, "trainers": trainers}],
    }  # fmt: skip
    _print_summary(summary, cfg, 0)
    out = " ".join(capsys.readouterr().out.split())  # (the notes are wrapped at 78)
    assert "2 of 2 promoted trainer(s) had run the script's set-up ahead while parked" in out
    assert "to where it opens /x/train.log for writing / reached leto.Run" in out
    summary["recoveries"][0]["trainers"] = {"0": {"resume_s": 0.2}}
    _print_summary(summary, cfg, 0)
    assert "set-up ahead" not in capsys.readouterr().out


def test_the_pages_a_fault_plan_took_are_said_in_words():
    from leto.launch.recovery import said_lost

    text = said_lost({"device": 66, "host": 1, "short": [[1, 2, 3]]})
    assert "66 device page(s) (all ranks' protection groups together)" in text
    assert "1 host parity page(s)" in text and "rank 1 group 2 (3 pages)" in text
    assert "{" not in text


def test_more_ranks_than_the_gpus_take_are_refused_before_anything_starts(tmp_path):
    faulty.enough_gpus(["0", "1"], 2)
    faulty.enough_gpus(["0"], 2, ranks_per_gpu=2)
    with pytest.raises(
        InvalidInput, match=r"--nproc-per-node 3 needs 3 GPU\(s\), and this node has 2"
    ):
        faulty.enough_gpus(["0", "1"], 3)
    # What `leto run` says, on the CPU: one GPU visible, three ranks two a GPU.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    got = subprocess.run(
        [sys.executable, "-m", "leto.cli", "run", "--device", "cuda", "--nproc-per-node", "3",
         "--ranks-per-gpu", "2", "--log-dir", str(tmp_path / "logs"),
         "examples/train_gpt.py", "--iterations", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert got.returncode == 2, got.stderr[-2000:]
    assert "--nproc-per-node 3, 2 a GPU needs 2 GPU(s), and this node has 1 (0," in got.stderr
    assert "nothing started" in got.stderr and "--ranks-per-gpu 3" in got.stderr
    assert not (tmp_path / "logs" / "rank0.gen0.active.log").exists()
