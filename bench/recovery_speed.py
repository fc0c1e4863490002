"""HOF recovery time with shadows at L1, L2, L3 and started cold, against the
torchrun + checkpoint baseline — side by side in one run, on the same job and failure.

Every variant runs ``leto run examples/train_gpt.py`` with the same fault plan: the
ranks ``--ranks`` (one, or several at once: ``0,1``) are SIGKILLed in iteration
``--fail-at`` (in their optimizer update). Variants:
shadows L1, L2, L3 (in-place recovery, promoted shadows), ``off`` (in-place recovery by
cold-started trainers: new processes re-attach to the surviving pools), and
``checkpoint`` (the baseline: every rank restarts cold on a fresh pool, forms a new
process group, loads the newest DCP checkpoint and recomputes from it, as torchrun +
torch.distributed.checkpoint would). Checkpoints are taken every ``--checkpoint-interval``
iterations in every variant, or (``--checkpoints baseline``) in the baseline only: the
reference and the in-place variants read none, and at 3 B+ parameters each save is
tens of GB. Recovery time = failure (the agent's detection, within
``poll_s``) until the iteration in flight at the failure is completed again, i.e.
pre-failure progress regained (the paper's I + R): its verifiers record, or — for an
in-place recovery that finished the interrupted update before the promoted trainer's
loop ran — the recovery record's I + R (``leto.trainer.first_iteration``), whichever
ends later. Every run must be bit-exact against the fault-free one.

    python -m bench.recovery_speed --nproc-per-node 2 --iterations 12 --fail-at 6
    python -m bench.recovery_speed --device cuda --nproc-per-node 1 ...

Not covered: multi-node timing (the same code, run by one agent per node).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.job.config import ENV_PREMAP, ENV_PROFILE_RECOVERY
from leto.job.store import free_port
from verifiers import compare
from verifiers.trace import read_run

REPO = Path(__file__).resolve().parents[1]
BASE = "torchrun + checkpoint"
# name -> (shadow level, recovery, extra environment). L2/L3 shadows premap the pool
# while parked (leto.trainer.premap); "L3 (attach cold)" is L3 without it, side by side.
VARIANTS = {
    "L1": ("L1", "in-place", {}),
    "L2": ("L2", "in-place", {}),
    "L3": ("L3", "in-place", {}),
    "L3 (attach cold)": ("L3", "in-place", {ENV_PREMAP: "0"}),
    # The codec's table kernels instead of the Horner scheme (leto.erasure.horner).
    "L3 (tables)": ("L3", "in-place", {"LETO_HORNER": "0"}),
    "cold (in place)": ("off", "in-place", {}),
    "torchrun + checkpoint": ("off", "checkpoint", {}),
}


def run_variant(
    work: Path,
    level: str,
    recovery: str,
    args,
    faults,
    checkpoint_interval: int | None,
    env=None,
) -> dict:
    """``checkpoint_interval`` None: the run saves no checkpoints (``--no-checkpoints``)."""
    work.mkdir(parents=True, exist_ok=True)
    ckpt = (
        Path(args.checkpoint_dir) / work.name
        if args.checkpoint_dir
        else work / "logs" / "checkpoints"
    )
    saves = (
        ["--no-checkpoints"]
        if checkpoint_interval is None
        else ["--checkpoint-interval", str(checkpoint_interval), "--checkpoint-dir", str(ckpt)]
    )
    cmd = [
        sys.executable, "-m", "leto.cli", "run", "--json", "--verify", "--device", args.device,
        "--nproc-per-node", str(args.nproc_per_node), "--master-port", str(free_port()),
        "--shadow-level", level, "--recovery", recovery, "--log-dir", str(work / "logs"),
        *saves, *args.pool_flags,
        str(REPO / "examples" / "train_gpt.py"), "--iterations", str(args.iterations),
        "--out", str(work / "out"), *args.model,
    ]  # fmt: skip
    env = dict(os.environ, **(env or {}), LETO_FAULT_PLAN=json.dumps(faults))
    if args.profile_recovery:
        env[ENV_PROFILE_RECOVERY] = str(Path(args.profile_recovery).resolve() / work.name)
    p = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=1200)
    # A 1 B-parameter model's checkpoints are ~12 GB each: keep the disk for the next.
    shutil.rmtree(ckpt, ignore_errors=True)
    if p.returncode != 0:
        raise RuntimeError(f"{level}/{recovery} failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def reference_out(root: Path, args, only_baseline: bool) -> Path:
    """The fault-free run's verifiers output: run now, or reused from
    ``--reference-dir`` when it was kept there for the same job flags."""
    key = {
        "device": args.device,
        "nproc_per_node": args.nproc_per_node,
        "iterations": args.iterations,
        "checkpoints": args.checkpoints,
        "pool_flags": args.pool_flags,
        "model": args.model,
    }
    kept = Path(args.reference_dir) / "reference.json" if args.reference_dir else None
    if kept is not None and kept.exists():
        had = json.loads(kept.read_text())
        if had != key:
            diff = {k: (had.get(k), v) for k, v in key.items() if had.get(k) != v}
            raise SystemExit(
                f"--reference-dir {args.reference_dir}: kept for other job flags "
                f"(kept, now): {diff}; use another folder or remove it. Nothing was run."
            )
        return kept.parent / "out"
    interval = None if only_baseline else args.iterations
    run_variant(root / "reference", "off", "in-place", args, [], interval)
    out = root / "reference" / "out"
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out, kept.parent / "out", dirs_exist_ok=True)
        kept.write_text(json.dumps(key))  # last: a folder without it is not a reference
        return kept.parent / "out"
    return out


def parameters(model_flags: list[str]) -> int:
    """The example GPT's parameter count for these flags (built on the meta device)."""
    import torch

    from leto.workload.gpt import GPT
    from leto.workload.train import add_arguments, from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    cfg = from_args(ap.parse_known_args(model_flags)[0])
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg.gpt()).parameters())


