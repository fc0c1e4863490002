"""``LETO_PROFILE_RECOVERY``'s profiles (``leto.trainer.profiling``): the recovery until
training resumes, and exactly one iteration per process — a recovered trainer's first,
a first-generation trainer's third — with the hang detection relaxed only meanwhile."""

from __future__ import annotations

import json

import pytest
import torch

from leto.trainer.profiling import Profiles

CPU = torch.device("cpu")


def _iterations(p: Profiles, n: int) -> list[int]:
    changes = []
    for _ in range(n):
        changes.append(p.beat())
        (torch.ones(32, 32) @ torch.ones(32, 32)).sum()  # an iteration's work
    return changes


def test_a_recovered_trainer_profiles_its_recovery_and_its_first_iteration(tmp_path):
    p = Profiles(str(tmp_path), rank=1, generation=2, device=CPU)
    p.start_recovery()
    torch.ones(8).sum()
    p.recovery_done()
    assert _iterations(p, 4) == [1, -1, 0, 0]
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "rank1.gen2.iteration.txt",
        "rank1.gen2.profile.txt",
        "rank1.gen2.trace.json",
    ]
    assert "aten::mm" in (tmp_path / "rank1.gen2.iteration.txt").read_text()


def test_the_recovery_profile_runs_through_the_first_iteration(tmp_path):
    # As a promoted trainer runs it: the recovery's cProfile is still on when the first
    # iteration's window opens (one cProfile at a time), and ends after that iteration.
    p = Profiles(str(tmp_path), rank=0, generation=1, device=CPU)
    p.start_recovery()
    assert _iterations(p, 2) == [1, -1]
    p.recovery_done()
    assert "_iterations" in (tmp_path / "rank0.gen1.profile.txt").read_text()
    assert "aten::mm" in (tmp_path / "rank0.gen1.iteration.txt").read_text()


def test_a_first_generation_trainer_profiles_its_third_iteration_only(tmp_path):
    p = Profiles(str(tmp_path), rank=0, generation=0, device=CPU)
    p.recovery_done()  # (never started: nothing written)
    assert _iterations(p, 6) == [0, 0, 1, -1, 0, 0]
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "rank0.gen0.iteration.txt",
        "rank0.gen0.trace.json",
    ]


def test_the_loop_end_closes_an_open_window_before_the_end_of_training_work(tmp_path):
    # A recovered trainer whose first iteration is the job's last: the end-of-training
    # scrub and the final state's copy come after the loop and are not an iteration's.
    p = Profiles(str(tmp_path), rank=0, generation=1, device=CPU)
    assert _iterations(p, 1) == [1]
    assert p.loop_ended() == -1
    torch.linalg.qr(torch.ones(16, 16))  # end-of-training work
    assert p.loop_ended() == 0  # nothing open any more
    text = (tmp_path / "rank0.gen1.iteration.txt").read_text()
    assert "aten::mm" in text and "linalg_qr" not in text, text


def test_a_window_traces_the_iterations_it_names_with_leto_ranges(tmp_path):
    # LETO_PROFILE_WINDOW=2:3: iterations 2, 3 and 4; the trace holds Leto's named ranges.
    from leto.ranges import leto_range

    p = Profiles(str(tmp_path), rank=0, generation=0, device=CPU, window="2:3")
    changes = []
    for _ in range(6):
        changes.append(p.beat())
        with leto_range("update"):
            torch.ones(4).sum()
    assert changes == [0, 1, 0, 0, -1, 0]
    trace = json.loads((tmp_path / "rank0.gen0.trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert names.count("leto.update") == 3, names


def test_a_window_that_is_not_first_colon_count_is_refused_saying_so():
    for bad in ("3", "0:1", "2:0", "a:b"):
        with pytest.raises(ValueError, match="LETO_PROFILE_WINDOW"):
            Profiles("x", rank=0, generation=0, device=CPU, window=bad)


def test_leto_ranges_cost_nothing_but_a_check_with_no_profiler():
    from leto.ranges import leto_range

    assert leto_range("update") is leto_range("scrub")  # the one shared null context
