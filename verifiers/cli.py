"""The verifiers command: ``python -m verifiers`` (console script ``leto-verify``).

    python -m verifiers compare REF RUN [--json]      exit 0 only if RUN equals REF exactly
    python -m verifiers report REF RUN [RUN...] --out DIR   loss.png and throughput.png

Runs in its own process after the runs have finished; reads run directories written by
``verifiers.Recorder`` and never modifies them. Exit codes: 0 exact (or report written),
1 not exact, 2 invalid input (missing or unreadable directory, no traces, bad rank).
Not covered: running the jobs themselves (faultkit does that).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.errors import InvalidInput
from verifiers.compare import Verdict, compare
from verifiers.trace import TRACE_GLOB

# How deep below a directory without traces to look for run directories that have
# them (faultkit's work directory: WORKDIR/<run>/train/rank0.trace.jsonl), and how many
# directories to visit at most (``/tmp`` given by mistake must still answer at once).
_BELOW_DEPTH = 3
_BELOW_VISITS = 2000


def _runs_below(root: Path) -> list[Path]:
    """Directories below ``root`` that hold traces, nearest first."""
    found, visits, level = [], 0, [root]
    for _ in range(_BELOW_DEPTH):
        nxt = []
        for d in level:
            try:
                subs = sorted(x for x in d.iterdir() if x.is_dir() and not x.is_symlink())
            except OSError:
                continue
            for x in subs:
                visits += 1
                if visits > _BELOW_VISITS:
                    return found
                if next(x.glob(TRACE_GLOB), None) is not None:
                    found.append(x)
                else:
                    nxt.append(x)
        level = nxt
    return found


def check_run_dirs(dirs: list[tuple[Path, str]]) -> None:
    """Refuse directories that cannot be runs before comparing anything, naming which
    argument each is (REF, RUN): every missing one first (``compare /tmp /nonexistent``
    must name /nonexistent, not /tmp's lack of traces), then any without traces — and,
    when directories below it have them (faultkit's work directory), those."""
    for path, what in dirs:
        if not path.exists():
            raise InvalidInput(f"{what} directory {path} does not exist; nothing was compared")
        if not path.is_dir():
            raise InvalidInput(f"{what} {path} is not a directory; pass a run's output directory")
    for path, what in dirs:
        if next(path.glob(TRACE_GLOB), None) is None:
            raise InvalidInput(f"{what} {path} holds no rank<N>.trace.jsonl{_hint(path, what)}")


def _hint(path: Path, what: str) -> str:
    below = _runs_below(path)
    if not below:
        return (
            "; a run directory is the training script's --out (with leto run --verify), or "
            "a faultkit work directory's reference/train or <faulted run>/train"
        )
    ref = [b for b in below if b.parent.name == "reference"]
    other = [b for b in below if b not in ref]
    pick = (ref or other)[0] if what == "REF" else (other or ref)[0]
    names = ", ".join(str(b.relative_to(path)) for b in below[:6])
    more = f" and {len(below) - 6} more" if len(below) > 6 else ""
    return (
        f"; below it: {names}{more} (a faultkit work directory holds one run per folder: "
        f"pass e.g. {pick})"
    )


def _ranges(pairs: tuple[tuple[int, int], ...]) -> str:
    """(rank, iteration) pairs as 'rank 0: 3-5, 9; rank 1: 4'."""
    by_rank: dict[int, list[int]] = {}
    for r, i in pairs:
        by_rank.setdefault(r, []).append(i)
    parts = []
    for r, its in sorted(by_rank.items()):
        runs, start, prev = [], its[0], its[0]
        for i in its[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            if i is not None:
                start = prev = i
        parts.append(f"rank {r}: {', '.join(runs)}")
    return "; ".join(parts) or "none"


def print_verdict(v: Verdict, console: Console | None = None) -> None:
    verdict = "[bold green]EXACT[/]" if v.exact else "[bold red]NOT EXACT[/]"
    t = Table(title=f"verifiers compare: {verdict}")
    t.add_column("item")
    t.add_column("value", overflow="fold")
    t.add_row("reference", v.reference)
    t.add_row("run", v.run)
    t.add_row(
        "compared",
        f"{v.records_compared} records ({v.iterations_compared} iterations), "
        f"{v.records_differing} differ",
    )
    d = v.first_divergence
    if d is None:
        t.add_row("first divergence", "none")
    else:
        t.add_row("first divergence", f"rank {d.rank}, iteration {d.iteration}, {d.tensor!r}")
        t.add_row("byte offset", str(d.byte_offset) if d.byte_offset is not None else "unknown")
        t.add_row(
            "largest |difference|",
            f"{d.max_abs_diff:.6g}" if d.max_abs_diff is not None else "unknown",
        )
        t.add_row("detail", d.why)
        if len(d.differing) > 1:
            t.add_row("also differing there", ", ".join(x for x in d.differing if x != d.tensor))
    t.add_row("missing from run", _ranges(v.missing))
    t.add_row("not in reference", _ranges(v.unexpected))
    t.add_row(
        "reruns that differed",
        "\n".join(r.describe() for r in v.reruns_differed) or "none",
    )
    if v.rolled_back:
        t.add_row("superseded by a checkpoint rollback", f"{v.rolled_back} record(s)")
    if v.notes:
        t.add_row("notes", "\n".join(v.notes))
    (console or Console()).print(t)


def cmd_compare(args: argparse.Namespace) -> int:
    check_run_dirs([(Path(args.reference), "REF"), (Path(args.run), "RUN")])
    v = compare(Path(args.reference), Path(args.run))
    if args.json:
        print(json.dumps(v.as_dict()))
    else:
        print_verdict(v)
    return 0 if v.exact else 1


def cmd_report(args: argparse.Namespace) -> int:
    # Imported here: matplotlib costs every other command ~0.4 s.
    from verifiers.plots import report

    check_run_dirs([(Path(args.reference), "REF"), *((Path(r), "RUN") for r in args.runs)])
    paths = report(Path(args.reference), [Path(r) for r in args.runs], Path(args.out), args.rank)
    for p in paths:
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m verifiers",
        description="compare runs with a fault-free reference byte for byte, and plot them",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compare", help="byte-for-byte verdict of RUN against REF (exit 0 if exact)")
    p.add_argument("reference", metavar="REF", help="the fault-free reference run directory")
    p.add_argument("run", metavar="RUN", help="the run directory to verify")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("report", help="write loss.png and throughput.png for REF and the runs")
    p.add_argument("reference", metavar="REF", help="the fault-free reference run directory")
    p.add_argument("runs", metavar="RUN", nargs="+", help="faulted run directories to plot")
    p.add_argument("--out", required=True, help="directory to write the PNG files into")
    p.add_argument("--rank", type=int, default=0, help="the rank whose trace is plotted")
    p.set_defaults(fn=cmd_report)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except InvalidInput as e:
        print(f"verifiers {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