# What one DCP save of the example holds per rank and parameter: fp32 parameters and
# AdamW's two moments (leto.trainer.checkpoint saves the updater's flat state; gradients
# are not in it). The loop record is a few KB.
CHECKPOINT_BYTES_PER_PARAMETER = 12


def checkpoint_room(args, chosen: list[str], n_parameters: int) -> str | None:
    """Why the checkpoints of this run would not fit where they go (None if they would):
    checked before anything runs, so a device call is not spent on a reference run and
    a baseline that dies of ENOSPC mid-save (one 5 B save is 60 GB). ``--checkpoints
    baseline`` saves once, in the baseline only; ``all`` saves in every variant, keeping
    two complete checkpoints while a third is written. Each variant's folder is removed
    after it, so the largest need is one variant's."""
    saving = [v for v in chosen if args.checkpoints == "all" or VARIANTS[v][1] == "checkpoint"]
    if not saving:
        return None
    copies = 1 if args.checkpoints == "baseline" else 3
    need = n_parameters * CHECKPOINT_BYTES_PER_PARAMETER * args.nproc_per_node * copies
    where = Path(args.checkpoint_dir or tempfile.gettempdir()).absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free >= need:
        return None
    return (
        f"the checkpoints of {', '.join(saving)} need about {need / 1e9:.1f} GB in {where} "
        f"({copies} save{'s' * (copies > 1)} of {n_parameters / 1e9:.2f} B parameters x "
        f"{CHECKPOINT_BYTES_PER_PARAMETER} bytes x {args.nproc_per_node} rank(s)); "
        f"{existing} has {free / 1e9:.1f} GB free. Nothing was run: give --checkpoint-dir "
        "on larger storage, or leave the checkpointing variants out"
    )


