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

A healthy rank's traceback from a collective its failed peer broke (gloo's "Connection
reset by peer", NCCL's remote exit: ``leto.launch.monitor.PEER_GONE``) is not a
crash of its script but the way the failure reached it, and Leto recovers it: the
traceback stays in the rank log, and the console gets one line saying so. A traceback
is held until its exception line shows which it is; every other one (the script's own
error) is shown in full — once: the same traceback again from the rank's promoted
trainer is one line pointing to it.

Not covered: a trainer's output before its first poll is shown when that poll comes
(the agent polls every ``poll_s``); the order of lines across ranks is the order the
relay read them, not the order they were written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TextIO

from leto.launch.monitor import PEER_GONE
from leto.rank_log import MARK, SHOWN

READ_LIMIT = 1 << 20  # bytes read from one file in one poll: a flood cannot stall the agent
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?")


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
        self.held: dict[int, list[str]] = {}  # a traceback being read, per rank
        self.shown: set[tuple] = set()  # tracebacks shown in full (their lines, bare)

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
                self._write(cell.rank, f.read(final=True), f.path)  # the old one's last lines
                self._write(cell.rank, self._release(cell.rank), f.path, held=True)
                f = None
            if f is None and path is not None:
                f = self.following[cell.rank] = _Follow(path)
            if f is not None:
                self._write(cell.rank, f.read(final), f.path)
                if final:
                    self._write(cell.rank, self._release(cell.rank), f.path, held=True)
        try:
            self.out.flush()
        except (OSError, ValueError):
            self.out = None  # the console is gone (a closed pipe): the logs keep it all

    def _release(self, rank: int) -> list[bytes]:
        """A traceback still held (its file ended before its exception line): shown."""
        return [ln.encode() for ln in self.held.pop(rank, [])]

    def _write(self, rank: int, lines: list[bytes], path: Path, held: bool = False) -> None:
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
            block = self.held.get(rank)
            # (torch prefixes a distributed rank's uncaught traceback with "[rank<r>]: ")
            bare = _TORCH_PREFIX.sub("", line, count=1)
            if block is None and bare.startswith("Traceback (most recent call last):") and not held:
                self.held[rank] = [line]
                continue
            if block is not None:
                block.append(line)
                if not bare or bare[0].isspace() or bare.startswith("Traceback"):
                    continue  # its frames
                del self.held[rank]  # its exception line: a peer's failure, or its own
                if PEER_GONE.search(line):
                    shown.append(
                        f"{MARK}rank {rank}: a collective broke when a peer failed "
                        f"({bare.strip()[:160]}); Leto recovers it — the traceback is in "
                        f"{path}\n"
                    )
                else:
                    key = (rank, *(_TORCH_PREFIX.sub("", b, count=1) for b in block))
                    if key in self.shown:  # a promoted trainer ran into it again
                        shown.append(
                            f"{MARK}rank {rank}: the same error again ({bare.strip()[:160]}) "
                            f"— its traceback is above; this one is in {path}\n"
                        )
                    else:
                        self.shown.add(key)
                        shown.extend(head + b + "\n" for b in block)
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
