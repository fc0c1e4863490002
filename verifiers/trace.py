"""The trace file format: how a rank's records and marks are written and read back.

Owns the on-disk format shared by the writer (``recorder.py``, inside each training
rank) and the readers (``compare.py``, ``plots.py``, in whatever process verifies).
One file per rank, ``rank{r}.trace.jsonl``, one JSON object per line, appended only:

* a *record* (``"kind": "record"``): one completed iteration: its loss (float and
  ``float.hex``), wall time (when the iteration's state was final, before hashing), and
  per retained tensor its dtype, shape, byte count and digest of its raw bytes (field
  ``sha256``; scheme ``sha256-tree-64KiB`` from ``digest.py`` since trace version 3);
  ``tensors_file`` names the saved tensors, if kept;
* a *mark* (``"kind": "mark"``): an event such as an injection or a recovery.

An iteration may be recorded more than once (a rank redoes it after recovery); the
reader keeps the latest record and lists every earlier record that differs from it.
A line that does not parse (a last line torn by SIGKILL, or a torn fragment a later
append terminated) is skipped with a note; reading never fails on content, only on a
path that cannot be read.

Not covered: concurrent writers to one file beyond what a single ``O_APPEND`` write
gives, and durability across power loss (lines are flushed to the kernel, not fsynced).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leto.errors import InvalidInput
from verifiers.digest import digest

TRACE_VERSION = 3  # 3: tensor digests are sha256-tree-64KiB (digest.py); 2: -16MiB
TRACE_GLOB = "rank*.trace.jsonl"
_TRACE_NAME = re.compile(r"rank(\d+)\.trace\.jsonl")

# Event names of marks the report understands; other names are kept and ignored.
EVENT_INJECTION = "injection"  # a fault hit this rank (or the job) at this iteration
EVENT_RECOVERED = "recovered"  # this rank trains again; info "since": when recovery began
# The rank's state was restored from a checkpoint ending at this iteration (the
# checkpoint fallback): records it made of later iterations before the mark are
# superseded, and may differ (e.g. trained on state later found silently corrupted).
EVENT_ROLLED_BACK = "rolled_back"


def trace_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.trace.jsonl"


def tensors_dir(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.tensors"


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` in row-major order, as a 1-D uint8 CPU tensor.

    Byte offsets in a verdict index this view. ``reshape(-1)`` first because a 0-dim
    tensor cannot be viewed as a dtype of another size.
    """
    u8 = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return u8.cpu() if u8.device.type != "cpu" else u8


def tensor_digest(t: torch.Tensor) -> str:
    return digest(t)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_line(obj: dict) -> bytes:
    # One line per object: json.dumps never emits a raw newline, so a line is a record.
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class Record:
    rank: int
    iteration: int
    loss: float
    loss_hex: str
    wall_time: float
    tensors: dict[str, TensorEntry]
    tensors_file: str | None  # relative to the run directory
    extra: dict
    line: int  # 1-based line in the trace file, for messages

    def same_content(self, other: Record) -> bool:
        """Byte-equal loss and tensors (wall time and extra are not compared)."""
        return self.loss_hex == other.loss_hex and self.tensors == other.tensors


@dataclass(frozen=True)
class Mark:
    rank: int
    event: str
    iteration: int
    wall_time: float
    info: dict


