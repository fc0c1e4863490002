"""The console scripts answer and tell the truth about the machine."""

from __future__ import annotations

import json

from faultkit.cli import main as faultkit_main
from leto.cli import main as leto_main
from leto.memory.mechanisms import Mechanism, kernel_has_memory_failure


def test_leto_info_json(capsys):
    assert leto_main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["field_poly"] == "0x1002d"
    assert "cpu" in info["codec_kernels"]


def test_faultkit_probe_reports_the_emulation_when_hwpoison_is_missing(capsys):
    assert faultkit_main(["probe", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    if not kernel_has_memory_failure():
        assert m["host_poison"] == Mechanism.MEMFD_TRUNCATE
        assert "CONFIG_MEMORY_FAILURE" in m["host_poison_why"]


def test_leto_run_refuses_no_checkpoints_beside_what_needs_them(capsys, tmp_path):
    script = str(tmp_path / "never_started.py")
    for extra, says in [
        (["--recovery", "checkpoint"], "--recovery checkpoint restarts from checkpoints"),
        (["--checkpoint-dir", str(tmp_path)], "with --no-checkpoints: choose one"),
    ]:
        assert leto_main(["run", "--no-checkpoints", *extra, script]) == 2
        assert says in capsys.readouterr().err


def test_leto_run_refuses_a_bad_fault_plan_before_anything_starts(capsys, tmp_path, monkeypatch):
    import time

    script = tmp_path / "never_started.py"
    script.write_text("raise SystemExit('the script ran')\n")
    ok = {"generation": 0, "rank": 0, "at": "update.optimizer@1#1"}
    cases = [
        ({**ok, "pages": 3}, "unknown key(s) ['pages']; the keys are generation, rank, at"),
        ({**ok, "lose_pages": 2}, "pass --allow-fault-injection"),
        ({**ok, "rank": 2}, "rank 2 is not in 0..0"),
        ({**ok, "at": "update.optimizer"}, "expected NAME@ITERATION or NAME@ITERATION#N"),
        (
            {**ok, "at": "update.optimiser@3#1"},
            "no fault point is named 'update.optimiser' (did you mean update.optimizer",
        ),
        ({**ok, "lose_pages": "2"}, "lose_pages='2' is not a int"),
        ({"rank": 0, "at": "sync@1"}, "missing ['generation']"),
        ({**ok, "when": "later"}, "when='later': use now or parked"),
    ]
    for entry, says in cases:
        monkeypatch.setenv("LETO_FAULT_PLAN", json.dumps([entry]))
        t0 = time.time()
        got = leto_main(
            ["run", "--device", "cpu", "--log-dir", str(tmp_path / "logs"), str(script)]
        )
        err = capsys.readouterr().err
        assert got == 2 and says in err, (entry, got, err)
        assert time.time() - t0 < 5, f"refused only after {time.time() - t0:.1f} s"


def test_leto_info_names_the_cpu_codec_that_runs(capsys, monkeypatch):
    from leto.erasure.kernels import cpu

    def said() -> str:
        cpu.native.cache_clear()
        assert leto_main(["info", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["codec_kernels"]["cpu"]

    monkeypatch.setenv(cpu.ENV_CPU_CODEC, "numpy")
    assert "NumPy" in (got := said()), got
    monkeypatch.delenv(cpu.ENV_CPU_CODEC)
    got = said()
    want = "the C kernel gf_cpu.c" if cpu.native() is not None else "NumPy"  # (no compiler)
    assert want in got, got
    cpu.native.cache_clear()


def test_an_unknown_undo_mode_is_refused_before_anything_starts(capsys, tmp_path):
    import pytest

    from leto.job.config import RunConfig

    with pytest.raises(ValueError, match=r"--undo 'later': use chunk or ahead"):
        RunConfig(undo="later")
    script = str(tmp_path / "never_started.py")
    for main, argv in ((leto_main, ["run"]), (faultkit_main, ["certify"])):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--undo", "later", script])
        assert e.value.code == 2
        assert "--undo: invalid choice: 'later'" in capsys.readouterr().err
