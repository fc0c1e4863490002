"""faultkit's job starter (``faultkit.job.run_job``) when the free port it picked is taken
before ``leto run`` binds it — by a job beside it, or an outgoing connection's ephemeral
port (CI runs the matrices beside the test suite): ``leto run`` refuses the busy port
and starts nothing, and the job is started again on another port."""

from __future__ import annotations

import socket

import pytest

from faultkit import job
from leto.job.store import free_port
from leto.workload.train import TrainConfig

pytestmark = [pytest.mark.integ, pytest.mark.timeout(180)]


def test_a_port_taken_before_leto_run_binds_it_is_replaced(tmp_path, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        picked = [busy.getsockname()[1]]  # the first pick: taken

        def pick():
            picked.append(free_port())
            return picked[-2]

        monkeypatch.setattr(job, "free_port", pick)
        summary = job.run_job(2, TrainConfig(iterations=2), tmp_path, shadow_level="off")
    assert len(picked) >= 3, "started once only: the taken port was not replaced"
    assert summary["failures"] == 0 and len(summary["losses"][0]) == 2, summary
