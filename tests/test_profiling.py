"""``LETO_PROFILE_RECOVERY``'s profiles (``leto.runtime.profiling``): the recovery until
training resumes, and exactly one iteration per process — a recovered trainer's first,
a first-generation trainer's third — with the hang detection relaxed only meanwhile."""

from __future__ import annotations

import torch

from leto.runtime.profiling import Profiles

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
    ]
    assert "aten::mm" in (tmp_path / "rank1.gen2.iteration.txt").read_text()


def test_a_first_generation_trainer_profiles_its_third_iteration_only(tmp_path):
    p = Profiles(str(tmp_path), rank=0, generation=0, device=CPU)
    p.recovery_done()  # (never started: nothing written)
    assert _iterations(p, 6) == [0, 0, 1, -1, 0, 0]
    assert [f.name for f in tmp_path.iterdir()] == ["rank0.gen0.iteration.txt"]


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
