"""Byte-for-byte comparison of a run against its fault-free reference.

Runs in whatever process verifies (a test, faultkit, ``python -m verifiers compare``),
after both runs have finished. Reads every rank's trace of both run directories and
returns a frozen ``Verdict``. Exact means all of:

* every (rank, iteration) recorded in the reference is recorded in the run, and the run
  records nothing the reference lacks (an iteration nobody can vouch for);
* the latest records match byte for byte: ``float.hex`` of the loss, and dtype, shape
  and SHA-256 of every tensor;
* no iteration was recorded twice with different content in either run: two records
  that differ cannot both equal the reference, so the run's history was not exact even
  if its final record is.

The first divergence is the lowest iteration, then the lowest rank, then the loss before
the tensors in the order they were recorded. Its byte offset (into the tensor's
row-major bytes) and largest absolute difference are computed from saved tensors when
both runs kept them (``Recorder(keep_tensors=True)``); otherwise the verdict says the
offset is unknown and why.

Not covered: tolerances (nothing here is approximate), tensors that were never
recorded, and comparing final checkpoint files (record the final state as an iteration).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from verifiers.trace import Record, Run, load_tensors, max_abs_diff, read_run, tensor_bytes

LOSS = "loss"


@dataclass(frozen=True)
class Divergence:
    """Where two records of one (rank, iteration) differ first."""

    rank: int
    iteration: int
    tensor: str  # a tensor name, or "loss"
    byte_offset: int | None  # None: unknown, see ``why``
    max_abs_diff: float | None  # over the whole tensor, as float64; None: unknown
    why: str  # what differs, and why the offset is unknown when it is
    differing: tuple[str, ...]  # every item that differs in this record, loss first

    def describe(self) -> str:
        where = f"rank {self.rank} iteration {self.iteration} {self.tensor!r}"
        at = f"first at byte {self.byte_offset}" if self.byte_offset is not None else ""
        diff = (
            f"largest |difference| {self.max_abs_diff:.6g}" if self.max_abs_diff is not None else ""
        )
        details = ", ".join(x for x in (at, diff, self.why) if x)
        others = [d for d in self.differing if d != self.tensor]
        also = f"; also differing: {', '.join(others)}" if others else ""
        return f"{where} differs: {details}{also}"


@dataclass(frozen=True)
class RerunDiffered:
    """An iteration a rank recorded twice, differently: evidence of non-determinism."""

    run: str  # "reference" or "run"
    divergence: Divergence  # earlier record vs the later one
    earlier_line: int
    later_line: int

    def describe(self) -> str:
        return (
            f"{self.run}: lines {self.earlier_line} and {self.later_line} of rank "
            f"{self.divergence.rank}'s trace: {self.divergence.describe()}"
        )


@dataclass(frozen=True)
class Verdict:
    reference: str
    run: str
    exact: bool
    first_divergence: Divergence | None
    records_compared: int  # (rank, iteration) pairs present in both runs
    iterations_compared: int  # distinct iterations among them
    records_differing: int
    missing: tuple[tuple[int, int], ...]  # (rank, iteration) in the reference, not in the run
    unexpected: tuple[tuple[int, int], ...]  # (rank, iteration) in the run, not the reference
    reruns_differed: tuple[RerunDiffered, ...]
    # Records a checkpoint rollback superseded (they differed from the redone ones): not
    # evidence of non-determinism, and not the run's final word; counted for the report.
    rolled_back: int
    notes: tuple[str, ...]  # torn lines and other things skipped while reading

    def describe(self) -> str | None:
        """One line naming why the run is not exact, or None when it is."""
        if self.exact:
            return None
        if self.first_divergence is not None:
            return self.first_divergence.describe()
        if self.missing:
            return f"{len(self.missing)} reference record(s) missing, first {_pairs(self.missing)}"
        if self.unexpected:
            return f"{len(self.unexpected)} record(s) not in the reference, first {_pairs(self.unexpected)}"
        return self.reruns_differed[0].describe()

    def as_dict(self) -> dict:
        d = asdict(self)
        # JSON has no NaN: a NaN difference becomes the string "nan".
        for div in [d["first_divergence"]] + [r["divergence"] for r in d["reruns_differed"]]:
            if div and div["max_abs_diff"] is not None and not math.isfinite(div["max_abs_diff"]):
                div["max_abs_diff"] = str(div["max_abs_diff"])
        return d


def _pairs(pairs: tuple[tuple[int, int], ...], limit: int = 3) -> str:
    shown = ", ".join(f"rank {r} iteration {i}" for r, i in pairs[:limit])
    return shown + (f" (+{len(pairs) - limit} more)" if len(pairs) > limit else "")


def _differing_items(a: Record, b: Record) -> list[str]:
    out = [LOSS] if a.loss_hex != b.loss_hex else []
    names = list(a.tensors) + [n for n in b.tensors if n not in a.tensors]
    return out + [n for n in names if a.tensors.get(n) != b.tensors.get(n)]


def _locate(a: Record, a_dir: Path, b: Record, b_dir: Path) -> Divergence | None:
    """The first differing item of two records of one (rank, iteration), or None."""
    items = _differing_items(a, b)
    if not items:
        return None
    first = items[0]
    div = dict(rank=a.rank, iteration=a.iteration, tensor=first, differing=tuple(items))
    if first == LOSS:
        return Divergence(
            **div,
            byte_offset=None,
            max_abs_diff=abs(a.loss - b.loss),
            why=f"loss {a.loss_hex} vs {b.loss_hex} (a scalar: no byte offset)",
        )
    ea, eb = a.tensors.get(first), b.tensors.get(first)
    if ea is None or eb is None:
        side = "first" if ea is None else "second"
        return Divergence(
            **div, byte_offset=None, max_abs_diff=None, why=f"not recorded in the {side} run"
        )
    if (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
        return Divergence(
            **div,
            byte_offset=None,
            max_abs_diff=None,
            why=f"{ea.dtype}{list(ea.shape)} vs {eb.dtype}{list(eb.shape)}",
        )
    ta, why_a = load_tensors(a_dir, a)
    tb, why_b = load_tensors(b_dir, b)
    if ta is None or tb is None:
        why = "; ".join(w for w in (why_a, why_b) if w)
        return Divergence(
            **div,
            byte_offset=None,
            max_abs_diff=None,
            why=f"SHA-256 differs; offset unknown: {why}",
        )
    x, y = ta[first], tb[first]
    ne = (tensor_bytes(x) != tensor_bytes(y)).nonzero()
    return Divergence(
        **div,
        byte_offset=int(ne[0]) if ne.numel() else None,
        max_abs_diff=max_abs_diff(x, y),
        why=f"{ea.dtype}{list(ea.shape)}, {int(ne.numel())} byte(s) differ",
    )


def _reruns(run: Run, label: str) -> list[RerunDiffered]:
    out = []
    for rank in sorted(run.traces):
        for old, new in run.traces[rank].reruns_differed:
            div = _locate(old, run.path, new, run.path)
            assert div is not None, "reader flagged a rerun whose records are equal"
            out.append(RerunDiffered(label, div, old.line, new.line))
    return out


def compare(reference: Path, run: Path) -> Verdict:
    """Compare ``run`` with ``reference`` (two run directories) byte for byte.

    Raises InvalidInput if either directory is missing, unreadable or holds no trace.
    Does not modify either directory.
    """
    ref, got = read_run(Path(reference)), read_run(Path(run))
    missing, unexpected, both = [], [], []
    for rank in sorted(set(ref.traces) | set(got.traces)):
        ra = ref.traces[rank].records if rank in ref.traces else {}
        rb = got.traces[rank].records if rank in got.traces else {}
        missing += [(rank, i) for i in sorted(set(ra) - set(rb))]
        unexpected += [(rank, i) for i in sorted(set(rb) - set(ra))]
        both += [(i, rank) for i in set(ra) & set(rb)]
    first, differing = None, 0
    for it, rank in sorted(both):
        a, b = ref.traces[rank].records[it], got.traces[rank].records[it]
        if a.same_content(b):
            continue
        differing += 1
        if first is None:
            first = _locate(a, ref.path, b, got.path)
    reruns = _reruns(ref, "reference") + _reruns(got, "run")
    return Verdict(
        reference=str(ref.path),
        run=str(got.path),
        exact=not (first or missing or unexpected or reruns),
        first_divergence=first,
        records_compared=len(both),
        iterations_compared=len({it for it, _ in both}),
        records_differing=differing,
        missing=tuple(missing),
        unexpected=tuple(unexpected),
        reruns_differed=tuple(reruns),
        rolled_back=sum(len(t.rolled_back) for t in got.traces.values()),
        notes=tuple(ref.notes + got.notes),
    )