@dataclass
class Trace:
    """One rank's trace as read back."""

    rank: int
    path: Path
    records: dict[int, Record] = field(default_factory=dict)  # latest per iteration
    history: list[Record] = field(default_factory=list)  # every record, in file order
    marks: list[Mark] = field(default_factory=list)
    # (earlier, latest) records of one iteration whose content differs
    reruns_differed: list[tuple[Record, Record]] = field(default_factory=list)
    # ... of which the earlier was superseded by a checkpoint rollback (not counted)
    rolled_back: list[tuple[Record, Record]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Run:
    """Every rank's trace of one run directory."""

    path: Path
    traces: dict[int, Trace]

    @property
    def notes(self) -> list[str]:
        return [n for t in self.traces.values() for n in t.notes]

    def marks(self) -> list[Mark]:
        return sorted((m for t in self.traces.values() for m in t.marks), key=lambda m: m.wall_time)


def _parse_record(obj: dict, line: int) -> Record:
    tensors = {
        name: TensorEntry(
            e["dtype"], tuple(int(s) for s in e["shape"]), int(e["nbytes"]), e["sha256"]
        )
        for name, e in obj["tensors"].items()
    }
    loss_hex = obj["loss_hex"]
    return Record(
        rank=int(obj["rank"]),
        iteration=int(obj["iteration"]),
        loss=float.fromhex(loss_hex),
        loss_hex=loss_hex,
        wall_time=float(obj["wall_time"]),
        tensors=tensors,
        tensors_file=obj.get("tensors_file"),
        extra=obj.get("extra", {}),
        line=line,
    )


def read_trace(path: Path) -> Trace:
    """Read one trace file; raises InvalidInput only if the file cannot be read."""
    path = Path(path)
    m = _TRACE_NAME.fullmatch(path.name)
    if m is None:
        raise InvalidInput(f"{path}: not a trace file (expected rank<N>.trace.jsonl)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InvalidInput(f"cannot read trace {path}: {e}; nothing was compared") from e
    trace = Trace(rank=int(m.group(1)), path=path)
    lines = data.split(b"\n")
    # The text after the last newline is a line the writer never finished.
    complete, tail = lines[:-1], lines[-1]
    if tail:
        trace.notes.append(
            f"{path}: last line ({len(tail)} bytes, no newline) is torn, probably by a kill "
            "mid-write; ignored"
        )
    for i, raw in enumerate(complete, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            kind = obj["kind"]
            if kind == "record" and obj.get("v") != TRACE_VERSION:
                trace.notes.append(
                    f"{path}: line {i} is a record of trace version {obj.get('v')!r}, whose "
                    f"tensor digests this reader (version {TRACE_VERSION}) cannot compare; "
                    "ignored"
                )
                continue
            if kind == "record":
                rec = _parse_record(obj, i)
            elif kind == "mark":
                mark = Mark(
                    int(obj["rank"]),
                    str(obj["event"]),
                    int(obj["iteration"]),
                    float(obj["wall_time"]),
                    obj.get("info", {}),
                )
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            trace.notes.append(
                f"{path}: line {i} is not a valid trace line ({type(e).__name__}: {e}); a "
                "fragment torn by a kill and terminated by a later append looks like this; "
                "ignored"
            )
            continue
        if kind == "mark":
            trace.marks.append(mark)
            continue
        trace.records[rec.iteration] = rec
        trace.history.append(rec)
    # Each earlier record is judged against the latest, which is the one compared.
    rollbacks = [m for m in trace.marks if m.event == EVENT_ROLLED_BACK]
    for rec in trace.history:
        latest = trace.records[rec.iteration]
        if rec is not latest and not rec.same_content(latest):
            undone = any(
                m.iteration < rec.iteration and rec.wall_time < m.wall_time < latest.wall_time
                for m in rollbacks
            )
            (trace.rolled_back if undone else trace.reruns_differed).append((rec, latest))
    return trace


def read_run(run_dir: Path) -> Run:
    """Read every ``rank*.trace.jsonl`` of a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise InvalidInput(f"run directory {run_dir} does not exist; nothing was compared")
    if not run_dir.is_dir():
        raise InvalidInput(f"{run_dir} is not a directory; pass the run's output directory")
    try:
        paths = sorted(run_dir.glob(TRACE_GLOB))
    except OSError as e:
        raise InvalidInput(f"cannot list {run_dir}: {e}; nothing was compared") from e
    traces = {}
    for p in paths:
        if _TRACE_NAME.fullmatch(p.name):
            t = read_trace(p)
            traces[t.rank] = t
    if not traces:
        raise InvalidInput(
            f"{run_dir} holds no rank<N>.trace.jsonl; was the job run with a verifiers.Recorder?"
        )
    return Run(run_dir, traces)


def load_tensors(run_dir: Path, rec: Record) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The tensors saved with ``rec``, or None and why they are not available."""
    if rec.tensors_file is None:
        return None, f"rank {rec.rank} recorded iteration {rec.iteration} without keep_tensors"
    p = Path(run_dir) / rec.tensors_file
    try:
        saved = torch.load(p, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:
        return None, f"saved tensors {p} cannot be loaded ({type(e).__name__}: {e})"
    for name, entry in rec.tensors.items():
        t = saved.get(name)
        if t is None or tensor_digest(t) != entry.sha256:
            # A file that no longer matches its record cannot name an offset honestly.
            return None, f"saved tensors {p} do not match the recorded SHA-256 of {name!r}"
    return saved, ""


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over elements, as float64; NaN if a differing element is NaN."""
    if a.numel() == 0:
        return 0.0
    if a.dtype.is_complex or b.dtype.is_complex:
        return float((a.to(torch.complex128) - b.to(torch.complex128)).abs().max())
    d = (a.reshape(-1).double() - b.reshape(-1).double()).abs()
    # inf - inf is NaN although the values are equal; equal elements contribute 0.
    d = torch.where(a.reshape(-1).double() == b.reshape(-1).double(), torch.zeros_like(d), d)
    return float(d.max()) if not torch.isnan(d).any() else math.nan
