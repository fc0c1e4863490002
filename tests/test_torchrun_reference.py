"""tests.torchrun_reference: a reference run that fails once is run again in a fresh
place and that one is taken; three failures fail the test with every run's end."""

from __future__ import annotations

import subprocess

import pytest

from tests import torchrun_reference


def test_a_failed_reference_runs_again_and_a_third_failure_fails(monkeypatch):
    seen = []

    def once_aborted(argv, **kwargs):
        seen.append(argv[-1])
        if len(seen) == 1:  # plain torch + gloo's abort at its exit (SIGABRT)
            raise subprocess.CalledProcessError(-6, argv, "", "first")

    monkeypatch.setattr(torchrun_reference.subprocess, "run", once_aborted)
    assert torchrun_reference.run("a job", lambda a: ["job.py", f"--out=o{a}"]) == 1
    assert seen == ["--out=o0", "--out=o1"]

    def always(argv, **kwargs):
        raise subprocess.CalledProcessError(-6, argv, "", f"abort {argv[-1]}")

    monkeypatch.setattr(torchrun_reference.subprocess, "run", always)
    with pytest.raises(pytest.fail.Exception) as e:
        torchrun_reference.run("a job", lambda a: ["job.py", f"--out=o{a}"])
    assert all(f"abort --out=o{a}" in str(e.value) for a in range(3)), str(e.value)
