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
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.errors import InvalidInput
from leto.sim.scenarios import OMEGA_H200_16K

# Each row field: (header, format). Headers are short (they wrap, never "…"): at 80
# columns the field names cut every column to "depl…".
_COLUMNS = {
    "deployment": ("deployment", "{}"),
    "system": ("system", "{}"),
    "mttf_s": ("MTTF s", "{:.0f}"),
    "hof_ratio": ("HOF ratio", "{:.2f}"),
    "interval": ("ckpt every", "{}"),
    "t_iter_s": ("iter. s", "{:.2f}"),
    "t_eff_s": ("eff. iter. s", "{:.2f}"),
    "t_rec_s": ("rec. s", "{:.1f}"),
    "ettr": ("ETTR", "{:.1%}"),
    "paper_ettr": ("paper", "{:.1%}"),
    "model_ettr": ("model ETTR", "{:.1%}"),
    "failures": ("failures", "{}"),
    "hof": ("HOFs", "{}"),
    "mean_recovery_s": ("mean recovery s", "{:.1f}"),
    "mean_hof_recovery_s": ("HOF recovery s", "{:.1f}"),
    "mean_ff_recovery_s": ("FF recovery s", "{:.1f}"),
    "detection_s": ("detection s", "{:.0f}"),
    "init_s": ("init s", "{:.0f}"),
    "recompute_s": ("recompute s", "{:.0f}"),
    "recovery_restarts": ("recovery restarts", "{}"),
    "during_recompute": ("failures in recompute", "{}"),
    "h1": ("H1", "{}"),
    "omega": ("overhead", "{:.1%}"),
    "hof_beyond_h1": ("HOFs beyond H1", "{:.2%}"),
    "best": ("best", "{}"),
    "wasted_gpu_hours": ("wasted GPU h", "{:.1f}"),
    "recovery_gpu_hours": ("recovery GPU h", "{:.1f}"),
}


def _cell(row: dict, col: str) -> str:
    v = row[col]
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return _COLUMNS[col][1].format(v)


# What the terse headers mean, under each table that shows them.
_LEGEND = {
    "interval": "ckpt every: checkpoint interval, iterations",
    "t_iter_s": "iter. s: one fault-free iteration",
    "t_eff_s": "eff. iter. s: with protection and checkpoint costs",
    "t_rec_s": "rec. s: mean recovery",
    "paper_ettr": "paper: the paper's figure",
}


def _tables(rows: list[dict], title: str) -> list[Table]:
    """Rows as tables that fit the terminal (80 columns too): one per deployment when
    there are several; a column with one value in every row of a table goes to its
    title (none at all when it has no value); a table still too wide, with fewer rows
    than columns, is transposed."""
    cols = [c for c in _COLUMNS if rows and c in rows[0]]
    deployments = list(dict.fromkeys(r["deployment"] for r in rows)) if "deployment" in cols else []
    groups = [[r for r in rows if r["deployment"] == d] for d in deployments]
    if len(groups) < 2:
        groups = [rows]
    width = Console().width
    out = []
    for group in groups:
        if len(group) == 1:
            same = [c for c in cols if c == "deployment"]
        else:
            same = [c for c in cols if len({_cell(r, c) for r in group}) == 1]
        shown = [c for c in cols if c not in same]
        sub = ", ".join(
            f"{_COLUMNS[c][0]} {_cell(group[0], c)}" for c in same if _cell(group[0], c) != "-"
        )
        head = f"{title}\n{sub}" if sub else title
        legend = "; ".join(_LEGEND[c] for c in shown if c in _LEGEND) or None
        t = Table(title=head, caption=legend, min_width=min(width, len(title) + 4))
        for c in shown:
            t.add_column(_COLUMNS[c][0], overflow="fold")
        for r in group:
            t.add_row(*[_cell(r, c) for c in shown])
        if Console(width=10_000).measure(t).maximum > width and len(group) < len(shown):
            # One column per row, named by the row's first field.
            key, rest = shown[0], shown[1:]
            t = Table(title=head, caption=legend, min_width=min(width, len(title) + 4))
            t.add_column("")
            for r in group:
                name = _cell(r, key) if key == "system" else f"{_COLUMNS[key][0]} {_cell(r, key)}"
                t.add_column(name, overflow="fold")
            for c in rest:
                t.add_row(_COLUMNS[c][0], *[_cell(r, c) for r in group])
        out.append(t)
    return out


def _print(rows: list[dict], title: str, as_json: bool) -> None:
    if as_json:
        # NaN (a mean over no failures) is not JSON: null.
        clean = [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
            for r in rows
        ]
        print(json.dumps(clean))
        return
    console = Console()
    for t in _tables(rows, title):
        console.print(t)


def cmd_sim(args: argparse.Namespace) -> int:
    from leto.sim import plots, scenarios
    from leto.sim.schedule import Schedule

    try:
        if args.sim_command == "scenarios":
            rows = scenarios.scenario_grid(args.deployment, args.mttf_s, args.hof_ratio)
            if args.png:
                plots.scenario_bars(rows, args.png)
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
        help="MTTFs in seconds (one panel each in --png)",
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
