"""Recovery of a plain script: how long after a kill its ranks train again.

Runs ``examples/porting/gpt_leto.py`` — the plain port of a nanoGPT-style script, with no
line added for Leto's sake (issue 37: its promoted trainer once spent 3.65 s of a
3.87 s recovery importing ``torch._dynamo``) — under ``leto run`` (``faultkit.job``), one
rank SIGKILLed at ``--at``, ``--trials`` times. Per trial: "to training" (the kill's
detection to the slowest promoted trainer's first training step, less the verifiers'
digest), the progress regained (``bench.recovery_speed.regained_s``), what each promoted
trainer still imported on its way (``promoted_imports``; empty is the goal) and what its
shadow imported ahead while parked (``imports_warmup_s``). ``--warmup both`` runs each
trial with and without the parked shadow's generic warm-up (``leto.trainer.warmup.
generic_step``, for scripts that give none). Prints a table, writes JSON.

    python -m bench.plain_recovery --trials 3
    python -m bench.plain_recovery --device cuda --nproc-per-node 1 --shadow-level L3 \\
        --script-args="--n-layer 20 --n-embd 2048 --n-head 16 --seq 1024 --batch 16"

Not covered: the example job's recovery against torchrun + checkpoint
(``bench/recovery_speed.py``), page losses (this measures the promoted path, not the
rebuild).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.recovery_speed import regained_s
from faultkit.job import REPO, JobFault, run_job
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig

SCRIPT = Path(REPO) / "examples" / "porting" / "gpt_leto.py"
# 6.6 M parameters, 4 K tokens a rank: seconds an iteration on two CPU cores.
CPU_SHAPE = "--n-layer 7 --n-embd 256 --n-head 4 --vocab 4096 --seq 256 --batch 8 --accum 2"


def trial(args, out: Path) -> dict:
    fail_at = int(args.at.split("@")[1].split("#")[0])
    pool = {"pool": PoolConfig.for_cuda(0, tier1_pages=4)} if args.device == "cuda" else {}
    got = run_job(
        args.nproc_per_node, TrainConfig(), out, [JobFault(args.nproc_per_node - 1, args.at)],
        shadow_level=args.shadow_level, script=Path(args.script).resolve(), device=args.device,
        script_args=[*shlex.split(args.script_args), "--iterations", str(args.iterations),
                     "--out", str(out / "train")],
        **pool,
    )  # fmt: skip
    rec = got["recoveries"][0]
    tr = rec["trainers"]
    to_training = max(t["time"] - t.get("observer_s", 0.0) for t in tr.values())
    return {
        "to_training_s": to_training - rec["detected_at"],
        "regained_s": max(
            regained_s(out / "train", int(r), rec["detected_at"], fail_at) for r in tr
        ),
        "promoted_imports": {r: t.get("promoted_imports", []) for r, t in tr.items()},
        "promoted_imports_s": max(t.get("promoted_imports_s", 0.0) for t in tr.values()),
        "imports_warmup_s": max(t.get("imports_warmup_s", 0.0) for t in tr.values()),
        "parked_after_s": max(t.get("parked_after_s", 0.0) for t in tr.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--nproc-per-node", type=int, default=2, help="ranks (the last is killed)")
    ap.add_argument("--shadow-level", default="L2", help="L1, L2 or L3")
    ap.add_argument("--at", default="compute.forward@4#1", help="the kill's fault point")
    ap.add_argument("--iterations", type=int, default=8, help="iterations per job")
    ap.add_argument("--trials", type=int, default=3, help="jobs, one kill each")
    ap.add_argument(
        "--script-args",
        default=CPU_SHAPE,
        help="the script's shape flags, one string (write it with '=')",
    )
    ap.add_argument(
        "--warmup",
        choices=("generic", "none", "both"),
        default="generic",
        help="the parked shadow's warm-up of a script that gives none: Leto's generic "
        "step (the default), none (LETO_GENERIC_WARMUP=0), or both, side by side per trial",
    )
    ap.add_argument(
        "--script",
        default=str(SCRIPT),
        help="the job (default: the nanoGPT-style port; e.g. examples/titan/debug_job.py, "
        "torchtitan under Leto); it takes --iterations and --out besides --script-args",
    )
    ap.add_argument("--work-dir", help="jobs' folders (default: a new temporary folder)")
    ap.add_argument("--json-out", help="write the trials as JSON here")
    args = ap.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="leto-plain-recovery-"))
    rows = []
    kinds = ("generic", "none") if args.warmup == "both" else (args.warmup,)
    for i in range(args.trials):
        for kind in kinds:  # side by side, trial by trial
            os.environ["LETO_GENERIC_WARMUP"] = "0" if kind == "none" else "1"
            t0 = time.time()
            out = work / f"trial{i}-{kind}"
            row = trial(args, out)
            # Only the logs and the loss logs stay: a 1 B job's checkpoints are ~13 GB
            # each, and a few trials filled the H200 machine's 64 GB disk.
            for d in out.iterdir():
                if d.is_dir() and d.name not in ("logs", "train"):
                    shutil.rmtree(d, ignore_errors=True)
            row.update(trial=i, warmup=kind, job_s=time.time() - t0)
            rows.append(row)
            print(json.dumps(row), flush=True)
    t = Table(
        title=f"plain script ({Path(args.script).name}), {args.shadow_level}, kill at {args.at}"
    )
    cols = ("trial", "warm-up", "to training s", "regained s", "promoted imports", "ahead s")
    for col in cols:
        t.add_column(col)
    for r in rows:
        names = sorted({x["module"] for v in r["promoted_imports"].values() for x in v})
        t.add_row(str(r["trial"]), r["warmup"], f"{r['to_training_s']:.3f}",
                  f"{r['regained_s']:.2f}", ", ".join(names) or "none",
                  f"{r['imports_warmup_s']:.2f}")  # fmt: skip
    Console(width=120).print(t)
    for kind in kinds:
        med = statistics.median(r["to_training_s"] for r in rows if r["warmup"] == kind)
        print(f"median to training, warm-up {kind}: {med:.3f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "trials": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
