"""What every faultkit command shares: its progress lines, its work directory, its
refusals and its work-directory flags.

Runs in the ``faultkit`` CLI process (``faultkit.cli`` and the commands' own modules,
``faultkit.certify_cli``, import it; it imports none of them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

UNDO_HELP = (
    "leto run --undo for the job: chunk (each chunk's undo copy taken before its update) or "
    "ahead (the whole state copied beside forward and backward)"
)


@contextlib.contextmanager
def progress(command: str):
    """One line per stage on stderr as the runs go (faultkit.inject logs them at INFO;
    stdout keeps the table or the JSON): a run of the example job takes tens of seconds,
    a matrix many minutes, and nothing was shown until the end. Yields the function
    that prints a line."""
    console = Console(stderr=True, highlight=False)
    t0 = time.monotonic()

    def say(line: str) -> None:
        elapsed = (f"{time.monotonic() - t0:6.1f} s ", "dim")
        console.print(Text.assemble(elapsed, f"faultkit {command}: {line}"), soft_wrap=True)

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            say(record.getMessage())

    log = logging.getLogger("faultkit")
    handler, level, propagate = Lines(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # shown here once, not again by a root handler
    try:
        yield say
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


@contextlib.contextmanager
def workdir(args: argparse.Namespace, say):
    """Where the runs write (logs, checkpoints, traces: 40-60 MB a run). A directory
    the user named is kept; a temporary one is removed at the end — also after SIGTERM
    or Ctrl-C, once the job's agents have stopped — unless ``--keep``, or unless the
    verdict was not EXACT (``keep["why"]`` set: the traces are the evidence)."""
    if args.workdir:
        path = Path(args.workdir).resolve()
        made = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        keep = {"why": "--workdir"}
    else:
        path, made = Path(tempfile.mkdtemp(prefix="faultkit-")), True
        keep = {"why": "--keep" if args.keep else None}
    say(
        f"work directory {path}" + ("" if keep["why"] else " (removed at the end; --keep keeps it)")
    )
    try:
        yield path, keep
    finally:
        empty = path.is_dir() and not any(path.iterdir())
        if not keep["why"] or (made and empty):
            shutil.rmtree(path, ignore_errors=True)
            if not empty:
                say(f"removed {path} (--keep or --workdir DIR keeps the runs' traces)")
        else:
            runs = sorted(str(t.relative_to(path)) for t in path.glob("*/train") if t.is_dir())
            say(f"kept {path} ({keep['why']}); traces: {', '.join(runs) or 'none'}")
            if len(runs) >= 2 and "reference/train" in runs:
                other = next(r for r in runs if r != "reference/train")
                say(f"compare them: verifiers compare {path}/reference/train {path}/{other}")


def keep_if_not_exact(keep: dict, exact: bool) -> None:
    if not exact and not keep["why"]:
        keep["why"] = "the verdict is not EXACT: its traces are the evidence"


def refuse(command: str, e: Exception, args: argparse.Namespace) -> int:
    """A refusal: the reason on stderr and, under ``--json``, as a JSON object on stdout
    (a script reading stdout gets an object either way). Nothing ran."""
    print(f"faultkit {command}: {e}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"refused": True, "error": str(e), "exact": False}))
    return 2


def workdir_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workdir",
        default=None,
        help="write the runs here (kept): DIR/reference/train and DIR/<run>/train hold the "
        "traces `verifiers compare` reads; default: a temporary directory, removed at the end",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary work directory (it is kept anyway when a verdict is not EXACT)",
    )
