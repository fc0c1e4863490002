"""Leto's own lines in a trainer's rank log.

Runs in the trainer (its runtime and updater modules alike). The script's stdout and stderr share the rank log with these lines;
``leto.launch.relay`` shows the script's on ``leto run``'s console and tells Leto's
apart by their mark: ``say`` lines (``leto: rank <r>: ...``, what the trainer did: its
update path, the loop's figures) stay in the log; ``tell`` lines (an event the user must
see: corruption found and repaired, a rank that computed wrong) reach the console too,
as ``leto: rank <r>: ...``. Job-wide facts reach it once, as agent notices
(``leto.trainer.run._notice``), not from every rank.
"""

from __future__ import annotations

import sys

MARK = "leto: "  # a line only for the rank log
SHOWN = "leto! "  # a line for the console too (the relay writes it as "leto: ...")


def say(rank: int, message: str) -> None:
    """``leto: rank <rank>: <message>`` in the rank log (stderr), flushed."""
    _line(f"{MARK}rank {rank}: {message}")


def tell(rank: int | None, message: str) -> None:
    """As ``say``, and on ``leto run``'s console (``rank`` None: a line of no rank's)."""
    who = "" if rank is None else f"rank {rank}: "
    _line(f"{SHOWN}{who}{message}")


def _line(text: str) -> None:
    # One write with its newline: print() writes the two apart, and a line said from a
    # thread (the staging buffers') ran into another thread's.
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
