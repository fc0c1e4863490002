"""The agent's monitor: which local trainers failed, and how.

Runs in the agent. ``failures(gen)`` is called every ``poll_s``: a trainer that exited
with a non-zero code is an ``EXIT`` failure (seen from the process, no store access;
with its error file when it raised), one whose heartbeat stalled is a ``HANG``. Every
rank's heartbeat is read from the store every ``beat_poll_s``; the first local rank's
every poll, since its beats time the measured ETTR (``ettr``).

Hangs: a beat that has not moved for ``hang_timeout_s`` (``timeout_s`` before the first
beat, after "done", and while any trainer of the generation is in its process's first
iteration — ``keys.warming``: compilation and warm-up stall every rank behind it). Ranks blocked in a collective behind a stuck peer stall too,
at most one iteration ahead of it: only the ranks with the oldest beat are reported.

Not covered: failures of other nodes (the agent reads the store's counters for those),
state managers (the agent checks their processes).
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from leto.errors import EXIT_FATAL, EXIT_RECOVERABLE
from leto.job import keys
from leto.job.config import RunConfig
from leto.launch.cell import Cell

# What a collective says when a peer's process went away under it.
PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote process exited|"
    r"NCCL communicator was aborted",
    re.IGNORECASE,
)


class FailureKind(enum.Enum):
    EXIT = "exit"  # the trainer process ended with a non-zero code (or a signal)
    HANG = "hang"  # its heartbeat stalled
    STATE_MANAGER = "state_manager"  # its rank's state manager died (fatal)


@dataclass(frozen=True)
class Failure:
    rank: int
    kind: FailureKind
    code: int | None = None  # EXIT: the exit code (negative: the signal)
    error: dict | None = None  # EXIT: the trainer's error file (uncaught exception)
    # EXIT: the trainer's log (its stdout and stderr): the traceback of an exception
    # raised before leto.init() — no error file then — is at its end.
    log: str | None = None

    def as_record(self) -> dict:
        """The JSON the store and the recovery record keep."""
        if self.kind is FailureKind.HANG:
            return {"hang": True}
        if self.kind is FailureKind.STATE_MANAGER:
            return {"state_manager": True}
        out: dict = {"code": self.code}
        if self.error is not None:
            out["error"] = self.error
        return out

    @property
    def collateral(self) -> bool:
        """The trainer died of a collective a peer broke (gloo's "Connection closed by
        peer", NCCL's remote exit): the cause is that peer's failure, which may not have
        been seen yet — a script's own ``sys.exit(n)`` closes its connections before its
        process is gone."""
        msg = (self.error or {}).get("message", "")
        return self.kind is FailureKind.EXIT and bool(PEER_GONE.search(msg))

    @property
    def script_error(self) -> bool:
        """The script (or Leto's own code) ended the trainer: an uncaught Python
        exception (its error file) or an exit with a code (``sys.exit(2)`` from argparse,
        say) — not a hardware failure. A signal (a kill) is not one, nor Leto's fatal
        exit (``EXIT_FATAL``), nor a recoverable failure Leto raised (``EXIT_RECOVERABLE``:
        a replay mismatch, raised on every rank at once)."""
        if self.kind is not FailureKind.EXIT or self.code in (EXIT_FATAL, EXIT_RECOVERABLE):
            return False
        return self.error is not None or (self.code is not None and self.code > 0)

    def signature(self) -> tuple[str, str, str]:
        """(exception, message, the innermost frame's "File ..., line N") — or the exit
        code without an error file: the same error at the same place compares equal
        across processes."""
        if self.error is None:
            return "exit", str(self.code), ""
        frames = [ln.strip() for ln in self.error.get("traceback", "").splitlines()]
        where = next((ln for ln in reversed(frames) if ln.startswith('File "')), "")
        return self.error["exception"], self.error["message"], where

    def traceback_tail(self, lines: int = 10) -> str:
        """The last ``lines`` of the traceback: from the error file, else from the end
        of the trainer's log."""
        if self.error is not None:
            return "\n".join(self.error.get("traceback", "").rstrip().splitlines()[-lines:])
        tail = _log_tail(self.log, lines)
        if not tail:
            return f"(the trainer exited with code {self.code} and wrote nothing to its log)"
        return "\n".join(tail)

    def first_error_line(self) -> str:
        """What the error said, in a line: "ValueError: bad" (the error file's, else the
        last line of the log, where Python prints it), or the exit code."""
        if self.error is not None:
            return f"{self.error['exception']}: {self.error['message']}".splitlines()[0]
        tail = _log_tail(self.log, 1)
        return tail[0] if tail else f"exit code {self.code}"

    def describe(self) -> str:
        if self.kind is FailureKind.HANG:
            return "hangs (heartbeat stalled)"
        if self.kind is FailureKind.STATE_MANAGER:
            return "lost its state manager"
        why = f"exited with {self.code}"
        if self.error and self.collateral:
            # Not a crash of its own: the way a peer's failure reached it.
            return (
                f"{why}: a collective broke when a peer failed ({self.error['exception']}; "
                f"traceback in {self.error['file']})"
            )
        if self.error:
            why += (
                f": {self.error['exception']}: {self.error['message']} "
                f"(traceback in {self.error['file']})"
            )
        return why


def _log_tail(path: str | None, lines: int) -> list[str]:
    """The last ``lines`` non-blank lines of a log (its last 64 KiB read)."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()][-lines:]


def _log(cl: Cell) -> str:
    """The active trainer's log (``Cell._log``'s name; a promoted shadow keeps its own)."""
    role = "active" if cl.active_role == "active" else "shadow"
    return str(cl.log_dir / f"rank{cl.rank}.gen{cl.active_generation}.{role}.log")


class Monitor:
    def __init__(
        self,
        cfg: RunConfig,
        cells: list[Cell],
        store,
        on_beat: Callable[[int, Cell], None] | None = None,
    ):
        """``on_beat(gen, cell)``: called whenever a rank's beat is read (the preinit
        controller reads the memory report beside it)."""
        self.cfg, self.cells, self.store, self.on_beat = cfg, cells, store, on_beat
        self._beats: dict[int, tuple] = {}  # rank -> ((generation, beat), monotonic seen)
        self._beats_read = 0.0  # monotonic time every rank's beat was last read
        self._progress: list[tuple[float, int, int]] = []  # (time, generation, iteration)
        self._first: tuple | None = None  # the first local rank's last (generation, beat)
        self._started = time.time()

    def failures(self, gen: int) -> list[Failure]:
        """This node's failed trainers now: exits, then hangs."""
        out = []
        for cl in self.cells:
            rc = cl.active.poll()
            if rc not in (None, 0):
                out.append(Failure(cl.rank, FailureKind.EXIT, rc, cl.active_error(), _log(cl)))
        out += [Failure(cl.rank, FailureKind.HANG) for cl in self._hung(gen)]
        return out

    def last_beat(self, rank: int):
        """(generation, beat) last seen for ``rank`` (beat None before the first)."""
        return self._beats.get(rank, ((None, None), 0))[0]

    def _hung(self, gen: int) -> list[Cell]:
        now, hung = time.monotonic(), []
        # Every rank's beat at most every beat_poll_s (each read is two store requests);
        # the first local rank's every poll, since its beats time the measured ETTR.
        read_all = now - self._beats_read >= self.cfg.beat_poll_s
        if read_all:
            self._beats_read = now
        # One request: is any trainer of this generation (any node) in its first iteration?
        warming = read_all and int(self.store.add(keys.warming(gen), 0)) > 0
        for cl in self.cells if read_all else self.cells[:1]:
            if cl.active.poll() is not None:
                continue
            key = keys.beat(gen, cl.rank)
            beat = self.store.get(key) if self.store.check([key]) else None
            if self.on_beat is not None and beat is not None:
                self.on_beat(gen, cl)  # a trainer may report again within a beat
            if cl is self.cells[0] and beat not in (None, b"done") and self._first != (gen, beat):
                self._first = (gen, beat)
                self._progress.append((time.time(), gen, int(beat)))
            if not read_all:
                continue
            # Stalls are timed from sightings at this one cadence for every rank: a rank
            # seen more often would look stalled sooner than the peer it waits for.
            last = self._beats.get(cl.rank)
            if last is None or last[0] != (gen, beat):
                self._beats[cl.rank] = ((gen, beat), now)
                continue
            # Before the first beat (start-up, recovery) and after the last (finishing:
            # final barrier, checkpoint flush) only the general timeout applies.
            stepping = beat is not None and beat != b"done"
            limit = self.cfg.hang_timeout_s if stepping and not warming else self.cfg.timeout_s
            if now - last[1] > limit:
                hung.append((int(beat) if stepping else -1, cl))
        oldest = min((b for b, _ in hung), default=None)
        return [cl for b, cl in hung if b == oldest]

    def ettr(self, iterations: int | None = None) -> dict:
        """Measured ETTR from the first local rank's heartbeats: productive time (distinct
        iterations x the median fault-free iteration time) over the wall time since the
        agent started (so start-up, failures and recomputation all count against it).
        ``iterations``: the count the trainers reported (their last pace), exact where
        the polled beats may have missed the last ones of a fast loop."""
        p = self._progress
        steps = [
            b[0] - a[0] for a, b in zip(p, p[1:], strict=False) if a[1] == b[1] and b[2] == a[2] + 1
        ]
        if not steps:
            return {"ettr": None, "why": "fewer than two consecutive iterations were observed"}
        t_iter = sorted(steps)[len(steps) // 2]
        iterations = max(iterations or 0, max(it for _, _, it in p) + 1)
        wall = time.time() - self._started
        return {
            "ettr": iterations * t_iter / wall,
            "iterations": iterations,
            "median_iteration_s": t_iter,
            "wall_s": wall,
        }
