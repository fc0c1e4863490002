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
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
