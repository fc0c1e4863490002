"""The ``leto`` command. Subcommands are added as the runtime grows; each maps onto a
frozen config or a module's public function, one flag to one field.

    leto info            what this machine offers Leto: torch, devices, codec kernels
    leto pool status     allocations, pages, groups, failed and rebuilt pages of a pool
    leto sim ...         ETTR model and failure simulator (docs/sim.md)
    leto run ...         launch a script like torchrun, with shadows and in-place recovery
    leto bench ettr ...  measured ETTR: Leto vs Gemini-style vs torchrun + DCP (bench/ettr.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.table import Table

import leto
from leto.bench_cli import register as register_bench
from leto.pool_cli import register as register_pool
from leto.run_cli import register as register_run
from leto.sim.cli import register as register_sim


def _codec_kernels() -> dict[str, str]:
    import torch

    from leto.erasure.kernels import cpu

    c = cpu.native() is not None  # what the CPU kernel runs here: C, or NumPy without it
    found = {
        "reference": "available (host, per-symbol Python)",
        "cpu": (
            "available (split tables: the C kernel gf_cpu.c)"
            if c
            else f"available (split tables: NumPy — no C compiler, or {cpu.ENV_CPU_CODEC}=numpy)"
        ),
    }
    if not torch.cuda.is_available():
        found["cuda"] = "unavailable: torch sees no CUDA device"
        return found
    try:
        from leto.erasure.kernels import by_name

        by_name("cuda")
        found["cuda"] = f"available on {torch.cuda.get_device_name()}"
    except Exception as e:  # report, don't crash: this command is for diagnosis
        found["cuda"] = f"unavailable: {e}"
    return found


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from leto.erasure import FIELD_POLY

    info = {
        "leto": leto.__version__,
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "field_poly": hex(FIELD_POLY),
        "codec_kernels": _codec_kernels(),
    }
    if args.json:
        print(json.dumps(info))
        return 0
    table = Table(title="leto info")
    table.add_column("item")
    table.add_column("value")
    for k, v in info.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                table.add_row(f"{k}.{kk}", str(vv))
        else:
            table.add_row(k, str(v))
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="leto", description="Leto: in-place recovery for PyTorch training"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "info", help="show what this machine offers Leto (torch, devices, codec kernels)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(fn=cmd_info)
    register_pool(sub)
    register_sim(sub)
    register_run(sub)
    register_bench(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


def console() -> None:
    """The ``leto`` command (and ``python -m leto.cli``). After ``leto run`` the process
    exits as the interpreter would — non-daemon threads joined, ``atexit`` run, streams
    flushed — less the teardown of its modules: the agent holds torch, whose teardown
    took 0.5 s of a core at the end of every job (once its summary was printed)."""
    code = main()
    if sys.argv[1:2] != ["run"]:
        sys.exit(code)
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        f.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
