"""The ``faultkit`` command.

faultkit probe       which fault mechanisms this machine has (real or emulated)
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from faultkit.mechanisms import probe


def cmd_probe(args: argparse.Namespace) -> int:
    m = probe()
    if args.json:
        print(json.dumps(m.as_dict()))
        return 0
    table = Table(title="faultkit probe: mechanisms on this machine")
    table.add_column("fault")
    table.add_column("mechanism used")
    table.add_column("why")
    table.add_row("host page poisoning", m.host_poison, m.host_poison_why)
    table.add_row("device page loss", m.device_page_loss, m.device_page_loss_why)
    Console().print(table)
    return 0


def cmd_inject(args: argparse.Namespace) -> int:
    from faultkit.inject import InjectConfig, inject

    cfg = InjectConfig(
        phase=args.phase,
        pages=args.pages,
        host_parity_pages=args.host_parity_pages,
        mode=args.mode,
        rank=args.rank,
        iterations=args.iterations,
        seed=args.seed,
        world_size=args.world_size,
        device=args.device,
    )
    try:
        v = inject(cfg)
    except (ValueError, RuntimeError) as e:
        print(f"faultkit inject: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(v))
        return 0 if v["exact"] else 1
    verdict = "[bold green]EXACT[/]" if v["exact"] else "[bold red]NOT EXACT[/]"
    if v["fatal"]:
        verdict = "[bold red]FATAL FAILURE[/] (NOT EXACT)"
    t = Table(title=f"faultkit inject: {verdict}")
    t.add_column("item")
    t.add_column("value")
    rows = [
        ("fault", f"{v['mode']} rank {v['config']['rank']} at {v['point']} ({v['phase']})"),
        ("injections / recoveries", f"{v['injections']} / {v['recoveries']}"),
        (
            "device pages lost / rebuilt (all ranks)",
            f"{v['pages_lost_device']} / {v['pages_rebuilt']}",
        ),
        ("host parity pages lost / rebuilt", f"{v['pages_lost_host']} / {v['host_pages_rebuilt']}"),
        (
            "page-loss mechanism",
            f"device: {v['poison_mechanism']['device']}; host: {v['poison_mechanism']['host']}"
            if v["poison_mechanism"]
            else "-",
        ),
        (
            "recovery (cold restart to training, slowest rank)",
            f"{v['recovery_s']:.2f} s" if v["recovery_s"] else "-",
        ),
        ("first divergence", v["first_divergence"] or "none"),
        (
            "runs",
            f"reference {v['reference_run_s']:.1f} s, faulted {v['faulted_run_s']:.1f} s, in {v['workdir']}",
        ),
    ]
    if v["fatal_detail"]:
        rows.append(("fatal", v["fatal_detail"]))
    for k, val in rows:
        t.add_row(k, str(val))
    Console().print(t)
    return 0 if v["exact"] else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="faultkit", description="fault injection for Leto and PyTorch jobs"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "probe", help="show which fault mechanisms this machine has (real or emulated)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(fn=cmd_probe)
    p = sub.add_parser(
        "inject", help="run the example job fault-free and faulted, and compare bit for bit"
    )
    p.add_argument(
        "--phase",
        default="update",
        help="compute, allreduce, grad-parity, sync, update, parity-copy, tier2 or any",
    )
    p.add_argument(
        "--pages",
        type=int,
        default=0,
        help="device pages lost per protection group (more than H1=16 is fatal)",
    )
    p.add_argument(
        "--host-parity-pages",
        type=int,
        default=0,
        help="tier-1 host parity pages lost in the first group",
    )
    p.add_argument(
        "--mode",
        default="kill",
        help="kill (SIGKILL at the phase); other modes are not available yet",
    )
    p.add_argument("--rank", type=int, default=0, help="the rank that fails")
    p.add_argument(
        "--iterations",
        type=int,
        default=6,
        help="training iterations (the fault hits the middle one)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the job and of the fault draw")
    p.add_argument("--world-size", type=int, default=2, help="data-parallel ranks")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(fn=cmd_inject)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
