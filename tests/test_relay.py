"""The script's output on ``leto run``'s console (``leto.launch.relay``): each rank's
lines prefixed as torchrun's, Leto's own rank-log lines kept out (or shown once, marked),
a promoted trainer's log followed from its start after the old one's last lines, a
partial last line shown at the end, ``--local-ranks-filter`` obeyed; and end to end, a
trainer SIGKILLed mid-iteration loses no line it printed."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from faultkit.job import JobFault, run_job
from leto.launch.relay import Relay
from leto.rank_log import MARK, SHOWN
from leto.workload.train import TrainConfig

SCRIPT = Path(__file__).resolve().parent / "scripts" / "chatty.py"


def _cell(tmp_path: Path, rank: int, gen: int = 0, role: str = "active"):
    return SimpleNamespace(
        rank=rank, local_rank=rank, log_dir=tmp_path, active=object(),
        active_role=role, active_generation=gen,
    )  # fmt: skip


def _log(tmp_path: Path, rank: int, text: str, gen: int = 0, role: str = "active") -> None:
    with open(tmp_path / f"rank{rank}.gen{gen}.{role}.log", "a") as f:
        f.write(text)


def test_lines_are_prefixed_and_leto_lines_kept_in_the_log(tmp_path):
    cells = [_cell(tmp_path, 0), _cell(tmp_path, 1)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=2)
    _log(tmp_path, 0, f"hello\n{MARK}rank 0: chunk updates: CPU twin\n{SHOWN}rank 0: found\n")
    _log(tmp_path, 1, "a line in the mak")
    relay.poll()
    assert out.getvalue() == "[rank0]:hello\nleto: rank 0: found\n"
    _log(tmp_path, 1, "ing\n")
    relay.poll()
    assert out.getvalue().endswith("[rank1]:a line in the making\n")


def test_one_rank_has_no_prefix_and_a_partial_last_line_is_shown_at_the_end(tmp_path):
    cells = [_cell(tmp_path, 0)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=1)
    _log(tmp_path, 0, "x\nbye")
    relay.poll()
    assert out.getvalue() == "x\n"
    relay.poll(final=True)
    assert out.getvalue() == "x\nbye\n"


def test_a_promoted_trainer_is_followed_after_the_old_ones_last_lines(tmp_path):
    cell = _cell(tmp_path, 0)
    out = io.StringIO()
    relay = Relay([cell], out, world_size=2)
    _log(tmp_path, 0, "it 1\n")
    relay.poll()
    _log(tmp_path, 0, "it 2\nhalf")  # then it is killed
    _log(tmp_path, 0, "start\n", gen=1, role="shadow")
    cell.active_role, cell.active_generation = "shadow", 1  # promoted
    relay.poll()
    assert out.getvalue() == "[rank0]:it 1\n[rank0]:it 2\n[rank0]:half\n[rank0]:start\n"


def test_only_the_filtered_local_ranks_are_shown(tmp_path):
    cells = [_cell(tmp_path, 0), _cell(tmp_path, 1)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=2, ranks=(1,))
    _log(tmp_path, 0, "zero\n")
    _log(tmp_path, 1, "one\n")
    relay.poll()
    assert out.getvalue() == "[rank1]:one\n"


def test_a_bad_local_ranks_filter_is_refused_before_anything_starts(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "leto.cli", "run", "--nproc-per-node", "2",
         "--local-ranks-filter", "0,2", str(SCRIPT)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 2
    assert "--local-ranks-filter 0,2: local ranks are 0..1" in p.stderr


@pytest.mark.integ
@pytest.mark.timeout(240)
def test_a_killed_trainer_loses_no_line_it_printed(tmp_path):
    # (and a second entry past the loop's end, said when the loop starts)
    faults = [JobFault(rank=1, at="compute.backward@2#1"), JobFault(rank=0, at="sync@40#1")]
    got = run_job(2, TrainConfig(), tmp_path, faults, script=SCRIPT, script_args=[], timeout_s=200)
    assert got["code"] == 0 and got["injections"] == 1
    console = (tmp_path / "leto-run.log").read_text()  # leto run --json: on stderr
    assert "(rank 0 at sync@40#1) cannot fire: the loop ends before iteration 40" in console
    lines = console.splitlines()
    # The killed trainer printed "it 2" (before its backward) and died; the promoted one
    # started over and printed it again: both on the console, nothing buffered away.
    assert lines.count("[rank1]:it 2 rank 1") == 2, console
    assert lines.count("[rank1]:start rank 1") == 2, console
    for t in range(6):
        assert f"[rank0]:it {t} rank 0" in lines and f"[rank1]:note {t}" in lines
    assert lines.count("[rank0]:bye") == 1 and lines.count("[rank1]:bye") == 1
    assert "rank 0: chunk updates" not in console  # Leto's own lines stay in the rank logs


GLOO_BROKEN = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 40, in <module>\n'
    "    loss.backward()\n"
    "    ^^^^^^^^^^^^^^^\n"
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:41234: Connection reset by peer\n"
)
SCRIPT_ERROR = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 12, in <module>\n'
    "    raise ValueError('bad batch')\n"
    "ValueError: bad batch\n"
)


def test_a_collective_a_failed_peer_broke_is_one_leto_line_not_a_traceback(tmp_path):
    cells = [_cell(tmp_path, 0), _cell(tmp_path, 1)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=2)
    _log(tmp_path, 1, "step 3\n" + GLOO_BROKEN[:90])  # split mid-traceback across polls
    relay.poll()
    assert out.getvalue() == "[rank1]:step 3\n"  # held: not yet known which it is
    _log(tmp_path, 1, GLOO_BROKEN[90:] + "after\n")
    relay.poll()
    text = out.getvalue()
    assert "Traceback" not in text and "pair.cc" not in text.split("(")[0], text
    assert "leto: rank 1: a collective broke when a peer failed (RuntimeError:" in text, text
    assert "rank1.gen0.active.log" in text and text.endswith("[rank1]:after\n"), text


def test_the_scripts_own_error_is_shown_in_full(tmp_path):
    cells = [_cell(tmp_path, 0), _cell(tmp_path, 1)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=2)
    _log(tmp_path, 0, SCRIPT_ERROR)
    relay.poll()
    want = "".join(f"[rank0]:{ln}\n" for ln in SCRIPT_ERROR.splitlines())
    assert out.getvalue() == want


def test_a_traceback_cut_off_by_the_end_is_shown_as_it_is(tmp_path):
    cells = [_cell(tmp_path, 0)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=1)
    _log(tmp_path, 0, "Traceback (most recent call last):\n  File \"x.py\", line 1\n")
    relay.poll()
    assert out.getvalue() == ""
    relay.poll(final=True)
    assert out.getvalue() == 'Traceback (most recent call last):\n  File "x.py", line 1\n'


def test_torchs_own_rank_prefix_does_not_hide_a_broken_collective(tmp_path):
    # torch prints a distributed rank's uncaught exception with "[rank<r>]: " itself.
    cells = [_cell(tmp_path, 0), _cell(tmp_path, 1)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=2)
    _log(tmp_path, 0, "".join(f"[rank0]: {ln}\n" for ln in GLOO_BROKEN.splitlines()))
    relay.poll()
    text = out.getvalue()
    assert "Traceback" not in text and "a collective broke when a peer failed" in text, text


def test_the_same_error_from_a_promoted_trainer_is_not_shown_twice(tmp_path):
    cells = [_cell(tmp_path, 0)]
    out = io.StringIO()
    relay = Relay(cells, out, world_size=1)
    _log(tmp_path, 0, SCRIPT_ERROR)
    relay.poll()
    cells[0].active_generation, cells[0].active_role = 1, "shadow"  # promoted
    _log(tmp_path, 0, "starting\n" + SCRIPT_ERROR, gen=1, role="shadow")
    relay.poll(final=True)
    text = out.getvalue()
    assert text.count("Traceback") == 1 and text.count("raise ValueError") == 1, text
    assert "leto: rank 0: the same error again (ValueError: bad batch)" in text, text
    assert "rank0.gen1.shadow.log" in text and "starting\n" in text, text
