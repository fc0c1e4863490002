"""A parked L3 shadow running the script's set-up ahead (leto.trainer.run_ahead): it
waits for its promotion at the first step that could change something outside its
process — a file written, a process started, a connection, a collective — and at
leto.Run; the script's output is held until then; a failure turns it off for the job;
it runs only once its trainer finished an iteration, with room, and when every rank
can."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from leto.job import keys
from leto.trainer import run_ahead


@pytest.fixture
def ahead(monkeypatch):
    """An Ahead (not started: the test's own files first) whose promotion is recorded,
    not awaited; undone after the test."""
    monkeypatch.setattr(run_ahead, "_state", {**run_ahead._state, "ahead": None})
    store = dist.HashStore()
    promotions = []
    a = run_ahead.Ahead(5, lambda: promotions.append(a.stopped_at), store)
    a.promotions = promotions
    yield a
    a._unhook()
    a._release()


@pytest.mark.parametrize(
    "event, args, said",
    [
        ("open", ("/x/train.log", "w", 0), "opens /x/train.log for writing"),
        ("open", ("/x/train.log", "a", 0), "opens /x/train.log for writing"),
        ("open", ("/x/data.bin", "r+b", 0), "opens /x/data.bin for writing"),
        ("open", ("/x/new", None, os.O_CREAT | os.O_WRONLY), "opens /x/new for writing"),
        ("open", ("/x/data.bin", "rb", 0), None),
        ("open", ("/x/data.bin", None, os.O_RDONLY), None),
        ("open", ("/x/__pycache__/m.cpython-311.pyc.123", None, os.O_CREAT | os.O_WRONLY), None),
        ("open", (os.devnull, "w", 0), None),
        ("os.remove", ("/x/ckpt.pt", -1), "removes /x/ckpt.pt"),
        ("os.rename", ("/x/a", "/x/b", -1, -1), "renames /x/a"),
        ("os.mkdir", ("/", 0o777, -1), None),  # a folder that is there: makedirs(exist_ok)
        ("os.mkdir", ("/no/such/folder/here", 0o777, -1), "makes the folder /no/such/folder/here"),
        ("subprocess.Popen", ("git", ["git"], None, None), "starts a subprocess"),
        ("socket.connect", (None, ("10.0.0.1", 443)), "opens a network connection"),
        ("os.fork", (), "forks"),
        ("os.listdir", ("/x",), None),
        ("import", ("json", None, [], [], []), None),
    ],
)
def test_what_counts_as_a_step_outside_the_process(event, args, said):
    assert run_ahead._side_effect(event, args) == said


def test_a_file_opened_for_writing_waits_for_the_promotion(ahead, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("the live trainer's lines\n")
    before = []

    def promoted():  # what the file holds when the promotion comes
        before.append(log.read_text())
        ahead.promotions.append(ahead.stopped_at)

    ahead._promote = promoted
    ahead.start()
    log.read_text()  # reading is not a step outside
    torch.zeros(3).sum()
    assert ahead.promotions == []
    with open(log, "w") as f:
        f.write("the promoted trainer's lines\n")
    assert before == ["the live trainer's lines\n"], "the file was emptied before the promotion"
    assert ahead.promotions == [f"opens {log} for writing"]
    open(tmp_path / "other.log", "w").close()  # promoted: nothing waits any more
    assert len(ahead.promotions) == 1


def test_a_collective_waits_for_the_promotion(ahead):
    torchs = dist.barrier
    ahead.start()
    assert dist.barrier is not torchs and dist.all_reduce.__qualname__.startswith("_waits")
    with pytest.raises((ValueError, RuntimeError)):  # no process group in this test
        dist.barrier()
    assert ahead.promotions == ["calls torch.distributed.barrier"]
    assert dist.barrier is torchs, "the collectives are torch's again"


def test_a_subprocess_waits_for_the_promotion(ahead):
    ahead.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert ahead.promotions == ["starts a subprocess"]


def test_output_is_held_until_the_promotion(ahead, capsys):
    ahead.start()
    print("set-up: 6.6 M parameters")
    print("a warning", file=sys.stderr)
    assert capsys.readouterr() == ("", "")
    assert sys.stdout.isatty() is False and sys.stdout.encoding  # what libraries ask of it
    ahead.reach("reached leto.Run")
    out, err = capsys.readouterr()
    assert out == "set-up: 6.6 M parameters\n" and err == "a warning\n"
    assert sys.stdout is not ahead._held[0]


def test_a_failed_set_up_turns_it_off_for_the_job(ahead, capsys, monkeypatch):
    from leto.errors import EXIT_RECOVERABLE

    exits = []
    monkeypatch.setattr(run_ahead.os, "_exit", exits.append)  # (it would end pytest)
    ahead.start()
    try:
        raise ValueError("no such dataset")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    # A recoverable failure, not the script's error: the agent recovers the rank.
    assert exits == [EXIT_RECOVERABLE]
    off = ahead.store.get(keys.RUN_AHEAD_OFF).decode()
    assert "rank 5" in off and "ValueError: no such dataset" in off, off
    err = capsys.readouterr().err
    assert "running the script's set-up ahead failed" in err and "no such dataset" in err


def _gate(store, rank=0, world=2, room_bytes=0):
    return run_ahead.Gate(store, 3, "0.0", rank, world, torch.device("cpu"), lambda: room_bytes)


def test_it_runs_ahead_only_after_its_trainer_began_and_every_rank_agreed():
    store = dist.HashStore()
    a, b = _gate(store, 0), _gate(store, 1)
    assert not a.open(), "its trainer has not begun an iteration: the pool may be empty"
    store.set(keys.pace(2, 0), '{"iteration": 4}')
    assert not a.open(), "its trainer's memory is at its peak only once an iteration is over"
    store.set(keys.pace(2, 0), '{"iteration": 5}')
    assert not a.open(), "rank 1's shadow has not agreed"
    store.set(keys.pace(2, 1), '{"iteration": 4}')
    assert not b.open()
    store.set(keys.pace(2, 1), '{"iteration": 5}')
    assert b.open() and a.open()
    assert int(store.add(keys.run_ahead(3, "0.0"), 0)) == 2, "each rank counted once"


def test_no_room_or_a_failure_anywhere_keeps_every_shadow_parked(capsys):
    store = dist.HashStore()
    a, b = _gate(store, 0), _gate(store, 1, room_bytes=1 << 60)
    for it in (4, 5):
        store.set(keys.pace(2, 0), f'{{"iteration": {it}}}')
        store.set(keys.pace(2, 1), f'{{"iteration": {it}}}')
        b.open()
    a.open()  # (it saw its trainer's pace once: not moved yet, nothing else read)
    store.set(keys.pace(2, 0), '{"iteration": 6}')
    assert "below" in b.said  # an exabyte of state: no room
    assert not a.open() and "turned off for this job" in a.said and "rank 1" in a.said
    assert "parks at leto.init()" in capsys.readouterr().err


def test_without_the_pools_size_there_is_no_room():
    ok, why = run_ahead.room(torch.device("cpu"), None)
    assert not ok and "not premapped" in why
    assert run_ahead.room(torch.device("cpu"), 0)[0]  # (this machine has 2 GiB free)


def test_it_is_l3_only_and_can_be_turned_off(monkeypatch):
    assert run_ahead.wanted("L3") and not run_ahead.wanted("L2")
    monkeypatch.setenv(run_ahead.ENV_RUN_AHEAD, "0")
    assert not run_ahead.wanted("L3")


def test_the_scripts_own_write_waits_also_when_leto_started_the_script(ahead, tmp_path):
    # In a trainer Leto's launcher runs the script (runpy, from leto/launch/zygote.py), so
    # Leto's frames are below every frame of the script's: the innermost frame that is
    # not a library's decides whose step it is.
    script = tmp_path / "script.py"
    script.write_text(
        "import torch\n"
        "def set_up(path):\n"
        "    open(path, 'w').close()\n"  # the script's own log, emptied
        "    torch.save({}, path + '.pt')\n"  # written by a library on its behalf
    )
    namespace: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    launcher = str(Path(run_ahead.__file__).parent.parent / "launch" / "zygote.py")
    runs = compile("def launch(f, path):\n    f(path)\n", launcher, "exec")  # "Leto's" frame
    exec(runs, namespace)
    target = tmp_path / "train.log"
    ahead.start()
    namespace["launch"](namespace["set_up"], str(target))
    assert ahead.promotions == [f"opens {target} for writing"]


def _peers(world=2):
    """``world`` Aheads of one job's shadows sharing a store, their promotions recorded."""
    store = dist.HashStore()
    out = []
    for r in range(world):
        a = run_ahead.Ahead(
            r, None, store, world=world, key=keys.run_ahead(3, "0.0"),
            settled_key=keys.ahead_settled(3, r),
        )  # fmt: skip
        a.promotions = []
        a._promote = lambda a=a: a.promotions.append(a.stopped_at)
        out.append(a)
    return store, out


def test_a_collective_every_ranks_shadow_reaches_runs_ahead():
    # (The Ahead objects are driven directly: the collective is a stand-in call, made
    # only where every shadow agreed.)
    import threading

    store, (a, b) = _peers()
    made = []
    t = threading.Thread(target=lambda: made.append(b.collective("new_group", lambda: 1, (), {})))
    t.start()
    assert a.collective("new_group", lambda: 0, (), {}) == 0
    t.join(10)
    assert made == [1] and a.promotions == b.promotions == [], "no promotion was awaited"
    assert a.collectives == b.collectives == 1


def test_a_collective_a_stopped_shadow_will_not_make_ahead_waits_for_the_promotion():
    store, (a, b) = _peers()
    a.reach("opens /x/train.log for writing")  # rank 0's shadow stopped first
    assert store.get(keys.ahead_settled(3, 0)).decode().startswith("ran ahead: opens")
    order = []
    got = b.collective("all_reduce", lambda: order.append("made") or 2, (), {})
    assert got == 2 and b.promotions == ["calls torch.distributed.all_reduce"]
    assert order == ["made"], "made after the promotion, as the stopped shadow will"


def test_a_collective_waits_for_the_promotion_when_it_comes_first():
    store, (a, b) = _peers()
    a.promoting = lambda: True  # the promotion is in its pipe: rank 1 never comes
    assert a.collective("broadcast", lambda: 3, (), {}) == 3
    assert a.promotions == ["calls torch.distributed.broadcast"]


def test_a_trainers_pace_says_when_an_iteration_is_over():
    import json as _json

    from leto.trainer.first_iteration import Pace

    p = Pace()
    assert _json.loads(p.began(7))["done"] == 0
    assert _json.loads(p.began(7))["done"] == 0  # (the same iteration again: a redo)
    assert _json.loads(p.began(8))["done"] == 1


def test_a_shadow_parked_mid_iteration_runs_ahead_once_its_trainer_finished_one():
    # Parked while its trainer is in an iteration after its first (as a fault plan's
    # "when: parked" meets it): that trainer's peak memory is known, no movement needed.
    store = dist.HashStore()
    a = _gate(store, 0, world=1)
    store.set(keys.pace(2, 0), '{"iteration": 4, "done": 0}')
    assert not a.open()
    b = _gate(store, 0, world=1)
    store.set(keys.pace(2, 0), '{"iteration": 5, "done": 1}')
    assert b.open()


def test_a_peer_that_never_comes_is_waited_for_a_bounded_time(monkeypatch, capsys):
    store, (a, b) = _peers()
    monkeypatch.setattr(run_ahead.Ahead, "AGREE_TIMEOUT_S", 0.2)
    assert a.collective("barrier", lambda: 4, (), {}) == 4  # rank 1 never reaches it
    assert a.promotions == ["calls torch.distributed.barrier"]
    assert "waited 0.2 s for the other ranks' shadows at collective 0" in capsys.readouterr().err
    # Rank 0's shadow counted itself there and made the call after its promotion: rank 1's
    # shadow, arriving late, makes it ahead (the two calls meet).
    assert b.collective("barrier", lambda: 5, (), {}) == 5 and b.promotions == []
    # At its next collective rank 1's shadow stops: rank 0's said it stopped.
    assert b.collective("barrier", lambda: 6, (), {}) == 6
    assert b.promotions == ["calls torch.distributed.barrier"]
