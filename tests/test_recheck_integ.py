"""The alarm policy end to end, under ``leto run``: an update recheck whose own
computation is wrong the same way in every generation (a software mistake, planted by
``tests/scripts/wrong_recheck.py``) costs one rollback, is settled by a third computation,
switched off with one console line naming its evidence — and the job goes on to the
torchrun run's bytes, with no device recorded as faulty. The console also says, once at
the start, where every check stands on the job."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from bench.zoo.__main__ import first_difference, leto, torchrun
from faultkit.job import POOL
from leto.integrity.faulty import FILE as FAULTY_FILE
from leto.integrity.recheck import ENV_UPDATE_RECHECK

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integ
@pytest.mark.timeout(300)
def test_a_check_wrong_twice_is_switched_off_and_no_device_is_named(tmp_path):
    args = argparse.Namespace(nproc_per_node=1, size="tiny", iterations=4, device="cpu",
                              timeout_s=240)  # fmt: skip
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **{ENV_UPDATE_RECHECK: "all"})
    torchrun(args, "two-optimizers", tmp_path / "ref", env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["LETO_PLUGINS"] = "tests.scripts.wrong_recheck"
    got = leto(args, "two-optimizers", tmp_path / "leto", env, POOL)
    console = (tmp_path / "leto" / "leto-run.log").read_text()
    assert got["code"] == 0, console[-3000:]
    assert [r["class"] for r in got["recoveries"]] == ["FF"], got["recoveries"]
    assert console.count("update recheck off for the rest of the job") == 1, console[-3000:]
    assert "recheck-evidence.json" in console
    # Where every check stands, once, at the start (world 1: no replica; replay needs one).
    said = [x for x in console.splitlines() if "checks: replica check" in x]
    assert len(said) == 1 and "update recheck: on (every chunk)" in said[0], said
    assert "gradient replay: off" in said[0] and "loss guard: on" in said[0], said
    assert "undo copies: per chunk, before its update" in said[0], said
    # The script clips (one rank): its clip took the gradients' parity (leto.update.grad_clip).
    assert "gradient parity: in clip_grad_norm_'s pass over them (CPU twin)" in said[0], said
    logs = "".join(p.read_text() for p in (tmp_path / "leto" / "logs").glob("rank0.gen*.log"))
    assert "gradient parity from the clip's pass at 3 of 3 steps" in logs, logs[-2000:]
    assert not (tmp_path / "leto" / "logs" / FAULTY_FILE).exists()
    assert got["faulty"] == []
    recs = (tmp_path / "leto" / "train" / "rank0.recheck.jsonl").read_text().splitlines()
    assert [json.loads(x).get("settled") for x in recs] == [None, "recheck"], recs
    why = first_difference(tmp_path / "ref", tmp_path / "leto" / "train", 1)
    assert why is None, why
