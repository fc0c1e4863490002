"""``leto bench``: benchmarks that drive ``leto run`` end to end, from the command line.

    leto bench ettr ...   measured ETTR: Leto vs Gemini-style vs torchrun + DCP (bench/ettr.py)

Runs in the CLI process. The benchmarks live in the source checkout's ``bench/`` (next
to this package), which is not installed: ``leto bench`` works from a checkout
(editable install) and says so elsewhere. ``register(subparsers)`` adds ``bench`` to
the ``leto`` parser.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    """Import ``bench.<name>`` from this checkout (put first on the path: another
    distribution's top-level ``bench`` must not shadow ours)."""
    if (CHECKOUT / "bench" / f"{name}.py").is_file() and str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(f"bench.{name}")


def register(sub) -> None:
    p = sub.add_parser("bench", help="end-to-end benchmarks (from a source checkout)")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    try:
        ettr = _bench("ettr")
    except ImportError as e:
        why = f"{e}"

        def missing(args) -> int:
            print(
                f"leto bench: the benchmarks are in the source checkout's bench/ ({why}); "
                "run from a checkout: pip install -e .",
                file=sys.stderr,
            )
            return 2

        q = bsub.add_parser("ettr", help="(needs a source checkout)")
        q.set_defaults(fn=missing)
        return
    ettr.register(bsub)
