"""The reference recorder: one per training rank, writing that rank's trace.

Runs inside the trainer process (or in a harness that marks injections into a rank's
trace). ``record`` appends one line per completed iteration to ``rank{r}.trace.jsonl``
(format in ``trace.py``): the loss exactly (``float.hex``), the wall time, and the
digest (``digest.py``: SHA-256 over 64 KiB leaves, hashed where the tensor lives) of every retained
tensor's raw bytes. With ``keep_tensors`` the tensors are also
saved, so a comparison can name the first differing byte and the largest difference.

Survives SIGKILL between and during records: each line goes to the kernel in one
``write`` on an ``O_APPEND`` descriptor (no user-space buffer to lose), saved tensors
are written to a temporary file and renamed *before* the line that names them, and a
torn last line left by an earlier process is terminated on open so it cannot merge
with the next record (the reader skips it with a note).

Not covered: fsync (a kill loses nothing the kernel has; power loss may), comparing
anything (``compare.py``), and the cost of hashing: every record copies each retained
tensor to the CPU (~1 s for 16 GB on the H200 host), so record in verification runs,
not in production ones. The record's wall time is taken before hashing: it is when the
iteration's state was final, so timings read from a trace exclude the verifier.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from leto.errors import InvalidInput
from verifiers.digest import digest
from verifiers.trace import (
    TRACE_VERSION,
    dtype_name,
    encode_line,
    tensors_dir,
    trace_path,
)

# Under `leto run --verify` (verifiers.plugin): "1" also saves the tensors.
ENV_KEEP = "LETO_VERIFY_KEEP_TENSORS"
# ... and "1" saves each rank's final state when the loop is over (verifiers.plugin).
ENV_SAVE_STATE = "LETO_VERIFY_SAVE_STATE"


class Recorder:
    """Appends records and marks to ``out_dir/rank{rank}.trace.jsonl``.

    Opening never truncates: a restarted rank appends to the trace its earlier
    incarnation wrote, and re-recording an iteration is allowed (the reader keeps the
    latest record and reports an earlier one that differs).
    """

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        keep_tensors: bool = False,
        *,
        clock: Callable[[], float] = time.time,
    ):
        if rank < 0:
            raise InvalidInput(f"rank must be >= 0, got {rank}; nothing was recorded")
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.keep_tensors = keep_tensors
        self.clock = clock  # wall-clock seconds; a parameter so tests can fix the times
        self.path = trace_path(self.out_dir, rank)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._terminate_torn_tail()

    def _terminate_torn_tail(self) -> None:
        # An earlier process killed mid-write leaves a last line without "\n"; our first
        # append would glue onto it and the merged line would hide a valid record.
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                os.write(self._fd, b"\n")

    def _append(self, obj: dict) -> None:
        if self._fd < 0:
            raise InvalidInput(f"recorder for {self.path} is closed; nothing was recorded")
        line = encode_line(obj)
        # One write call: the kernel appends it at the end in one piece, or not at all
        # when the kill comes first. A short write (disk full) is completed by the loop.
        view = memoryview(line)
        while view:
            view = view[os.write(self._fd, view) :]

    def record(
        self, iteration: int, loss: float, tensors: Mapping[str, torch.Tensor], **extra
    ) -> dict:
        """Append the record of a completed ``iteration``; returns the line's object.

        ``tensors`` maps names to retained tensors (CPU or CUDA; a CUDA tensor is copied
        to the CPU, which synchronizes its stream). ``extra`` must be JSON-serializable.
        Does not check that ``iteration`` is new: reruns are evidence, kept for the reader.
        """
        wall_time = self.clock()  # the state is final now; hashing is the verifier's cost
        t0 = time.perf_counter()
        entries = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise InvalidInput(
                    f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor; "
                    f"iteration {iteration} was not recorded"
                )
            entries[name] = {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "nbytes": t.numel() * t.element_size(),
                "sha256": digest(t),
            }
        loss = float(loss)
        obj = {
            "v": TRACE_VERSION,
            "kind": "record",
            "rank": self.rank,
            "iteration": int(iteration),
            "loss": loss,
            "loss_hex": loss.hex(),
            "wall_time": wall_time,
            "digest_s": round(time.perf_counter() - t0, 6),
            "tensors": entries,
            "tensors_file": None,
            "extra": extra,
        }
        if self.keep_tensors:
            obj["tensors_file"] = self._save(iteration, tensors, entries)
        self._append(obj)
        return obj

    def _save(self, iteration: int, tensors: Mapping[str, torch.Tensor], entries: dict) -> str:
        # Named by content: an identical rerun rewrites the same file, a differing rerun
        # gets its own, so both sides of a rerun that differed stay inspectable.
        content = hashlib.sha256(
            "".join(f"{n}:{e['sha256']};" for n, e in entries.items()).encode()
        ).hexdigest()[:16]
        d = tensors_dir(self.out_dir, self.rank)
        d.mkdir(exist_ok=True)
        final = d / f"it{iteration:08d}.{content}.pt"
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        # clone: torch.save of a view writes its whole storage (a flat retained buffer).
        torch.save({n: t.detach().cpu().clone() for n, t in tensors.items()}, tmp)
        # Rename before the trace line names the file: a line never points at a torn file.
        os.replace(tmp, final)
        return str(final.relative_to(self.out_dir))

    def mark(self, event: str, iteration: int, **info) -> None:
        """Append an event (``trace.EVENT_INJECTION``, ``trace.EVENT_RECOVERED``, ...)."""
        self._append(
            {
                "v": TRACE_VERSION,
                "kind": "mark",
                "rank": self.rank,
                "event": str(event),
                "iteration": int(iteration),
                "wall_time": self.clock(),
                "info": info,
            }
        )

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)