def regained_s(out: Path, rank: int, detected_at: float, fail_at: int) -> float:
    """Detection until iteration ``fail_at`` is recorded again."""
    trace = read_run(out).traces[rank]
    times = [
        r.wall_time for r in trace.history if r.iteration >= fail_at and r.wall_time > detected_at
    ]
    return min(times) - detected_at


def to_training_s(rec: dict) -> float | None:
    """Detection until the slowest rank trains again, less each rank's time in the
    verifiers' record during its recovery (``observer_s``)."""
    trainers = list((rec.get("trainers") or {}).values())
    if rec.get("recovery_s") is None or not trainers or any("time" not in t for t in trainers):
        return rec.get("recovery_s")
    return max(t["time"] - t.get("observer_s", 0.0) for t in trainers) - rec["detected_at"]


def first_iteration(
    out: Path, rank: int, detected_at: float, fail_at: int, checkpoint_interval: int | None
) -> dict | None:
    """The first whole iteration after progress is regained (``fail_at`` + 1, run by the
    promoted or restarted process) against the same rank's steady iterations before the
    failure: the median of iterations 1 on (the record of iteration 0 comes after the
    start-up) of the same kind — checkpoint iterations (every ``checkpoint_interval``-th:
    a full scrub and a save) or not. Both include the verifiers' digest, so the ratio
    compares like with like. None when the run ends before ``fail_at`` + 1 or no earlier
    iteration is of its kind."""
    trace = read_run(out).traces[rank]
    after = {r.iteration: r.wall_time for r in trace.history if r.wall_time > detected_at}
    before = {r.iteration: r.wall_time for r in trace.history if r.wall_time <= detected_at}
    if fail_at not in after or fail_at + 1 not in after:
        return None

    def saves(i: int) -> bool:  # (None: the run saved no checkpoints)
        return checkpoint_interval is not None and i % checkpoint_interval == 0

    # Iteration i's duration is its record's time less iteration i-1's.
    steady = [
        before[i] - before[i - 1]
        for i in before
        if i >= 1 and i - 1 in before and saves(i) == saves(fail_at + 1)
    ]
    if not steady:
        return None
    first = after[fail_at + 1] - after[fail_at]
    median = statistics.median(steady)
    return {
        "first_s": first,
        "steady_s": median,
        "ratio": first / median,
        "checkpoint_iteration": saves(fail_at + 1),
    }


