"""The training script's output on ``leto run``'s console, as torchrun shows it.

Runs in the node agent (``leto.launch.agent``), polled from its loop: no thread, no
pipe a trainer could block on. Each trainer writes its stdout and stderr to its rank log
(``rank<r>.gen<g>.<role>.log``, line-buffered: a SIGKILLed trainer loses at most a
partial line); the relay reads what each rank's *active* trainer appended since the last
poll and writes the complete lines to the console, each prefixed ``[rank<r>]:`` when the
job has several ranks. After a promotion or restart it finishes the old trainer's file
(its last lines, a partial one too) and reads the new one from its start — the script
ran again from the top, as a torchrun restart would print it again.

Leto's own trainer-side lines (``leto.rank_log``) are told apart by their mark:
``say`` lines stay in the rank log, ``tell`` lines are shown as ``leto: rank <r>: ...``;
job-wide facts reach the console once, through the agent's notices (the checks line, a
check switched off).

Not covered: a trainer's output before its first poll is shown when that poll comes
(the agent polls every ``poll_s``); the order of lines across ranks is the order the
relay read them, not the order they were written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from leto.rank_log import MARK, SHOWN

READ_LIMIT = 1 << 20  # bytes read from one file in one poll: a flood cannot stall the agent


class _Follow:
    """Where the relay is in one trainer's log file."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self, final: bool) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(READ_LIMIT if not final else -1)
        except OSError:
            return []  # not created yet (a trainer being started)
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return lines


class Relay:
    """``cells``: the agent's cells (each knows its rank, log folder and active trainer);
    ``out``: the console stream (None: nothing is relayed); ``ranks``: the local ranks
    shown (None: all), as torchrun's ``--local-ranks-filter``."""

    def __init__(self, cells, out: TextIO | None, world_size: int, ranks=None):
        self.cells = cells
        self.out = out
        self.prefix = world_size > 1
        self.ranks = None if ranks is None else set(ranks)
        self.following: dict[int, _Follow] = {}

    def _path(self, cell) -> Path | None:
        if cell.active is None:
            return None
        role = "active" if cell.active_role == "active" else "shadow"
        return Path(cell.log_dir) / f"rank{cell.rank}.gen{cell.active_generation}.{role}.log"

    def poll(self, final: bool = False) -> None:
        """Relay what every shown rank's active trainer wrote since the last poll;
        ``final``: everything, partial last lines too (the job's end)."""
        if self.out is None:
            return
        for cell in self.cells:
            if self.ranks is not None and cell.local_rank not in self.ranks:
                continue
            path = self._path(cell)
            f = self.following.get(cell.rank)
            if f is not None and f.path != path:
                self._write(cell.rank, f.read(final=True))  # the old trainer's last lines
                f = None
            if f is None and path is not None:
                f = self.following[cell.rank] = _Follow(path)
            if f is not None:
                self._write(cell.rank, f.read(final))
        try:
            self.out.flush()
        except (OSError, ValueError):
            self.out = None  # the console is gone (a closed pipe): the logs keep it all

    def _write(self, rank: int, lines: list[bytes]) -> None:
        if not lines or self.out is None:
            return
        head = f"[rank{rank}]:" if self.prefix else ""
        shown = []
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rstrip("\r")
            if line.startswith(MARK):
                continue
            if line.startswith(SHOWN):  # Leto's own, for the console: no rank prefix
                shown.append(MARK + line[len(SHOWN) :] + "\n")
                continue
            shown.append(head + line + "\n")
        try:
            self.out.write("".join(shown))
        except (OSError, ValueError):
            self.out = None


def console(json_summary: bool) -> TextIO:
    """Where the script's output goes: stdout, as under torchrun — stderr when stdout
    carries ``leto run --json``'s summary."""
    return sys.stderr if json_summary else sys.stdout
