"""A promoted trainer that truncates a file the failed trainer wrote says so.

Runs in a promoted trainer, from ``leto.init()``'s return until ``leto.Run`` (the
script's set-up, which a promoted trainer runs again from the top). A script that opens
its log with ``"w"`` there (llm.c's ``train_gpt.py`` does) empties what the trainer
before it wrote — the run's iterations 0..t of that log are gone, though the training
itself is exact. An audit hook (``sys.addaudithook``: Python's own ``open`` event, before
the file is opened) sees such an open from the script's code of a file that exists and
is not empty, and the rank says it on the console once per file
(``leto: rank R: the script opened ... with "w" ...``); ``faultkit certify`` lists those
lines in its verdict. Nothing is changed: the open goes ahead as written.

Not covered: files opened by libraries (only the script's own code is watched: frames
outside the standard library, torch, site-packages and Leto), ``os.open`` with
``O_TRUNC`` from C, truncation after ``leto.Run``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from leto import rank_log

SAID = "the script opened"  # the console line's words (faultkit certify looks for them)
_PATHS = sysconfig.get_paths()
_STDLIB = str(Path(_PATHS["stdlib"]).resolve())
# Libraries' code (and Leto's, faultkit's, the verifiers'): their opens are their own.
_LIBS = tuple(
    {str(Path(_PATHS[k]).resolve()) for k in ("purelib", "platlib")}
    | {str(Path(__file__).resolve().parents[2] / d) for d in ("leto", "faultkit", "verifiers")}
)
_state: dict = {"rank": None, "said": set(), "installed": False}


def watch(rank: int) -> None:
    """Start watching (once per process: an audit hook cannot be removed; ``stop``
    silences it)."""
    _state["rank"] = rank
    if not _state["installed"]:
        sys.addaudithook(_hook)
        _state["installed"] = True


def stop() -> None:
    _state["rank"] = None


def _hook(event: str, args: tuple) -> None:
    if _state["rank"] is None or event != "open":
        return
    path, mode, flags = (tuple(args) + (None, None, None))[:3]
    truncates = (isinstance(mode, str) and "w" in mode) or (
        isinstance(flags, int) and mode is None and flags & os.O_TRUNC
    )
    if not truncates or not isinstance(path, (str, bytes, os.PathLike)):
        return
    try:
        p = Path(os.fsdecode(path)).resolve()
        if not p.is_file() or p.stat().st_size == 0 or str(p) in _state["said"]:
            return
    except (OSError, ValueError):
        return
    if not _from_script():
        return
    _state["said"].add(str(p))
    rank_log.tell(
        _state["rank"],
        f'{SAID} {p} with "w" after a recovery: what the failed trainer wrote there is '
        f'gone (the training is not affected) — open it with "a" when ctx.generation > 0 '
        f"(docs/porting.md)",
    )


def _from_script() -> bool:
    """Whether the innermost frame outside Python's standard library (io, pathlib, codecs:
    the layers of an open) is the script's own, not a library's or Leto's."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith("<"):  # (frozen modules: the standard library's)
            where = os.path.realpath(name)
            if where.startswith(_LIBS):  # (site-packages may lie inside the stdlib's path)
                return False
            if not where.startswith(_STDLIB):
                return True
        f = f.f_back
    return False
