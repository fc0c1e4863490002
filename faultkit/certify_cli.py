"""``faultkit certify``: the command line of ``faultkit.certify``.

    faultkit certify --nproc-per-node 2 -- train.py --batch 8
    faultkit certify --device cuda --separately --time-budget 1800 --json -- train.py

Runs in the faultkit CLI process. Progress (a line per stage) on stderr; the verdict
table, or one JSON object with ``--json``, on stdout. Exit code: 0 EXACT, 1 NOT EXACT,
3 INCOMPLETE (time budget, or a phase never reached), 2 refused before anything ran.
``register(subparsers)`` wires it into ``faultkit.cli`` in one line.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from faultkit.cli_common import keep_if_not_exact, progress, refuse, workdir, workdir_flags

EXIT = {"EXACT": 0, "NOT EXACT": 1, "INCOMPLETE": 3}


def cmd_certify(args: argparse.Namespace) -> int:
    from faultkit.certify import CertifyConfig, certify, check
    from faultkit.inject import PHASES

    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    cfg = CertifyConfig(
        script=args.script,
        script_args=tuple(script_args),
        nproc_per_node=args.nproc_per_node,
        device=args.device,
        phases=tuple(args.phases.split(",")) if args.phases else tuple(PHASES),
        separately=args.separately,
        budget_s=args.time_budget,
        keep_tensors=args.keep_tensors,
        cwd=args.cwd or "",
        ranks_per_gpu=args.ranks_per_gpu,
        undo=args.undo,
    )
    try:
        check(cfg)  # before the work directory, before anything runs
    except ValueError as e:
        return refuse("certify", e, args)
    with progress("certify") as say, workdir(args, say) as (work, keep):
        try:
            v = certify(cfg, work)
        except (ValueError, RuntimeError) as e:
            return refuse("certify", e, args)
        keep_if_not_exact(keep, v["verdict"] != "NOT EXACT")
        v["workdir"] = str(work)
        v["workdir_kept"] = bool(keep["why"])
    if args.json:
        print(json.dumps(v))
    else:
        _table(v)
    return EXIT[v["verdict"]]


def _table(v: dict) -> None:
    console = Console()
    colour = {"EXACT": "green", "NOT EXACT": "red", "INCOMPLETE": "yellow"}[v["verdict"]]
    t = Table(
        title=f"faultkit certify {v['script']}: [bold {colour}]{v['verdict']}[/]",
        title_justify="left",
    )
    # recovered: this fault's I + R (failure until its interrupted iteration completed
    # again; under --verify, so the verifiers' digest is in it); I and R apart: --json
    for c in ("phase", "rank", "iteration", "lost", "recovered (I + R)", "result"):
        t.add_column(c, overflow="fold")
    for r in v["faults"]:
        lost = f"{r['pages_lost_per_group']}/group" + (" +host" if r["host_parity_pages"] else "")
        if r["unreached"]:
            result = "[yellow]not reached[/]"
        elif r["exact"]:
            result = "[green]EXACT[/]"
        elif r["diverged_after"]:
            result = "[red]diverged after this fault[/]"
        elif r["after_divergence"]:
            result = "(after the divergence)"
        else:
            result = "[red]NOT EXACT[/]"
        rec = r.get("recovery_s")
        t.add_row(
            r["phase"], str(r["rank"]), str(r["iteration"]), lost,
            f"{rec:.2f} s" if rec else "-", result,
        )  # fmt: skip
    for p in v["not_run"]:
        t.add_row(p, "-", "-", "-", "-", "[yellow]not run (time budget)[/]")
    console.print(t)
    say = console.print
    say(f"{v['iterations']} iteration(s), {v['nproc_per_node']} rank(s) on {v['device']}; "
        f"{v['total_s']:.0f} s in all")  # fmt: skip
    if v["reference_error"]:
        say(f"[red]the fault-free run failed[/]: {v['reference_error']}")
    if v["first_divergence"]:
        say(f"[red]first divergence[/]: {v['first_divergence']}")
    if v["hint"]:
        say(f"[bold]hint[/]: {v['hint']}")
    if v["unreached"]:
        say(
            f"not reached in this job: {', '.join(v['unreached'])} (the script's iterations "
            "never pass those points; nothing was judged there)"
        )
    for path in v.get("files_truncated", []):
        say(
            f'[yellow]emptied after a recovery[/]: the script opened {path} with "w" when '
            "it ran again: what the failed trainer wrote there was lost (the training is "
            'exact) — open it with "a" when ctx.generation > 0 (docs/porting.md)'
        )
    if v["workdir_kept"]:
        say(f"runs kept in {v['workdir']}")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``certify`` to a faultkit argparse subparsers object."""
    from faultkit.cli_common import UNDO_HELP
    from faultkit.inject import PHASES
    from leto.job.config import UNDO_MODES

    p = subparsers.add_parser(
        "certify",
        help="your own Leto script under leto run, fault-free and with a rank killed at "
        "every phase (pages lost): EXACT or the first divergence and its usual causes",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks (as leto run)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (as leto run)")
    p.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        help="ranks sharing each GPU over gloo (as leto run; testing on fewer GPUs)",
    )
    p.add_argument("--undo", choices=UNDO_MODES, default="chunk", help=UNDO_HELP)
    p.add_argument(
        "--phases",
        default=None,
        help=f"comma-separated phases to strike (default all: {', '.join(PHASES)})",
    )
    p.add_argument(
        "--separately",
        action="store_true",
        help="one faulted run per phase (default: every fault in one run, one per recovery)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help="stop starting runs once S seconds have passed (the verdict is then INCOMPLETE)",
    )
    p.add_argument(
        "--keep-tensors",
        action="store_true",
        help="save every traced tensor, so a divergence names its byte (disk: the retained "
        "state once per iteration and rank)",
    )
    p.add_argument(
        "--cwd",
        default=None,
        metavar="DIR",
        help="start every run of the script in DIR (for a script that opens files relative "
        "to where it starts, as nanoGPT's configurator.py); default: each run in its own "
        "folder, relative paths among the script's arguments made absolute",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    workdir_flags(p)
    p.add_argument("script", help="the ported script (leto.init, leto.Run)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(fn=cmd_certify)
    return p
