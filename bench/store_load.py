"""The agent's load on the job's TCPStore: requests per second while N trainers beat.

Runs ``leto run`` (shadows off, CPU) on a trainer that only beats every 0.1 s, once per
``--beat-poll-s`` value, and prints the agent's own count of store requests (its
summary's ``store_requests_per_s``). ``--beat-poll-s 0`` reads every rank's beat every
20 ms poll, as the agent did before heartbeats were read on their own period.

    python -m bench.store_load --nproc-per-node 8 --seconds 10

Not covered: the trainers' own requests (heartbeats), other nodes' agents.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.job.store import free_port

SCRIPT = Path(__file__).resolve().parent / "scripts" / "beating_trainer.py"


def measure(nproc: int, seconds: float, beat_poll_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable, "-m", "leto.cli", "run", "--json", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), "--shadow-level", "off",
            "--beat-poll-s", str(beat_poll_s), "--log-level", "WARNING", "--log-dir", d,
            str(SCRIPT), str(seconds),
        ]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
        if p.returncode != 0:
            raise RuntimeError(f"leto run exited {p.returncode}: {p.stderr[-2000:]}")
        s = json.loads(p.stdout.strip().splitlines()[-1])
    return {"beat_poll_s": beat_poll_s, "requests": s["store_requests"],
            "requests_per_s": s["store_requests_per_s"]}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc-per-node", type=int, default=8, help="trainers (ranks)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the trainers beat")
    ap.add_argument("--beat-poll-s", default="0,0.25", help="values to compare, comma-separated")
    ap.add_argument("--json-out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    rows = [
        measure(args.nproc_per_node, args.seconds, float(v)) for v in args.beat_poll_s.split(",")
    ]
    t = Table(title=f"agent store requests, {args.nproc_per_node} ranks, {args.seconds:g} s")
    for c in ("heartbeats read every", "requests", "requests / s"):
        t.add_column(c, justify="right")
    for r in rows:
        every = "poll (20 ms)" if r["beat_poll_s"] == 0 else f"{r['beat_poll_s']:g} s"
        t.add_row(every, str(r["requests"]), f"{r['requests_per_s']:.0f}")
    Console().print(t)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
