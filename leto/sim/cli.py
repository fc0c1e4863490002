"""``leto sim``: the ETTR model and simulator from the command line.

    leto sim scenarios       [--mttf-s 600 ...] [--hof-ratio 0 0.5 1]   Fig. 14/15 grid
    leto sim sweep-interval  --deployment deepseek-v3-16k --intervals 1 4 16 64   (Fig. 9)
    leto sim sweep-hof       --deployment deepseek-v3-16k --hof-ratio 0 0.25 0.5 1 (Fig. 10)
    leto sim replay          --deployment kimi-testbed --schedule plan.json

Every subcommand prints a rich table, or one JSON document with ``--json``, and draws a
PNG with ``--png PATH``. Runs in the CLI process. ``register(subparsers)`` adds ``sim``
to the ``leto`` parser; wiring it into ``leto.cli`` is one call there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.errors import InvalidInput
from leto.sim.scenarios import OMEGA_H200_16K

_COLUMNS = {
    "deployment": "{}",
    "system": "{}",
    "mttf_s": "{:.0f}",
    "hof_ratio": "{:.2f}",
    "interval": "{}",
    "t_iter_s": "{:.2f}",
    "t_eff_s": "{:.2f}",
    "t_rec_s": "{:.1f}",
    "ettr": "{:.1%}",
    "paper_ettr": "{:.1%}",
    "model_ettr": "{:.1%}",
    "failures": "{}",
    "hof": "{}",
    "mean_recovery_s": "{:.1f}",
    "mean_hof_recovery_s": "{:.1f}",
    "mean_ff_recovery_s": "{:.1f}",
    "detection_s": "{:.0f}",
    "init_s": "{:.0f}",
    "recompute_s": "{:.0f}",
    "recovery_restarts": "{}",
    "during_recompute": "{}",
    "h1": "{}",
    "omega": "{:.1%}",
    "hof_beyond_h1": "{:.2%}",
    "best": "{}",
    "wasted_gpu_hours": "{:.1f}",
    "recovery_gpu_hours": "{:.1f}",
}


def _print(rows: list[dict], title: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows))
        return
    cols = [c for c in _COLUMNS if rows and c in rows[0]]
    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*["-" if r[c] is None else _COLUMNS[c].format(r[c]) for c in cols])
    Console().print(t)


def cmd_sim(args: argparse.Namespace) -> int:
    from leto.sim import plots, scenarios
    from leto.sim.schedule import Schedule

    try:
        if args.sim_command == "scenarios":
            rows = scenarios.scenario_grid(args.deployment, args.mttf_s, args.hof_ratio)
            if args.png:
                plots.scenario_bars(rows, args.mttf_s[0], args.png)
            title = "leto sim scenarios (analytic ETTR, paper Fig. 14/15)"
        elif args.sim_command == "sweep-interval":
            rows = scenarios.sweep_interval(
                args.deployment, args.intervals, args.mttf_s, args.hof_ratio
            )
            if args.png:
                plots.lines(
                    rows,
                    "interval",
                    args.png,
                    "checkpoint interval (iterations)",
                    f"{args.deployment}: ETTR vs interval",
                )
            title = "leto sim sweep-interval (paper Fig. 9)"
        elif args.sim_command == "sweep-hof":
            rows = scenarios.sweep_hof(args.deployment, args.hof_ratio, args.mttf_s)
            if args.png:
                plots.lines(
                    rows,
                    "hof_ratio",
                    args.png,
                    "HOF ratio",
                    f"{args.deployment}: ETTR vs HOF ratio",
                )
            title = "leto sim sweep-hof (paper Fig. 10)"
        elif args.sim_command == "h1":
            rows = scenarios.sweep_h1(
                args.deployment,
                _pairs(args.omega, "--omega", int, float),
                _pairs(args.pages_per_error, "--pages-per-error", int, float),
                args.memory_fraction,
                args.mttf_s,
                args.hof_ratio,
            )
            best = next(r for r in rows if r["best"])
            title = (
                f"leto sim h1: ETTR against tier-1 parity pages — best H1 = {best['h1']} "
                f"({best['ettr']:.1%})"
            )
        else:
            schedule = Schedule.from_json(Path(args.schedule).read_text())
            rows = scenarios.replay(args.deployment, schedule, interval=args.interval)
            if args.png:
                plots.lines(rows, "interval", args.png, "interval", "replay")
            title = f"leto sim replay {args.schedule} (discrete-event)"
    except (InvalidInput, OSError) as e:
        print(f"leto sim: {e}", file=sys.stderr)
        return 2
    _print(rows, title, args.json)
    return 0


def _pairs(items: list[str], flag: str, kt, vt) -> dict:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        try:
            if not sep:
                raise ValueError
            out[kt(k)] = vt(v)
        except ValueError:
            raise InvalidInput(f"{flag} {it!r}: expected KEY=VALUE, e.g. 4=0.108") from None
    return out


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``sim scenarios|sweep-interval|sweep-hof|h1|replay`` to the leto parser."""
    p = subparsers.add_parser("sim", help="ETTR model and failure simulator (paper Appendix C)")
    sub = p.add_subparsers(dest="sim_command", required=True)

    def out(g: argparse.ArgumentParser) -> None:
        g.add_argument("--json", action="store_true", help="print rows as JSON, no table")
        g.add_argument("--png", help="also draw the figure to this PNG file")
        g.set_defaults(fn=cmd_sim)

    g = sub.add_parser("scenarios", help="Table 5 deployments x MTTF x HOF ratio")
    g.add_argument(
        "--deployment",
        nargs="+",
        default=["deepseek_v2_1k", "deepseek_v3_16k", "deepseek_v4_128k"],
        help="profile names or .json paths",
    )
    g.add_argument(
        "--mttf-s",
        type=float,
        nargs="+",
        default=[600.0, 1800.0, 3600.0],
        help="MTTFs in seconds (the first one is plotted)",
    )
    g.add_argument("--hof-ratio", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="HOF ratios")
    out(g)
    g = sub.add_parser("sweep-interval", help="ETTR against checkpoint interval")
    g.add_argument("--deployment", default="deepseek_v3_16k", help="profile name or .json path")
    g.add_argument(
        "--intervals",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64, 128],
        help="checkpoint intervals in iterations",
    )
    g.add_argument("--mttf-s", type=float, default=600.0, help="MTTF in seconds")
    g.add_argument("--hof-ratio", type=float, default=1.0, help="HOF ratio")
    out(g)
    g = sub.add_parser("sweep-hof", help="ETTR against HOF ratio")
    g.add_argument("--deployment", default="deepseek_v3_16k", help="profile name or .json path")
    g.add_argument(
        "--hof-ratio",
        type=float,
        nargs="+",
        default=[0.0, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 1.0],
        help="HOF ratios",
    )
    g.add_argument("--mttf-s", type=float, default=600.0, help="MTTF in seconds")
    out(g)
    g = sub.add_parser("h1", help="ETTR against the number of tier-1 parity pages H1")
    g.add_argument("--deployment", default="deepseek_v3_16k", help="profile name or .json path")
    g.add_argument(
        "--omega",
        nargs="+",
        default=[f"{k}={v}" for k, v in sorted(OMEGA_H200_16K.items())],
        help="H1=OVERHEAD pairs, the RMU's measured steady overhead at each H1 (default: "
        "the H200 figures at 16 K tokens per iteration, docs/benchmarks.md)",
    )
    g.add_argument(
        "--pages-per-error",
        nargs="+",
        default=["16=1.0"],
        help="PAGES=PROBABILITY pairs: device pages of one group a memory error retires "
        "(default 16, the paper's MI300X row)",
    )
    g.add_argument(
        "--memory-fraction",
        type=float,
        default=0.3,
        help="fraction of HOFs that retire device pages (the rest lose none)",
    )
    g.add_argument("--mttf-s", type=float, default=600.0, help="MTTF in seconds")
    g.add_argument("--hof-ratio", type=float, default=1.0, help="HOF ratio")
    out(g)
    g = sub.add_parser("replay", help="discrete-event replay of a faultkit schedule")
    g.add_argument("--deployment", default="kimi_testbed", help="profile name or .json path")
    g.add_argument("--schedule", required=True, help="schedule JSON from `faultkit plan`")
    g.add_argument(
        "--interval",
        type=int,
        default=None,
        help="checkpoint interval; default Young's at the schedule's realised rate",
    )
    out(g)
    return p
