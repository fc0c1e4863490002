"""``faultkit plan``: build a failure schedule and write it as JSON.

    faultkit plan every   --interval-s 600 --duration-s 1800 --world-size 8 --out plan.json
    faultkit plan poisson --mttf-s 600 --duration-s 86400 --world-size 8 --hof-ratio 0.5
    faultkit plan trace   --trace data/traces/bamboo_gcp_a100x1-east1b.txt \\
                          --start-s 44200 --length-s 4800 --world-size 8 --hof-ratio 0.5

Runs in the faultkit CLI process and only writes a file; replaying the plan against a
job (``faultkit run-plan``) is not here. ``register(subparsers)`` adds the subcommand to
an argparse parser so ``faultkit.cli`` can wire it in one line.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.errors import InvalidInput
from leto.sim.schedule import GCP_TRACE, Schedule, every, poisson, trace_window


def summary(schedule: Schedule) -> dict:
    """Count, HOF/FF counts and mean inter-arrival of a schedule, for the table."""
    return {
        "failures": len(schedule.failures),
        "HOF": schedule.hof_count,
        "FF": schedule.ff_count,
        "mean_interarrival_s": schedule.mean_interarrival_s(),
        "duration_s": schedule.duration_s,
        "world_size": schedule.world_size,
        "source": schedule.source.get("generator", "?"),
    }


def _flag(e: InvalidInput, generator: str) -> str:
    """The schedule's refusal, led by the flag it is about: its message names the field
    (``world_size=0: ...``), the flag's name with dashes (the trace window's length is
    the schedule's duration)."""
    m = re.search(r"\b([a-z_]+)=", str(e))
    if m is None:
        return str(e)
    field = m.group(1)
    flag = (
        "--length-s"
        if (generator, field) == ("trace", "duration_s")
        else f"--{field.replace('_', '-')}"
    )
    return f"{flag}: {e}"


def cmd_plan(args: argparse.Namespace) -> int:
    if args.mode in ("kernel-abort", "copy-corrupt") and args.phase != "any":
        from faultkit.inject import check_fault  # (imports torch: only when needed)

        try:  # a mode the phase cannot take is refused now, not when it is replayed
            check_fault(args.phase, args.mode)
        except ValueError as e:
            print(f"faultkit plan: {e}", file=sys.stderr)
            return 2
    common = {
        "world_size": args.world_size,
        "hof_ratio": args.hof_ratio,
        "seed": args.seed,
        "mode": args.mode,
        "phase": args.phase,
    }
    try:
        if args.generator == "every":
            s = every(args.interval_s, args.duration_s, first_s=args.first_s, **common)
        elif args.generator == "poisson":
            s = poisson(args.mttf_s, args.duration_s, **common)
        else:
            s = trace_window(args.trace, args.start_s, args.length_s, **common)
    except InvalidInput as e:
        print(f"faultkit plan: {_flag(e, args.generator)}", file=sys.stderr)
        return 2
    text = s.to_json()
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
        return 0
    t = Table(title=f"faultkit plan {args.generator}" + (f" -> {args.out}" if args.out else ""))
    t.add_column("item")
    t.add_column("value")
    for k, v in summary(s).items():
        t.add_row(k, f"{v:.1f}" if isinstance(v, float) else str(v))
    Console().print(t)
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``plan every|poisson|trace`` to a faultkit argparse subparsers object."""
    p = subparsers.add_parser("plan", help="build a failure schedule (JSON) for replay or sim")
    gens = p.add_subparsers(dest="generator", required=True)

    def common(g: argparse.ArgumentParser) -> None:
        g.add_argument("--world-size", type=int, required=True, help="ranks a failure may hit")
        g.add_argument(
            "--hof-ratio",
            type=float,
            default=1.0,
            help="fraction of failures that are HOFs (the rest FFs), exact to 1/(2n)",
        )
        g.add_argument("--seed", type=int, default=0, help="seed of kinds, ranks and arrivals")
        g.add_argument("--mode", default="kill", help="kill, kernel-abort or copy-corrupt")
        g.add_argument("--phase", default="any", help="a faultkit inject phase, or any")
        g.add_argument("--out", help="write the schedule JSON to this file")
        g.add_argument("--json", action="store_true", help="print the schedule JSON, no table")
        g.set_defaults(fn=cmd_plan)

    g = gens.add_parser("every", help="one failure every --interval-s seconds")
    g.add_argument("--interval-s", type=float, required=True, help="spacing of failures (s)")
    g.add_argument("--duration-s", type=float, required=True, help="length of the run (s)")
    g.add_argument(
        "--first-s",
        type=float,
        default=None,
        help="time of the first failure (s); default one interval",
    )
    common(g)
    g = gens.add_parser("poisson", help="exponential inter-arrivals with mean --mttf-s")
    g.add_argument("--mttf-s", type=float, required=True, help="mean time to failure (s)")
    g.add_argument("--duration-s", type=float, required=True, help="length of the run (s)")
    common(g)
    g = gens.add_parser("trace", help="preemption events of a window of a public trace")
    g.add_argument("--trace", default=str(GCP_TRACE), help="GCP samples or EC2 event log file")
    g.add_argument(
        "--start-s",
        type=float,
        default=0.0,
        help="window start, seconds from the trace's first sample",
    )
    g.add_argument(
        "--length-s",
        type=float,
        default=4800.0,
        help="window length (s); the paper replays 80 minutes",
    )
    common(g)
    return p
