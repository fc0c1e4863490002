"""The model zoo: real architectures trained side by side under torchrun and under
``leto run``, bit for bit, with every check on and zero alarms; then killed in the
update with pages lost, EXACT.

    python -m bench.zoo --device cpu                      # tiny models (CI)
    python -m bench.zoo --device cuda --size large        # 100 M - 1 B (the H200)

Per case of ``bench/zoo/models.py`` (several architectures trained together):

1. ``torchrun --standalone`` runs ``bench/zoo/train.py`` (DDP), the reference;
2. ``leto run`` (its default flags; ``LETO_UPDATE_RECHECK=all``: every chunk of every
   update recomputed and compared where no replica checks it) runs the Leto port: its
   parameters, every optimizer's state and every iteration's loss must equal the
   reference's bytes, and no check may raise an alarm (no failure at all, no line in
   any rank's ``recheck.jsonl`` / ``replica.jsonl``, no ``faulty-devices.json``);
3. the same, rank 0 SIGKILLed in the middle of its optimizer step two iterations in
   with H1 pages of every protection group lost: bytes and losses equal the
   reference's (EXACT), one recovery, no alarm.

A case Leto refuses (``Case.refused``) must stop before its first iteration with a
message naming what it refuses, and train nothing. Prints a table, writes ``--json``,
exits 1 when any case is not as required. Its jobs run in a temporary folder, removed
at the end unless a case failed or ``--workdir`` is given.

Not covered: speed (``bench/user_path.py``), silent corruption (faultkit's ``sdc-*``
modes), world sizes above what ``--nproc-per-node`` sets.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.zoo.models import CASES, SIZES
from faultkit.job import POOL, JobFault, run_job
from leto.integrity.faulty import FILE as FAULTY_FILE
from leto.integrity.recheck import ENV_UPDATE_RECHECK
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig

SCRIPT = Path(__file__).resolve().with_name("train.py")
# On a GPU: leto run's default pool (2 MiB pages, H1 = 4); fault injection allowed for the kill.
CUDA_POOL = PoolConfig.for_cuda(0, tier1_pages=4, allow_fault_injection=True)


def _flat(x, pre: str = ""):
    """(path, leaf) of a nested state: tensors, numbers, strings."""
    if isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _flat(x[k], f"{pre}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _flat(v, f"{pre}/{i}")
    else:
        yield pre, x


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def first_difference(ref: Path, got: Path, world: int) -> str | None:
    """The first parameter, optimizer-state entry or loss of any rank whose bytes differ
    (None: every byte equal)."""
    for r in range(world):
        files = [d / f"rank{r}.state.pt" for d in (ref, got)]
        if not files[1].exists():
            return f"rank {r} wrote no final state ({files[1]})"
        a, b = (dict(_flat(torch.load(f, map_location="cpu"))) for f in files)
        if a.keys() != b.keys():
            return f"rank {r}: different entries: {sorted(a.keys() ^ b.keys())[:3]}"
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, torch.Tensor):
                if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                    return f"rank {r}: {k}: {x.dtype}{tuple(x.shape)} vs {y!r:.60}"
                if not torch.equal(_bytes(x), _bytes(y)):
                    i = int((_bytes(x) != _bytes(y)).nonzero()[0])
                    return f"rank {r}: {k} differs from byte {i}"
            elif x != y:
                return f"rank {r}: {k}: {x!r} vs {y!r}"
        # Leto's loss log (run.record_loss: each committed iteration once, also one whose
        # update a recovery finished) against the script's own log under torchrun; the
        # script's log under Leto must agree where it has a line.
        la = _losses(ref / f"rank{r}.zoo-losses.jsonl")
        lb = _losses(got / f"rank{r}.losses.jsonl")
        mine = _losses(got / f"rank{r}.zoo-losses.jsonl")
        if any(lb.get(i) != v for i, v in mine.items()):
            return f"rank {r}: the script's loss log disagrees with Leto's: {mine} vs {lb}"
        if la != lb:
            it = next(i for i in sorted(la.keys() | lb.keys()) if la.get(i) != lb.get(i))
            return f"rank {r}: loss of iteration {it}: {la.get(it)} vs {lb.get(it)}"
    return None


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[rec["iteration"]] = rec["loss"]  # a redone iteration: the latest counts
    return out


def alarms(job: Path) -> list[str]:
    """Every alarm a check raised in a job: the findings logged by the update recheck and
    the replica check, a faulty-device record, a WrongComputation in an error file."""
    found = []
    for f in sorted((job / "train").glob("rank*.recheck.jsonl")) + sorted(
        (job / "train").glob("rank*.replica.jsonl")
    ):
        found += [f"{f.name}: {x}" for x in f.read_text().splitlines() if x.strip()]
    if (job / "logs" / FAULTY_FILE).exists():
        found.append(f"{FAULTY_FILE}: {(job / 'logs' / FAULTY_FILE).read_text()[:200]}")
    for f in sorted((job / "logs").glob("rank*.error.json")):
        text = f.read_text()
        if any(w in text for w in ("WrongUpdate", "ReplicaDisagreement", "ReplayMismatch")):
            found.append(f"{f.name}: {json.loads(text).get('exception', text[:120])}")
    return found


def torchrun(args, case: str, out: Path, env: dict, extra: list[str] = ()) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(args.nproc_per_node), str(SCRIPT), "--case", case,
        "--size", args.size, "--iterations", str(args.iterations), "--out", str(out), *extra,
    ]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"torchrun exited {p.returncode}:\n{p.stderr[-3000:]}")


def leto(args, case: str, out: Path, env: dict, pool: PoolConfig, faults=()) -> dict:
    script_args = ["--leto", "--case", case, "--size", args.size,
                   "--iterations", str(args.iterations), "--out", str(out / "train")]  # fmt: skip
    return run_job(
        args.nproc_per_node, TrainConfig(), out, list(faults), pool=pool, device=args.device,
        allow_failure=True, timeout_s=args.timeout_s, env=env, script=SCRIPT,
        script_args=script_args, extra=tuple(shlex.split(getattr(args, "leto_flags", ""))),
    )  # fmt: skip


def run_case(args, name: str, work: Path) -> dict:
    case = CASES[name]
    row: dict = {"case": name, "models": list(case.models), "covers": case.what}
    env = dict(os.environ, **{ENV_UPDATE_RECHECK: "all"})
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    pool = CUDA_POOL if args.device == "cuda" else POOL
    t0 = time.time()
    if case.refused:
        got = leto(args, name, work / name / "leto", env, pool)
        text = (work / name / "leto" / "leto-run.log").read_text()
        trained = _losses(work / name / "leto" / "train" / "rank0.zoo-losses.jsonl")
        ok = got["code"] != 0 and case.refused in text and not trained
        row.update(verdict="refused" if ok else "NOT REFUSED", seconds=time.time() - t0,
                   detail=case.refused if ok else f"exit {got['code']}, trained {len(trained)}")  # fmt: skip
        return row
    ref = work / name / "torchrun"
    torchrun(args, name, ref, env)
    checks = []
    for label, faults in (("fault-free", ()), ("killed", (_kill(args, case, pool),))):
        if label == "killed" and (
            args.no_kill or (args.kill_cases and name not in args.kill_cases)
        ):
            continue
        job = work / name / label
        got = leto(args, name, job, env, pool, faults)
        if got["code"] != 0:  # (a job stopped at its time limit may leave a torn state file)
            diff = f"leto run exited {got['code']} (logs in {job / 'logs'})"
        else:
            diff = first_difference(ref, job / "train", args.nproc_per_node)
        seen = alarms(job)
        failures = len(got.get("recoveries", []))
        want = len(faults)
        if failures != want:
            seen.append(f"{failures} failure(s), expected {want}")
        checks.append({"run": label, "difference": diff, "alarms": seen,
                       "update_path": _update_path(job)})  # fmt: skip
    bad = [c for c in checks if c["difference"] or c["alarms"]]
    row.update(
        verdict="EXACT, no alarm" if not bad else "FAILED",
        runs=checks,
        seconds=time.time() - t0,
        detail="; ".join(f"{c['run']}: {c['difference'] or ''} {c['alarms'] or ''}" for c in bad),
    )
    return row


def _kill(args, case, pool: PoolConfig) -> JobFault:
    start = 1234 if case.optim.endswith("-loaded") else 0
    # Iteration 2's optimizer step, half done; H1 data pages of every group lost.
    return JobFault(0, f"update.optimizer@{start + 2}#1", lose_pages=pool.tier1_pages)


def _update_path(job: Path) -> str:
    """What updated the chunks (the trainer logs it): the fused pass or the unfused steps."""
    for f in sorted((job / "logs").glob("rank0.gen0.*.log")):
        for line in f.read_text().splitlines():
            if "chunk updates:" in line:
                return line.split("chunk updates:", 1)[1].strip()
    return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    ap.add_argument("--size", choices=sorted(SIZES), help="tiny (CPU default) or large (CUDA)")
    ap.add_argument("--cases", help=f"comma-separated (default all: {', '.join(CASES)})")
    ap.add_argument("--iterations", type=int, default=4, help="optimizer steps per run")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="ranks (world size)")
    ap.add_argument("--no-kill", action="store_true", help="fault-free runs only")
    ap.add_argument("--kill-cases", type=lambda v: v.split(","), default=None,
                    help="comma-separated: only these cases get the killed run (default all)")  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=600, help="limit of each job")
    ap.add_argument("--leto-flags", default="",
                    help="more leto run flags, one string (e.g. --undo ahead)")  # fmt: skip
    ap.add_argument("--workdir", help="keep the jobs here (default: a temporary folder)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.size = args.size or ("large" if args.device == "cuda" else "tiny")
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; the zoo has {', '.join(CASES)}")
    if args.device == "cpu":
        names = [n for n in names if not CASES[n].cuda_only]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="leto-zoo-"))
    print(f"zoo: {len(names)} case(s) on {args.device}, size {args.size}, jobs in {work}")
    rows = []
    for n in names:
        row = run_case(args, n, work)
        rows.append(row)
        if not args.workdir and row["verdict"] in ("EXACT, no alarm", "refused"):
            # A large case's state files are tens of GB (parameters and moments, each
            # run): the next case must not find the disk full.
            shutil.rmtree(work / n, ignore_errors=True)
        print(f"  {n:16s} {row['verdict']:16s} {row['seconds']:6.1f} s  {row.get('detail', '')}",
              flush=True)  # fmt: skip
    ok = all(r["verdict"] in ("EXACT, no alarm", "refused") for r in rows)
    _table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "size": args.size,
                                               "torch": torch.__version__, "cases": rows},
                                              indent=1))  # fmt: skip
    if ok and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    elif not ok:
        print(f"zoo: NOT as required; jobs kept in {work}")
    return 0 if ok else 1


def _table(rows, args) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Model zoo on {args.device} ({args.size}): torchrun vs leto run")
    for col in ("case", "models", "verdict", "update path", "covers"):
        t.add_column(col, overflow="fold")
    for r in rows:
        path = r["runs"][0]["update_path"] if r.get("runs") else "-"
        t.add_row(r["case"], ", ".join(r["models"]), r["verdict"], path, r["covers"])
    Console(width=120).print(t)


if __name__ == "__main__":
    sys.exit(main())
