"""Recovery of a plain script as its user lives it: from the failure until the
interrupted iteration has completed again (the paper's measure, §8).

Runs ``examples/porting/gpt_leto.py`` — the plain port of a nanoGPT-style script (tied
embeddings, fused AdamW with two parameter groups, LambdaLR, bf16 autocast on a GPU), as
docs/porting.md ports it: model built after ``leto.init()``, no ``prepare=``, no
``warmup=`` — under ``leto run`` with its default flags (``faultkit.job``, no ``--verify``: the
verifiers' per-iteration digest is not what users run), one rank SIGKILLed at each ``--at``
point (with ``--lose-pages`` data pages of every protection group lost), ``--trials``
times per shadow level. Per trial, from the recovery record (``leto run --json``):

* I — the failure's detection until the promoted trainer runs the loop body;
* R — until the interrupted iteration has completed again, less the part of it a
  fault-free run still had ahead at the failure (0 when the recovery finished the
  update before the loop);
* I + R — the time the failure cost; the first iteration after the recovery against a
  steady one; the promoted trainer's stages from promotion to the end of that iteration
  (``leto.trainer.first_iteration``);
* "to leto.Run" — the older, shorter figure (detection until ``leto.Run`` resumed), and
  what the promoted trainer still imported (``promoted_imports``; empty is the goal).

``--preset h200-1b-prepared`` (``cpu-prepared`` on the CPU) times the project's example job
instead, at the same size and tokens: a script that gives ``prepare=`` and ``warmup=``.

``--warmup both`` runs each trial with and without the parked shadow's generic warm-up
(``leto.trainer.warmup.generic_step``, for scripts that give none). Prints a table, writes
JSON.

    python -m bench.plain_recovery --trials 3
    python -m bench.plain_recovery --preset h200-1b --shadow-level L2,L3 \
        --at update.optimizer@6#1,compute.backward@6#1 --lose-pages 4

Not covered: the example job's recovery against torchrun + checkpoint
(``bench/recovery_speed.py``); several ranks failing at once.
"""

from __future__ import annotations

import argparse
import itertools
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

from faultkit.job import REPO, JobFault, run_job
from leto.job.config import DEFAULT_SHADOW_LEVEL
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig

SCRIPT = Path(REPO) / "examples" / "porting" / "gpt_leto.py"
# 6.6 M parameters, 4 K tokens a rank: seconds an iteration on two CPU cores.
CPU_SHAPE = "--n-layer 7 --n-embd 256 --n-head 4 --vocab 4096 --seq 256 --batch 8 --accum 2"
# The shape: 1.11 B parameters (tied embeddings), 16 K tokens an iteration.
H200_1B = "--n-layer 20 --n-embd 2048 --n-head 16 --vocab 50304 --seq 1024 --batch 16"
# The project's example job at the same size and tokens (1.01 B parameters: a byte-level
# vocabulary), a script that gives leto.init its prepare= (the model on the meta device)
# and warmup= and leto.Run its init= — the "where the script gives them". Chunks
# of 64 units, as leto.Run's default (the job's own default, 2, is for small models).
TRAIN_GPT = Path(REPO) / "examples" / "train_gpt.py"
H200_1B_PREPARED = (
    "--n-layer 20 --n-embd 2048 --n-head 16 --seq-len 1024 --batch-size 16 --dropout 0.0 "
    "--autocast bf16 --tf32 --chunk-units 64"
)
PRESETS = {
    "cpu-small": {"device": "cpu", "nproc_per_node": 2, "script_args": CPU_SHAPE},
    "h200-1b": {"device": "cuda", "nproc_per_node": 1, "script_args": H200_1B},
    "cpu-prepared": {
        "device": "cpu",
        "nproc_per_node": 2,
        "script": TRAIN_GPT,
        "script_args": "--n-layer 2 --n-embd 64 --n-head 2 --seq-len 64 --batch-size 4",
    },
    "h200-1b-prepared": {
        "device": "cuda",
        "nproc_per_node": 1,
        "script": TRAIN_GPT,
        "script_args": H200_1B_PREPARED,
    },
}


