"""A ``--verify`` run whose script never calls ``run.record_loss`` says so once in the
trainer's log (the trace's losses are NaN), naming the call; without verification it
says nothing. (``tests/test_nanogpt.py`` sees the line in a real run: nanoGPT records no
loss.)"""

from __future__ import annotations

from types import SimpleNamespace

from leto.trainer.retained import RetainedTraining


def _job(verifying: bool):
    job = SimpleNamespace(rank=1, _said_no_loss=False, told=[])
    job.on_iteration = (lambda *a: None) if verifying else None
    job.on_no_loss = lambda: job.told.append(1)  # leto.Run: counted in the job's store
    return job


def test_a_missing_loss_under_verification_is_reported_once(capsys):
    job = _job(verifying=True)
    for t in range(3):
        RetainedTraining._no_loss(job, t)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "rank 1: warning: iteration 0 committed without a loss" in err, err
    assert "run.record_loss(loss)" in err and "NaN" in err, err
    assert job.told == [1], "the agent was not told (once)"


def test_a_missing_loss_without_verification_is_not_reported(capsys):
    job = _job(verifying=False)
    RetainedTraining._no_loss(job, 0)
    assert capsys.readouterr().err == "" and job.told == []