def slowest_first_iteration(
    out: Path, ranks: list[int], detected_at: float, fail_at: int, interval: int | None
) -> dict | None:
    """``first_iteration`` of the failed rank whose first iteration was slowest against
    its own steady ones (with ``rank`` added); None if any has no figure."""
    got = [first_iteration(out, r, detected_at, fail_at, interval) for r in ranks]
    if any(g is None for g in got):
        return None
    return max(
        ({**g, "rank": r} for r, g in zip(ranks, got, strict=True)), key=lambda g: g["ratio"]
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--nproc-per-node", type=int, default=2, help="ranks")
    ap.add_argument("--iterations", type=int, default=12, help="training iterations")
    # 6: the next iteration (7) is not a checkpoint iteration at the default interval.
    ap.add_argument("--fail-at", type=int, default=6, help="iteration the failure strikes")
    ap.add_argument(
        "--ranks",
        type=_ranks,
        default=[0],
        help="the ranks that fail, comma-separated (0,1: two at once, one failure)",
    )
    ap.add_argument("--checkpoint-interval", type=int, default=4, help="iterations")
    ap.add_argument(
        "--fault-mode",
        choices=("kill", "kill-synced"),
        default="kill",
        help="kill: SIGKILL as the host reaches the point (the GPU may still be before the "
        "update's first chunk: the iteration is then redone); kill-synced: once the device "
        "has finished the work queued before it (the failure lands in the update)",
    )
    ap.add_argument(
        "--checkpoints",
        choices=("all", "baseline"),
        default="all",
        help="which variants save checkpoints: all (every --checkpoint-interval), or the "
        "baseline only, once, after iteration 0, failing in iteration 1 — the reference and "
        "in-place variants run --no-checkpoints (their recovery reads none; at 3 B+ "
        "parameters each save is tens of GB and minutes)",
    )
    ap.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where checkpointing variants save (a subfolder each, removed after it; "
        "default: the run's log dir). A RAM-backed folder gives the baseline the fastest "
        "storage a user could have",
    )
    ap.add_argument("--json-out", default=None, help="write results as JSON here")
    ap.add_argument(
        "--reference-dir",
        default=None,
        help="keep the fault-free run's verifiers output here, or reuse it if an earlier "
        "run with the same job flags kept it (at 5 B parameters the reference is ~4 of a "
        "device call's 10 minutes); a folder kept for other flags is refused",
    )
    ap.add_argument(
        "--model",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra flags for examples/train_gpt.py (e.g. --n-layer 20 --n-embd 2048)",
    )
    ap.add_argument(
        "--profile-recovery",
        default=None,
        metavar="DIR",
        help="cProfile each recovering trainer into DIR/<variant>/ (LETO_PROFILE_RECOVERY)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of: " + ", ".join(VARIANTS),
    )
    args = ap.parse_args(argv)
    if bad := [r for r in args.ranks if r >= args.nproc_per_node]:
        ap.error(f"--ranks {bad}: the job has ranks 0..{args.nproc_per_node - 1}")
    chosen = [v.strip() for v in args.variants.split(",")]
    if unknown := [v for v in chosen if v not in VARIANTS]:
        ap.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    n_parameters = parameters(args.model)  # (the model built on the meta device once)
    if problem := checkpoint_room(args, chosen, n_parameters):
        ap.error(problem)
    args.pool_flags = (
        ["--page-bytes", "16384", "--data-pages", "16", "--tier1-pages", "4"]
        if args.device == "cpu"
        else ["--data-pages", "64", "--tier1-pages", "4"]
    )

    def faults(at: int) -> list[dict]:
        at = f"update.optimizer@{at}#1"
        return [{"generation": 0, "rank": r, "at": at, "mode": args.fault_mode} for r in args.ranks]

    root = Path(tempfile.mkdtemp(prefix="leto-recovery-speed-"))
    t0 = time.monotonic()
    # The fault-free reference only supplies states to compare with: one checkpoint (the
    # first iteration's, always taken) instead of one every interval, each with a full
    # scrub and a DCP save of the whole state (at 1 B parameters, ~20 s apiece).
    res = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m bench.recovery_speed " + " ".join(argv or sys.argv[1:]),
        "parameters": n_parameters,
        "fault_mode": args.fault_mode,
    }
    only_baseline = args.checkpoints == "baseline"
    reference = reference_out(root, args, only_baseline)
    print(f"reference run: {time.monotonic() - t0:.0f} s", flush=True)
    rows = {}
    for name in chosen:
        level, recovery, extra = VARIANTS[name]
        work = root / "".join(c if c.isalnum() else "_" for c in name)
        t0 = time.monotonic()
        interval, fail_at = args.checkpoint_interval, args.fail_at
        if only_baseline and recovery != "checkpoint":
            interval = None
        elif only_baseline:
            # The baseline fails in iteration 1, right after its only save (iteration
            # 0's): what a restart loads and redoes — the whole state, one iteration —
            # is the same at any iteration right after a save, and one checkpoint of a
            # 3-5 B model (36-60 GB) is what the machine's RAM or disk holds. The
            # in-place variants fail later, once their shadows are parked and premapped.
            interval, fail_at = args.iterations, 1
        summary = run_variant(work, level, recovery, args, faults(fail_at), interval, extra)
        rec = summary["recoveries"][0]
        verdict = compare(reference, work / "out")
        # Every failed rank has recorded the struck iteration again (the trace); for an
        # in-place recovery the record's I + R may end later: a finished update is
        # recorded again before the promoted trainer's loop runs at all.
        traced = max(regained_s(work / "out", r, rec["detected_at"], fail_at) for r in args.ranks)
        rows[name] = {
            "regained_s": max(traced, rec.get("regained_s") or 0.0),
            "traced_regained_s": traced,
            "init_s": rec.get("init_s"),
            "recompute_s": rec.get("recompute_s"),
            "failed_ranks": args.ranks,
            "fail_at": fail_at,
            "to_training_s": to_training_s(rec),
            # As the agent measured it: with the verifiers' record of an iteration the
            # recovery finished (its digest of every retained byte) — a cost of this
            # measurement, not of a job run without --verify.
            "to_training_with_verifier_s": rec.get("recovery_s"),
            # Item 2 of issue 17: the first iteration after promotion as fast as a steady
            # one (cold kernels, allocator growth and lazy set-up would show here).
            "first_iteration": slowest_first_iteration(
                work / "out", args.ranks, rec["detected_at"], fail_at, interval
            ),
            "exact": verdict.exact,
            "first_divergence": verdict.describe(),
            "record": rec,
            # Whether every promoted trainer came from a premapped shadow: a premapping
            # that was dropped makes "L3" an attach-cold figure, and the table says so.
            "premapped": [t.get("premapped") for t in rec.get("trainers", {}).values()],
        }
        # Ranks killed at one point die a few ms apart: the agent may detect the first and
        # fence the others (every local trainer is replaced either way) — the record says
        # which were dead at detection.
        dead = rec.get("failed_ranks")
        print(
            f"{name}: regained in {rows[name]['regained_s']:.2f} s, exact "
            f"{rows[name]['exact']}, ranks dead at detection {dead} (run "
            f"{time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        if args.json_out:  # what is done survives a time limit
            Path(args.json_out).write_text(json.dumps({**res, "variants": rows}, indent=2))
    # (A run without the baseline — a variant added to an earlier run — has no ratio.)
    base = rows.get(BASE, {}).get("regained_s")
    res["variants"] = rows
    t = Table(
        title=f"HOF recovery, {args.nproc_per_node} ranks on {args.device}, "
        f"rank{'s' * (len(args.ranks) > 1)} {','.join(map(str, args.ranks))} failing"
    )
    cols = (
        "variant", "failure → progress regained (I + R)", "vs baseline", "I / R",
        "to leto.Run (no verifier)", "next iteration / steady", "premapped",
    )  # fmt: skip
    for c in (*cols, "exact"):
        t.add_column(c)
    for name, r in rows.items():
        t.add_row(
            name,
            f"{r['regained_s']:.2f} s",
            f"{base / r['regained_s']:.1f}× faster" if base and r is not rows[BASE] else "—",
            f"{r['init_s']:.2f} / {r['recompute_s']:.2f} s" if r.get("init_s") is not None else "-",
            f"{r['to_training_s']:.2f} s" if r["to_training_s"] else "-",
            _first(r["first_iteration"]),
            _premapped(r["premapped"]),
            "EXACT" if r["exact"] else f"NOT EXACT: {r['first_divergence']}",
        )
    Console().print(t)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    return res


def _ranks(text: str) -> list[int]:
    try:
        ranks = sorted({int(r) for r in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: ranks are integers, e.g. 0 or 0,1") from None
    if ranks[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: ranks are 0 or more")
    return ranks


def _first(f: dict | None) -> str:
    if f is None:
        return "-"  # the run ended at the failed iteration
    return f"{f['first_s'] * 1e3:.0f} / {f['steady_s'] * 1e3:.0f} ms ({f['ratio']:.2f}×)"


def _premapped(flags: list) -> str:
    if not flags or all(f is None for f in flags):
        return "-"  # no shadow, or no premapping at its level
    return "yes" if all(flags) else f"NO ({sum(map(bool, flags))} of {len(flags)})"


if __name__ == "__main__":
    main()
