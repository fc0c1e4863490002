"""torchtitan's user path, side by side: ``torchrun -m torchtitan.train`` against
``leto run -m leto.titan.train`` (``leto run``'s default flags), the same torchtitan flags,
one after the other in one run.

* ``exact``: the Llama 3 debug model, deterministic (``examples/titan/debug_job.py``'s
  flags): the two runs' last checkpoints (parameters, optimizer state, schedulers, data
  loader, train state) and TensorBoard losses compared bit for bit
  (``examples/titan/compare.py``).
* ``overhead``: a Llama 3.2 1B-shaped model (``examples/titan/flavors.py``, 1.50 B
  parameters) at torchtitan's defaults otherwise (fused AdamW, bf16 autocast,
  selective activation checkpointing): torchtitan's own tokens/s per step, the median
  over the steps after ``--skip``, and the ratio.

    python -m bench.titan_path exact --json out/titan_exact.json
    python -m bench.titan_path overhead --steps 30 --skip 10 --json out/titan_overhead.json

Every run has a time limit (``--timeout-s``). Not covered: recovery
(``bench.plain_recovery --script examples/titan/debug_job.py``), world sizes above 1.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TITAN = REPO / "examples" / "titan"
TPS = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+)")


def _flags(iterations: int, out: Path) -> list[str]:
    got = subprocess.run(
        [sys.executable, str(TITAN / "debug_job.py"), "--print-flags", "--iterations",
         str(iterations), "--out", str(out)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return got.stdout.split()


def _run(kind: str, flags: list[str], dump: Path, log: Path, timeout_s: float) -> dict:
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", "-m", "torchtitan.train"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "leto.cli", "run", "--nproc-per-node", "1",
               "--log-dir", str(dump.parent / f"{dump.name}-leto-run"), "-m", "leto.titan.train"]  # fmt: skip
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(
            [*cmd, *flags, "--job.dump_folder", str(dump)], stdout=f, stderr=subprocess.STDOUT,
            timeout=timeout_s, cwd=REPO,
        )  # fmt: skip
    steps = {int(s): int(t.replace(",", "")) for s, t in TPS.findall(log.read_text())}
    return {"run": kind, "code": p.returncode, "wall_s": time.time() - t0, "tps": steps}


def exact(args, work: Path) -> dict:
    sys.path.insert(0, str(TITAN))
    from compare import compare

    flags = _flags(args.steps, work)
    runs = [
        _run(k, flags, work / k, work / f"{k}.log", args.timeout_s) for k in ("torchrun", "leto")
    ]
    diff = None if any(r["code"] for r in runs) else compare(work / "torchrun", work / "leto")
    verdict = "EXACT" if diff is None and not any(r["code"] for r in runs) else "NOT EXACT"
    return {"what": "exact", "runs": runs, "first_difference": diff, "verdict": verdict}


def overhead(args, work: Path) -> dict:
    flags = [
        *_flags(args.steps, work),
        "--experimental.custom_import", "examples.titan.flavors", "--model.flavor", "1B",
        "--training.seq_len", str(args.seq), "--training.local_batch_size", str(args.batch),
        "--debug.no-deterministic", "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
    ]  # fmt: skip
    runs = [
        _run(k, flags, work / k, work / f"{k}.log", args.timeout_s) for k in ("torchrun", "leto")
    ]
    for r in runs:
        steady = [t for s, t in r["tps"].items() if s > args.skip]
        r["median_tps"] = statistics.median(steady) if steady else None
    a, b = (r["median_tps"] for r in runs)
    return {
        "what": "overhead", "tokens_per_step": args.seq * args.batch, "runs": runs,
        "ratio": (a / b) if a and b else None,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("exact", "overhead"))
    ap.add_argument("--steps", type=int, default=None, help="default: exact 20, overhead 30")
    ap.add_argument("--skip", type=int, default=10, help="overhead: steps left out (warm-up)")
    ap.add_argument("--seq", type=int, default=4096, help="overhead: sequence length")
    ap.add_argument("--batch", type=int, default=4, help="overhead: local batch size")
    ap.add_argument("--timeout-s", type=float, default=400)
    ap.add_argument("--work-dir", help="default: a new temporary folder")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    args.steps = args.steps or (20 if args.what == "exact" else 30)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"titan-{args.what}-"))
    work.mkdir(parents=True, exist_ok=True)
    got = (exact if args.what == "exact" else overhead)(args, work)
    print(json.dumps(got if args.what == "exact" else {**got, "runs": [
        {k: v for k, v in r.items() if k != "tps"} for r in got["runs"]]}, indent=1))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    bad = any(r["code"] for r in got["runs"]) or got.get("verdict") == "NOT EXACT"
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
