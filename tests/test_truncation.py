"""A promoted trainer that empties a file the failed trainer wrote says so
(leto.trainer.truncation): an open with "w" of a file that is not empty, from the
script's own code, while it is watched — once per file; nothing else is said."""

from __future__ import annotations

import pytest

from leto.trainer import truncation


@pytest.fixture
def watched(monkeypatch):
    monkeypatch.setattr(truncation, "_state", {"rank": None, "said": set(), "installed": False})
    truncation.watch(3)
    yield
    truncation.stop()


def test_emptying_a_written_file_is_said_once(watched, tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("step 0\\nstep 1\\n")
    capsys.readouterr()
    with open(log, "w") as f:  # what llm.c's script does at its start
        f.write("step 2\n")
    err = capsys.readouterr().err
    assert err.count(truncation.SAID) == 1 and str(log) in err and "rank 3" in err, err
    open(log, "w").close()  # the same file again: said already
    assert truncation.SAID not in capsys.readouterr().err


def test_appending_new_files_and_empty_ones_say_nothing(watched, tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("step 0\n")
    (tmp_path / "empty.log").touch()
    capsys.readouterr()
    with open(log, "a") as f:
        f.write("step 1\n")
    open(tmp_path / "new.log", "w").close()
    open(tmp_path / "empty.log", "w").close()
    log.read_text()
    assert truncation.SAID not in capsys.readouterr().err


def test_nothing_is_said_once_stopped_or_for_a_librarys_open(watched, tmp_path, capsys, monkeypatch):
    log = tmp_path / "train.log"
    log.write_text("step 0\n")
    # this test's own frames counted as a library's: its open is the library's own
    monkeypatch.setattr(truncation, "_LIBS", (*truncation._LIBS, str(tmp_path.parent.parent)))
    monkeypatch.setattr(truncation, "_LIBS", (*truncation._LIBS, __file__.rsplit("/", 1)[0]))
    open(log, "w").close()
    assert truncation.SAID not in capsys.readouterr().err
    log.write_text("step 0\n")
    monkeypatch.undo()
    truncation.stop()
    open(log, "w").close()
    assert truncation.SAID not in capsys.readouterr().err