RESUME_STEPS = (
    "attach_localize_s", "map_retained_s", "reconstruct_s", "agree_s", "finish_update_s",
    "verify_s",
)  # fmt: skip


def trial(args, out: Path, level: str, at: str, flags: str = "") -> dict:
    pool = (
        {"pool": PoolConfig.for_cuda(0, tier1_pages=4, allow_fault_injection=True)}
        if args.device == "cuda"
        else {}
    )
    # (when="parked": the kill meets the next generation's shadows parked, whatever the
    # iteration: the recovery users get once a job has run a while)
    fault = JobFault(args.nproc_per_node - 1, at, lose_pages=args.lose_pages, when="parked")
    got = run_job(
        args.nproc_per_node, TrainConfig(), out, [fault],
        shadow_level=level, script=Path(args.script).resolve(), device=args.device,
        script_args=[*shlex.split(args.script_args), "--iterations", str(args.iterations),
                     "--out", str(out / "train")],
        timeout_s=args.timeout_s, extra=tuple(shlex.split(flags)), verify=False, **pool,
    )  # fmt: skip
    rec = got["recoveries"][0]
    tr = rec["trainers"]
    slow = max(tr.values(), key=lambda t: t.get("first_iteration_end", 0.0))
    return {
        "level": level,
        "at": at,
        "leto_flags": flags,
        "pages_lost": (rec.get("pages_lost") or {}).get("device", 0),
        "resumed_by": slow.get("resumed_by"),
        "init_s": rec.get("init_s"),
        "recompute_s": rec.get("recompute_s"),
        "regained_s": rec.get("regained_s"),
        "first_iteration_s": rec.get("first_iteration_s"),
        "steady_iteration_s": rec.get("steady_iteration_s"),
        "stages": slow.get("stages", {}),
        # Leto's steps within init, bind and resume: attach and localize, map, rebuild,
        # agree, finish, verify.
        "resume_steps": {k: slow[k] for k in RESUME_STEPS if isinstance(slow.get(k), float)},
        "to_run_s": rec.get("recovery_s"),
        # The agent's part of I (from the failure seen): fenced, then (faultkit's emulated
        # page loss, no real failure's cost) and the shadows promoted.
        "fencing_s": rec.get("fencing_s"),
        "losing_s": rec.get("losing_s"),
        "promotion_s": rec.get("promotion_s"),
        "promoted_imports": {r: t.get("promoted_imports", []) for r, t in tr.items()},
        "promoted_imports_s": max(t.get("promoted_imports_s", 0.0) for t in tr.values()),
        "imports_warmup_s": max(t.get("imports_warmup_s", 0.0) for t in tr.values()),
        "parked_after_s": max(t.get("parked_after_s", 0.0) for t in tr.values()),
    }


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="device, ranks and shape at once")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the preset's, else cpu)")
    ap.add_argument("--nproc-per-node", type=int, default=None, help="ranks (the last is killed)")
    ap.add_argument(
        "--shadow-level", default=DEFAULT_SHADOW_LEVEL, help="L1, L2 or L3; several: L2,L3"
    )
    ap.add_argument(
        "--at", default="compute.forward@4#1", help="the kill's fault point; several: comma"
    )
    ap.add_argument(
        "--lose-pages", type=int, default=0, help="data pages lost in every protection group"
    )
    ap.add_argument("--iterations", type=int, default=8, help="iterations per job")
    ap.add_argument("--trials", type=int, default=3, help="jobs per level and point")
    ap.add_argument(
        "--script-args",
        default=None,
        help="the script's shape flags, one string (write it with '='; default: the preset's)",
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
        default=None,
        help="the job (default: the preset's, else the nanoGPT-style port; e.g. "
        "examples/titan/debug_job.py, "
        "torchtitan under Leto); it takes --iterations and --out besides --script-args",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="leto run flags of one more variant beside the defaults, one string (e.g. "
        "--variant=--no-checkpoints); repeatable",
    )
    ap.add_argument("--timeout-s", type=float, default=600, help="each job's time limit")
    ap.add_argument("--work-dir", help="jobs' folders (default: a new temporary folder)")
    ap.add_argument("--json-out", help="write the trials as JSON here")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset or "cpu-small"]
    args.device = args.device or preset["device"]
    args.nproc_per_node = args.nproc_per_node or preset["nproc_per_node"]
    args.script_args = args.script_args if args.script_args is not None else preset["script_args"]
    args.script = str(args.script or preset.get("script", SCRIPT))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="leto-plain-recovery-"))
    rows = []
    kinds = ("generic", "none") if args.warmup == "both" else (args.warmup,)
    for i in range(args.trials):
        for level in args.shadow_level.split(","):
            for at, (vi, flags) in itertools.product(
                args.at.split(","), enumerate(["", *args.variant])
            ):
                for kind in kinds:  # side by side, trial by trial
                    os.environ["LETO_GENERIC_WARMUP"] = "0" if kind == "none" else "1"
                    t0 = time.time()
                    out = work / f"trial{i}-{level}-{at.split('@')[0]}-{kind}-v{vi}"
                    row = trial(args, out, level, at, flags)
                    # Only the logs and the loss logs stay: a 1 B job's checkpoints are
                    # ~13 GB each, and a few trials filled the H200 machine's 64 GB disk.
                    for d in out.iterdir():
                        if d.is_dir() and d.name not in ("logs", "train"):
                            shutil.rmtree(d, ignore_errors=True)
                    row.update(trial=i, warmup=kind, job_s=time.time() - t0)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    t = Table(title=f"plain script ({Path(args.script).name}), pages lost a group: {args.lose_pages}")
    cols = ("trial", "level", "killed at", "flags", "warm-up", "I s", "R s", "I + R s", "1st iter s",
            "steady s", "to leto.Run s", "promoted imports")  # fmt: skip
    for col in cols:
        t.add_column(col)
    for r in rows:
        names = sorted({x["module"] for v in r["promoted_imports"].values() for x in v})
        t.add_row(str(r["trial"]), r["level"], r["at"], r["leto_flags"] or "defaults",
                  r["warmup"], _s(r["init_s"]),
                  _s(r["recompute_s"]), _s(r["regained_s"]), _s(r["first_iteration_s"]),
                  _s(r["steady_iteration_s"]), _s(r["to_run_s"]),
                  ", ".join(names) or "none")  # fmt: skip
    Console(width=160).print(t)
    for r in rows:
        said = ", ".join(f"{k} {v:.3f}" for k, v in r["stages"].items())
        agent = ", ".join(
            f"{k[:-2]} {r[k]:.3f}" for k in ("fencing_s", "losing_s", "promotion_s")
            if r.get(k) is not None
        )  # fmt: skip
        print(f"trial {r['trial']} {r['level']} {r['at']} {r['leto_flags']}: the agent, from "
              f"the failure seen (s): {agent or '-'} (losing: the fault plan's emulated page "
              f"loss); the promoted trainer's stages (s): {said}")  # fmt: skip
        steps = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in r.get("resume_steps", {}).items())
        if steps:
            print(f"  its resume (s): {steps}")
    for level in args.shadow_level.split(","):
        for at in args.at.split(","):
            got = [
                r["regained_s"] for r in rows
                if r["level"] == level and r["at"] == at and not r["leto_flags"]
            ]  # fmt: skip
            got = [g for g in got if g is not None]
            if got:
                print(f"median I + R, {level}, {at}: {statistics.median(got):.3f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "trials": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
