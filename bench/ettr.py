"""Measured ETTR of Leto vs a Gemini-style and a torchrun + DCP baseline, side by side.

One run, the same job and the same failure schedule for all three systems, each at its
Young-optimal checkpoint interval, with the simulator's prediction for the same inputs.

Every system is ``leto run examples/train_gpt.py`` on the same data-parallel job:

* **Leto** — ``--recovery in-place`` with parked shadows (``--shadow-level L3``): a HOF
  is recovered in place; an FF (its page loss goes beyond tier-1 parity) falls back to
  the newest checkpoint. Checkpoints insure against FFs only: Young's interval at the
  FF-only MTTF ``M / (1 - h)``. They go to host memory (tmpfs), the Gemini+ path the
  paper's Leto falls back to (``--leto-storage disk`` to change that).
* **Gemini-style** — ``--recovery checkpoint``, no shadows: every failure restarts every
  rank cold on a fresh pool, loads the newest checkpoint and recomputes. Checkpoints
  live in host memory that outlives the trainers. **Emulated**: DCP saves to a tmpfs
  directory (``/dev/shm``) on the same node; Gemini replicates them into a peer node's
  CPU memory, which this bench does not do (no peer process, no network transfer).
* **torchrun + DCP** — the same restart path, ``torch.distributed.checkpoint`` to a
  directory on disk (under the work directory; it must not be tmpfs).

All three run the same trainer (Leto's pools and resumable updater), so the comparison
isolates recovery: the RMU's steady overhead (ω) is in every system's iteration time.

Method. Two fault-free reference runs (checkpoints every ``--calibration-interval``
iterations, one to tmpfs and one to disk) give the iteration time ``T_iter`` (median of
the gaps between consecutive iteration records that carry no save) and each storage's
checkpoint cost ``T_ckpt`` (mean gap of an iteration that saves minus the mean of the
others: the excess of a checkpointing iteration, Appendix C.2's ``p·T_iter``); they are
also the bit-exactness references. Schedules (``leto.sim.schedule``): ``every`` — one
HOF every ``--hof-every`` iterations (``every`` at ``K·T_iter``); ``trace`` — a window of
a public preemption trace with ``--hof-ratio`` HOFs, its time compressed onto the job's
fault-free length ``N·T_iter``. Failure times map onto iterations with the measured
``T_iter``; each failure SIGKILLs its rank at ``--fault-point`` of that iteration, and
an FF loses tier-1 + 1 pages of every pool. Intervals: Young, ``I = sqrt(2 p M /
T_iter)`` with ``M`` the schedule's MTTF in job time (``leto.sim.model.choose_interval``).

Measured per system: ETTR from training start, ``N·T_iter / (t_last - t_start)`` with
the run's own median iteration time (``leto run``'s ETTR, which also counts the launch,
is kept as ``ettr_incl_launch``); per failure the init time (failure detected → every
rank trains again, the runtime's recovery records) and the recomputation (→ the
iteration in flight at the failure is recorded again, verifiers traces), as the paper's
Table 3; ``other_s``, what neither the pace nor the recoveries explain (checkpoint saves,
warm-up after restarts, iterations slowed by processes starting beside them); and
bit-exactness against the reference (``verifiers.compare``). Predicted:
``leto.sim.events.simulate`` replaying the same failures at the same progress points
(each placed where the modelled job reaches the failure's iteration, at the measured
elapsed part of it) with the measured ``T_iter``, ``T_ckpt``, init times and interval.

    python -m bench.ettr --iterations 180 --hof-every 60 --json-out ettr.json
    leto bench ettr --schedules every --iterations 24 --hof-every 8

Not covered: multi-node jobs (one agent per node, the same code), Gemini's replication
to a peer node and its traffic interleaving, failures timed by wall clock (a failure
strikes when the job reaches its iteration, so recovery does not shift later failures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.errors import InvalidInput
from leto.job.config import ENV_FAULT_PLAN, RunConfig
from leto.sim.events import simulate
from leto.sim.model import INTERVAL, LETO, Job, System, choose_interval
from leto.sim.schedule import GCP_TRACE, Failure, Schedule, every, trace_window

# torch (through leto.job.store and verifiers) is imported where a run needs it, not
# here: ``leto bench`` registers this module's flags in the ``leto`` parser, and ``leto
# run`` must not pay 1.5 s of torch import before it starts its zygote (leto.cli).

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_gpt.py"
EMULATION = (
    "Gemini-style checkpoints are emulated: DCP to tmpfs (host memory of this node that "
    "outlives the trainers), not replicated to a peer node's process"
)


@dataclass(frozen=True)
class SystemSpec:
    name: str
    shadow_level: str
    recovery: str  # leto run --recovery
    storage: str  # "memory" (tmpfs) or "disk"
    kind: str  # leto.sim.model.LETO or INTERVAL


def systems(leto_level: str = "L3", leto_storage: str = "memory") -> tuple[SystemSpec, ...]:
    return (
        SystemSpec("Leto", leto_level, "in-place", leto_storage, LETO),
        SystemSpec("Gemini-style", "off", "checkpoint", "memory", INTERVAL),
        SystemSpec("torchrun + DCP", "off", "checkpoint", "disk", INTERVAL),
    )


@dataclass(frozen=True)
class Injection:
    """One failure of the schedule placed on the job: it strikes ``rank`` in
    ``iteration`` (0-based); ``at_s`` is its time in the (compressed) schedule."""

    iteration: int
    rank: int
    kind: str  # HOF or FF
    at_s: float


# -- pure helpers (unit-tested) ----------------------------------------------------------


def calibrate(times: dict[int, float], interval: int, warmup: int) -> dict:
    """Iteration time and per-save cost from one fault-free run's record times
    (``{iteration: wall_time}``), which saved after iterations 0, ``interval``, 2 ·
    ``interval``, ... (the checkpointer's fixed-interval rule).

    Gap ``t`` is record ``t + 1`` minus record ``t``; it holds the save after ``t`` when
    ``t`` is a save iteration. The first ``warmup`` gaps are skipped (first-iteration
    allocations, lazy imports). ``t_iter_s`` is the median of the gaps without a save
    (robust to other processes' noise on a shared machine); ``save_cost_s`` the mean
    gap with a save minus the mean without (the checkpointing iteration's excess, so a
    save's interference with the next iterations is not counted: a lower bound),
    clamped at 0 (noise can make it negative).
    """
    if interval < 1:
        raise InvalidInput(f"calibration interval {interval}: expected >= 1 iterations")
    its = sorted(times)
    if its != list(range(len(its))):
        raise InvalidInput(f"calibration run: iterations {its[:5]}... are not 0..N-1 each once")
    gaps = {t: times[t + 1] - times[t] for t in its[:-1] if t >= warmup}
    saving = [g for t, g in gaps.items() if t % interval == 0]
    clean = [g for t, g in gaps.items() if t % interval != 0]
    if len(saving) < 2 or len(clean) < 2:
        raise InvalidInput(
            f"calibration run of {len(its)} iterations (warm-up {warmup}, saves every "
            f"{interval}) has {len(saving)} gaps with a save and {len(clean)} without; need "
            "at least 2 of each: run more iterations"
        )
    return {
        "t_iter_s": statistics.median(clean),
        "save_cost_s": max(statistics.fmean(saving) - statistics.fmean(clean), 0.0),
        "gaps_with_save": len(saving),
        "gaps_without": len(clean),
    }


def young(
    save_cost_s: float,
    t_iter_s: float,
    mttf_s: float,
    hof_ratio: float,
    kind: str,
    max_interval: int,
) -> int:
    """Young's interval in whole iterations (``leto.sim.model.choose_interval``): at the
    MTTF for an interval system, at the FF-only MTTF ``M / (1 - h)`` for Leto; at most
    ``max_interval`` (Leto with no FFs: no interval is optimal, the largest is used)."""
    job = Job(t_iter_s, save_cost_s / t_iter_s, mttf_s, hof_ratio)
    return choose_interval(job, System("bench", kind, 0.0, 0.0), max_interval)


def compress(schedule: Schedule, duration_s: float) -> Schedule:
    """The schedule with its time scaled onto ``duration_s`` (a trace window of hours
    onto a CPU job of seconds); the failures keep their order, kinds and ranks."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise InvalidInput(f"duration_s={duration_s!r}: expected a finite time > 0 s")
    scale = duration_s / schedule.duration_s
    failures = tuple(replace(f, at_s=min(f.at_s * scale, duration_s)) for f in schedule.failures)
    source = {**schedule.source, "compressed_from_s": schedule.duration_s, "time_scale": scale}
    return Schedule(failures, duration_s, schedule.world_size, source)


def place(
    schedule: Schedule, t_iter_s: float, iterations: int
) -> tuple[list[Injection], list[str]]:
    """Map failures onto iterations with the measured iteration time
    (``Schedule.at_iteration``), for a job of ``iterations`` iterations.

    A failure lands in one iteration at most: each injection kills a generation of
    trainers at its iteration, and a second one at the same iteration would strike the
    recovery's recomputation instead — so a later failure mapped to an iteration already
    taken moves to the next free one. Failures past the last iteration are dropped.
    Both say so in the returned notes.
    """
    if iterations < 1:
        raise InvalidInput(f"iterations={iterations}: expected >= 1")
    out: list[Injection] = []
    notes: list[str] = []
    # A time exactly at an iteration boundary (every K iterations, K * T_iter) must land
    # in iteration K, not K - 1 through rounding in the product: nudge by 1e-9 of T_iter.
    for p in schedule.at_iteration(t_iter_s * (1 - 1e-9)):
        it = p.iteration
        if out and it <= out[-1].iteration:
            notes.append(
                f"failure at {p.failure.at_s:.3f} s maps to iteration {it}, already taken: "
                f"moved to {out[-1].iteration + 1}"
            )
            it = out[-1].iteration + 1
        if it >= iterations:
            notes.append(
                f"failure at {p.failure.at_s:.3f} s (iteration {it}) is past the job's "
                f"{iterations} iterations: dropped"
            )
            continue
        out.append(Injection(it, p.failure.rank, p.failure.kind, p.failure.at_s))
    return out, notes


def fault_plan(
    injections: list[Injection], spec: SystemSpec, point: str, lose_pages: int
) -> tuple[list[dict], list[int]]:
    """``leto run``'s fault plan (``LETO_FAULT_PLAN``) and each injection's generation.

    Generations count trainer generations: under ``--recovery checkpoint`` every failure
    starts one new generation. Under Leto a HOF promotes the next generation; an FF is
    injected as a kill whose page loss (``lose_pages``, beyond tier-1 parity) the
    promoted generation finds fatal, which then falls back to the checkpoint in one more
    generation — two generations per FF.
    """
    plan, gens, g = [], [], 0
    for inj in injections:
        f = {"generation": g, "rank": inj.rank, "at": f"{point}@{inj.iteration}#1", "mode": "kill"}
        gens.append(g)
        if spec.kind == LETO and inj.kind == "FF":
            f["lose_pages"] = lose_pages
            g += 2
        else:
            g += 1
        plan.append(f)
    return plan, gens


def rank_times(history: list[tuple[int, float]]) -> float:
    """Median gap between consecutive iterations' records (``(iteration, wall_time)`` in
    file order): the run's own fault-free iteration time."""
    gaps = [b[1] - a[1] for a, b in zip(history, history[1:], strict=False) if b[0] == a[0] + 1]
    if not gaps:
        raise InvalidInput("fewer than two consecutive iterations recorded: no iteration time")
    return statistics.median(gaps)


def measured_ettr(history: list[tuple[int, float]], iterations: int) -> dict:
    """ETTR as the paper measures it, ``N · T_iter / T_eval(N)`` from training start,
    with ``T_iter`` the run's own median iteration gap: its fault-free pace. (Not the
    reference run's: on a shared machine the pace of two runs minutes apart differs by
    more than the recoveries cost.) ``t_0`` is the first record of iteration 0 minus one
    iteration, ``t_N`` the last record."""
    done = {it for it, _ in history}
    if iterations - 1 not in done:
        raise InvalidInput(f"the run never recorded its last iteration {iterations - 1}")
    t_iter = rank_times(history)
    start = min(w for it, w in history if it == 0) - t_iter
    end = max(w for _, w in history)
    return {
        "ettr": iterations * t_iter / (end - start),
        "t_iter_s": t_iter,
        "training_wall_s": end - start,
    }


def failure_costs(
    summary: dict,
    injections: list[Injection],
    gens: list[int],
    spec: SystemSpec,
    histories: dict[int, list[tuple[int, float]]],
    t_iter_s: float,
) -> list[dict]:
    """Per injected failure: init (detected → every rank trains again) and recompute
    (→ the iteration in flight at the failure recorded again by every rank), from the
    run's recovery records and verifiers traces. Raises if a failure did not happen
    as planned (no record of its generation, or an FF that did not go fatal)."""
    recs = {r["generation"]: r for r in summary["recoveries"]}
    planned = set(gens) | {g + 1 for g, i in zip(gens, injections, strict=True) if i.kind == "FF"}
    extra = sorted(set(recs) - planned)
    if extra:
        # The plan arms failure k in generation g_k; a failure nobody planned shifts every
        # later generation, so the remaining failures would strike the wrong trainers.
        r = recs[extra[0]]
        raise RuntimeError(
            f"{spec.name}: generation {extra[0]} failed without a planned failure (failed "
            f"ranks {r.get('failed_ranks')}, class {r['class']}); planned generations "
            f"{sorted(planned)}. {_log_tail(summary, extra[0], r.get('failed_ranks') or [])}"
        )
    out = []
    for k, (inj, g) in enumerate(zip(injections, gens, strict=True)):
        nxt = gens[k + 1] if k + 1 < len(gens) else math.inf
        if g not in recs:
            raise RuntimeError(
                f"{spec.name}: failure {k} (rank {inj.rank}, iteration {inj.iteration}, "
                f"generation {g}) left no recovery record; recorded generations "
                f"{sorted(recs)}: the injection point was not reached or the run stopped"
            )
        first = recs[g]
        done = [r for gen, r in sorted(recs.items()) if g <= gen < nxt and "recovery_s" in r]
        if not done:
            raise RuntimeError(f"{spec.name}: failure {k} (generation {g}): no rank resumed")
        last = done[0]
        in_place = spec.kind == LETO and inj.kind == "HOF"
        want = "HOF" if in_place else "FF"
        if last["class"] != want:
            raise RuntimeError(
                f"{spec.name}: failure {k} ({inj.kind} at iteration {inj.iteration}) was "
                f"recovered as {last['class']}, expected {want}: {last}"
            )
        detected = first["detected_at"]
        resumed = last["detected_at"] + last["recovery_s"]
        regained = max(
            min(w for it, w in h if it >= inj.iteration and w > detected)
            for h in histories.values()
        )
        # Where in its iteration the failure struck: detection (<= poll_s after the kill)
        # minus the previous iteration's record, as a fraction (the simulator's input).
        before = [w for it, w in histories[0] if w < detected]
        elapsed = (detected - before[-1]) / t_iter_s if before and inj.iteration > 0 else 0.5
        out.append(
            {
                "iteration": inj.iteration,
                "rank": inj.rank,
                "kind": inj.kind,
                "path": "in-place" if in_place else "checkpoint",
                "generation": g,
                "init_s": resumed - detected,
                # Leto finishing an interrupted update records that iteration while
                # resuming, before it reports: nothing is recomputed, not a negative time.
                "recompute_s": max(regained - resumed, 0.0),
                "recovery_s": max(regained, resumed) - detected,
                "in_iteration_fraction": min(max(elapsed, 0.0), 0.999),
            }
        )
    return out


def _log_tail(summary: dict, generation: int, ranks: list[int]) -> str:
    """The last line of each failed rank's log in ``generation`` (the root cause)."""
    log_dir = Path(summary.get("config", {}).get("log_dir", "."))
    lines = []
    for r in ranks:
        for role in ("active", "shadow"):
            f = log_dir / f"rank{r}.gen{generation}.{role}.log"
            text = f.read_text(errors="replace").strip() if f.is_file() else ""
            if text:
                lines.append(f"{f.name}: {text.splitlines()[-1][-400:]}")
    return "; ".join(lines) or f"no log lines (logs in {log_dir})"


def _reach(
    placed: list, count: int, system: System, t_iter_s: float, p: float, interval: int, world: int
) -> float:
    """Earliest time at which the modelled job, failing at ``placed``, has completed
    ``count`` iterations (bisection on ``simulate``'s completed count, which is
    monotone after the last placed failure)."""
    lo = placed[-1].at_s if placed else 0.0

    def done(t: float) -> bool:
        s = Schedule(tuple(placed), t, world)
        return simulate(s, system, t_iter_s, p, interval).iterations >= count

    step = t_iter_s * (1.0 + p) * (count + 1)
    hi = lo + step
    for _ in range(64):  # bounded: each step doubles; the job always progresses
        if done(hi):
            break
        lo, hi, step = hi, hi + 2 * step, 2 * step
    else:
        raise RuntimeError(f"the modelled job never completed {count} iterations")
    for _ in range(200):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if done(mid) else (mid, hi)
    return hi


def predict(
    failures: list[dict],
    spec: SystemSpec,
    t_iter_s: float,
    save_cost_s: float,
    interval: int,
    iterations: int,
    world: int,
) -> dict:
    """The simulator's ETTR for the measured inputs: the modelled job runs at the run's
    own pace ``t_iter_s``; failure k is placed where it first completes the failure's
    iteration, plus the measured fraction of the next; the run ends when it completes
    ``iterations``."""

    def mean(xs):
        return statistics.fmean(xs) if xs else 0.0

    ckpt_path = [f["init_s"] for f in failures if f["path"] == "checkpoint"]
    in_place = [f["init_s"] for f in failures if f["path"] == "in-place"]
    # Detection (<= poll_s) is inside the measured failure time: each failure is placed
    # at its detection and its init time starts there.
    system = System(spec.name, spec.kind, 0.0, mean(ckpt_path), mean(in_place), 0.0)
    p = save_cost_s / t_iter_s
    placed: list[Failure] = []
    for f in failures:
        t = _reach(placed, f["iteration"], system, t_iter_s, p, interval, world)
        at = t + f["in_iteration_fraction"] * t_iter_s
        placed.append(Failure(at_s=at, rank=f["rank"], kind=f["kind"]))
    end = _reach(placed, iterations, system, t_iter_s, p, interval, world)
    r = simulate(Schedule(tuple(placed), end, world), system, t_iter_s, p, interval)
    return {
        "ettr": r.ettr,
        "mean_init_s": mean([x.init_s for x in r.failures]),
        "mean_recompute_s": mean([x.recompute_s for x in r.failures]),
        "inputs": {
            "t_iter_s": t_iter_s,
            "t_ckpt_s": save_cost_s,
            "ckpt_p": p,
            "interval": interval,
            "t_init_s": system.t_init_s,
            "t_init_hof_s": system.t_init_hof_s,
            "failures_at_s": [x.at_s for x in placed],
        },
    }


# -- running the systems -----------------------------------------------------------------


def _mount_type(path: Path) -> str:
    """The file-system type of the mount holding ``path`` (longest matching mount point)."""
    path = path.resolve()
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, fstype, *_ = line.split()
        if (path == Path(mnt) or Path(mnt) in path.parents) and len(mnt) > len(best):
            best, kind = mnt, fstype
    return kind


def _machine() -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        # Others' processes share this machine's cores: the load says how much.
        "load_avg_1_5_15": os.getloadavg(),
    }


def _histories(out: Path) -> dict[int, list[tuple[int, float]]]:
    from verifiers.trace import read_run

    run = read_run(out)
    return {r: [(x.iteration, x.wall_time) for x in t.history] for r, t in run.traces.items()}


def run_leto(
    work: Path,
    spec: SystemSpec,
    ckpt_dir: Path,
    interval: int,
    faults: list[dict],
    args,
    mttf_s: float,
    hof_ratio: float,
) -> dict:
    """One ``leto run`` of the example job; returns its JSON summary, with the run's
    wall time (launch to exit) as ``run_wall_s``."""
    from leto.job.store import free_port

    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "leto.cli", "run", "--json", "--verify", "--device", args.device,
        "--nproc-per-node", str(args.nproc_per_node), "--master-port", str(free_port()),
        "--shadow-level", spec.shadow_level, "--recovery", spec.recovery,
        "--log-dir", str(work / "logs"), "--checkpoint-dir", str(ckpt_dir),
        "--checkpoint-interval", str(interval), "--mttf-s", f"{mttf_s:.6g}",
        "--hof-ratio", f"{hof_ratio:.6g}", "--allow-fault-injection", *args.pool_flags,
        str(SCRIPT), "--iterations", str(args.iterations), "--out", str(work / "out"),
        *args.model,
    ]  # fmt: skip
    # The trainers import this checkout's packages whatever is installed.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env[ENV_FAULT_PLAN] = json.dumps(faults)
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            cmd, env=env, cwd=work, capture_output=True, text=True, timeout=args.run_timeout_s
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(
            f"{spec.name}: leto run took over {args.run_timeout_s} s (--run-timeout-s); "
            f"logs in {work / 'logs'}"
        ) from e
    if p.returncode != 0:
        raise RuntimeError(
            f"{spec.name}: leto run exited {p.returncode}; logs in {work / 'logs'}; "
            f"stderr: {p.stderr[-2000:]}"
        )
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    summary["run_wall_s"] = time.monotonic() - t0
    return summary


def build_schedule(name: str, args, t_iter_s: float) -> Schedule:
    world = args.nproc_per_node
    duration = args.iterations * t_iter_s
    if name == "every":
        return every(args.hof_every * t_iter_s, duration, world, hof_ratio=1.0, seed=args.seed)
    tw = trace_window(
        args.trace, args.trace_start_s, args.trace_length_s, world, args.hof_ratio, args.seed
    )
    return compress(tw, duration)


def run_schedule(name: str, args, root: Path, mem_root: Path, cal: dict, ref_out: Path) -> dict:
    from verifiers import compare

    t_iter = cal["t_iter_s"]
    schedule = build_schedule(name, args, t_iter)
    injections, notes = place(schedule, t_iter, args.iterations)
    if not injections:
        raise InvalidInput(f"schedule {name!r} places no failure in {args.iterations} iterations")
    n = len(injections)
    hof = sum(i.kind == "HOF" for i in injections)
    mttf = args.iterations * t_iter / n  # job time per failure, as placed
    h = hof / n
    rows = {}
    for spec in systems(args.leto_shadow_level, args.leto_storage):
        cost = cal[spec.storage]["save_cost_s"]
        interval = young(cost, t_iter, mttf, h, spec.kind, args.iterations)
        plan, gens = fault_plan(injections, spec, args.fault_point, args.tier1_pages + 1)
        slug = spec.name.lower().replace(" + ", "-").replace(" ", "-")
        work = root / name / slug
        ckpt = (mem_root if spec.storage == "memory" else work) / f"{name}-{slug}-checkpoints"
        summary = run_leto(work, spec, ckpt, interval, plan, args, mttf, h)
        shutil.rmtree(ckpt, ignore_errors=True)  # tmpfs is RAM: give it back now
        hist = _histories(work / "out")
        m = measured_ettr(hist[0], args.iterations)
        fails = failure_costs(summary, injections, gens, spec, hist, m["t_iter_s"])
        verdict = compare(ref_out, work / "out")
        pred = predict(
            fails, spec, m["t_iter_s"], cost, interval, args.iterations, args.nproc_per_node
        )

        def mean(key, fs=fails):
            return statistics.fmean(f[key] for f in fs)

        rows[spec.name] = {
            "shadow_level": spec.shadow_level,
            "recovery": spec.recovery,
            "storage": spec.storage,
            "checkpoint_dir_fs": _mount_type(ckpt.parent),
            "interval": interval,
            "save_cost_s": cost,
            "ettr": m["ettr"],
            "ettr_incl_launch": summary["measured"].get("ettr"),
            "t_iter_s": m["t_iter_s"],
            "training_wall_s": m["training_wall_s"],
            "other_s": m["training_wall_s"]
            - args.iterations * m["t_iter_s"]
            - sum(f["recovery_s"] for f in fails),
            "failures": len(fails),
            "hof": hof,
            "ff": n - hof,
            "mean_recovery_s": mean("recovery_s"),
            "mean_init_s": mean("init_s"),
            "mean_recompute_s": mean("recompute_s"),
            "by_path": {
                path: {
                    "failures": len(fs),
                    "mean_init_s": mean("init_s", fs),
                    "mean_recompute_s": mean("recompute_s", fs),
                }
                for path in ("in-place", "checkpoint")
                if (fs := [f for f in fails if f["path"] == path])
            },
            "per_failure": fails,
            "exact": verdict.exact,
            "first_divergence": None if verdict.exact else verdict.describe(),
            "predicted": pred,
            "prediction_error": (pred["ettr"] - m["ettr"]) / m["ettr"],
            "run_wall_s": summary["run_wall_s"],
            "work_dir": str(work),
        }
    return {
        "schedule": json.loads(schedule.to_json()),
        "mttf_s": mttf,
        "hof_ratio": h,
        "injections": [asdict(i) for i in injections],
        "notes": notes,
        "systems": rows,
    }


def _print(res: dict, console: Console) -> None:
    cal = res["calibration"]
    console.print(
        f"T_iter {cal['t_iter_s'] * 1e3:.1f} ms; checkpoint cost: tmpfs "
        f"{cal['memory']['save_cost_s'] * 1e3:.1f} ms, disk {cal['disk']['save_cost_s'] * 1e3:.1f} ms "
        f"({res['world_size']} ranks on {res['device']})\n{EMULATION}"
    )
    for name, s in res["schedules"].items():
        t = Table(
            title=f"schedule {name}: {len(s['injections'])} failures "
            f"(HOF ratio {s['hof_ratio']:.2f}), MTTF {s['mttf_s']:.2f} s of job time"
        )
        cols = (
            "system", "ckpt every", "ETTR", "predicted (sim)", "error", "HOF/FF",
            "recovery", "init", "recompute", "other", "exact",
        )  # fmt: skip
        for c in cols:
            t.add_column(c)
        for sysname, r in s["systems"].items():
            t.add_row(
                sysname,
                f"{r['interval']} it",
                f"{r['ettr']:.1%}",
                f"{r['predicted']['ettr']:.1%}",
                f"{r['prediction_error']:+.1%}",
                f"{r['hof']}/{r['ff']}",
                f"{r['mean_recovery_s']:.2f} s",
                f"{r['mean_init_s']:.2f} s",
                f"{r['mean_recompute_s']:.2f} s",
                f"{r['other_s']:.1f} s",
                "EXACT" if r["exact"] else f"NOT EXACT: {r['first_divergence']}",
            )
        console.print(t)
        for sysname, r in s["systems"].items():
            if len(r["by_path"]) > 1:
                parts = [
                    f"{path}: {b['failures']} × init {b['mean_init_s']:.2f} s + recompute "
                    f"{b['mean_recompute_s']:.2f} s"
                    for path, b in r["by_path"].items()
                ]
                console.print(f"  {sysname} by recovery path — " + "; ".join(parts))
        for note in s["notes"]:
            console.print(f"  note: {note}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--nproc-per-node", type=int, default=2, help="ranks (world size)")
    ap.add_argument("--iterations", type=int, default=120, help="training iterations per run")
    ap.add_argument(
        "--schedules",
        nargs="+",
        default=["every", "trace"],
        choices=["every", "trace"],
        help="every: one HOF every --hof-every iterations; trace: a trace window",
    )
    ap.add_argument("--hof-every", type=int, default=30, help="K of the 'every' schedule")
    ap.add_argument("--trace", default=str(GCP_TRACE), help="a trace of data/traces/")
    ap.add_argument("--trace-start-s", type=float, default=44200.0, help="trace window start")
    ap.add_argument("--trace-length-s", type=float, default=4800.0, help="trace window length")
    ap.add_argument("--hof-ratio", type=float, default=0.5, help="HOF fraction of the trace")
    ap.add_argument("--seed", type=int, default=0, help="seed of kinds and ranks")
    ap.add_argument(
        "--fault-point", default="update.optimizer", help="faultkit point each failure kills at"
    )
    ap.add_argument(
        "--calibration-interval", type=int, default=4, help="saves every N in the references"
    )
    ap.add_argument("--leto-shadow-level", default="L3", help="Leto's shadows: L1, L2 or L3")
    ap.add_argument(
        "--leto-storage",
        default="memory",
        choices=["memory", "disk"],
        help="where Leto's FF checkpoints go (memory: tmpfs, the Gemini+ path)",
    )
    ap.add_argument("--memory-dir", default="/dev/shm", help="a tmpfs for in-memory checkpoints")
    ap.add_argument("--work-dir", default=None, help="runs, logs, traces (default: a temp dir)")
    ap.add_argument("--run-timeout-s", type=float, default=900.0, help="limit per leto run")
    ap.add_argument("--json-out", default=None, help="write results as JSON here")
    ap.add_argument(
        "--model",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra flags for examples/train_gpt.py, last (e.g. --n-layer 4 --n-embd 128)",
    )


def _check(ap: argparse.ArgumentParser, args) -> None:
    if args.nproc_per_node < 1:
        ap.error(f"--nproc-per-node {args.nproc_per_node}: expected >= 1")
    if args.calibration_interval < 2:
        ap.error("--calibration-interval must be >= 2 (gaps without a save are needed)")
    least = 3 * args.calibration_interval + 2
    if args.iterations < least:
        ap.error(
            f"--iterations {args.iterations}: the reference runs calibrate the save cost on "
            f"two saves after a {args.calibration_interval}-iteration warm-up; use at least "
            f"{least} (or a smaller --calibration-interval)"
        )
    if not 1 <= args.hof_every < args.iterations:
        ap.error(f"--hof-every {args.hof_every}: expected 1 <= K < --iterations")
    if not 0.0 <= args.hof_ratio <= 1.0:
        ap.error(f"--hof-ratio {args.hof_ratio}: expected a fraction in [0, 1]")
    if args.leto_shadow_level not in ("L1", "L2", "L3"):
        ap.error(f"--leto-shadow-level {args.leto_shadow_level!r}: use L1, L2 or L3")
    mem = Path(args.memory_dir)
    if not mem.is_dir() or _mount_type(mem) not in ("tmpfs", "ramfs"):
        ap.error(
            f"--memory-dir {mem} is not a tmpfs/ramfs directory (it is "
            f"{_mount_type(mem) if mem.is_dir() else 'missing'}): the Gemini-style emulation "
            "needs host memory; give a tmpfs mount"
        )


def run(args, argv_text: str) -> dict:
    """Run the comparison for parsed ``args``; returns (and optionally writes) results."""
    from verifiers import compare

    # The pools of bench/recovery_speed.py; an FF loses one page more than tier-1 covers.
    args.tier1_pages = 4
    args.pool_flags = ["--tier1-pages", str(args.tier1_pages)] + (
        ["--page-bytes", "16384", "--data-pages", "16"]
        if args.device == "cpu"
        else ["--data-pages", "64"]
    )
    # Piped output (logs, CI) gets a fixed width: rich's 80-column default folds the table.
    console = Console() if sys.stdout.isatty() else Console(width=150)
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="leto-ettr-"))
    root.mkdir(parents=True, exist_ok=True)
    if _mount_type(root) in ("tmpfs", "ramfs"):
        raise InvalidInput(
            f"work dir {root} is on {_mount_type(root)}: the torchrun + DCP baseline would save "
            "to memory, not disk; pass --work-dir on a disk file system"
        )
    mem_root = Path(tempfile.mkdtemp(prefix="leto-ettr-", dir=args.memory_dir))
    console.print(f"work dir {root}; in-memory checkpoints under {mem_root}")
    try:
        cal: dict = {}
        refs = {}
        ref_spec = SystemSpec("reference", "off", "in-place", "", INTERVAL)
        for storage in ("memory", "disk"):
            work = root / f"reference-{storage}"
            ckpt = (mem_root if storage == "memory" else work) / "reference-checkpoints"
            summary = run_leto(
                work, replace(ref_spec, storage=storage), ckpt, args.calibration_interval, [],
                args, RunConfig.mttf_s, 0.0,
            )  # fmt: skip
            shutil.rmtree(ckpt, ignore_errors=True)
            times = {it: w for it, w in _histories(work / "out")[0]}
            cal[storage] = calibrate(times, args.calibration_interval, args.calibration_interval)
            cal[storage]["fs"] = _mount_type(ckpt.parent)
            cal[storage]["run_wall_s"] = summary["run_wall_s"]
            refs[storage] = work / "out"
        same = compare(refs["memory"], refs["disk"])
        if not same.exact:
            raise RuntimeError(
                "the two fault-free reference runs differ, so the job is not deterministic and "
                f"bit-exactness cannot be judged: {same.describe()}"
            )
        # One iteration time for placing failures and choosing intervals: both references.
        cal["t_iter_s"] = statistics.fmean(cal[s]["t_iter_s"] for s in ("memory", "disk"))
        res = {
            "date": datetime.date.today().isoformat(),
            "command": argv_text,
            "machine": _machine(),
            "device": args.device,
            "world_size": args.nproc_per_node,
            "iterations": args.iterations,
            "model_flags": args.model,
            "emulation": EMULATION,
            "calibration": cal,
            "schedules": {},
        }
        for name in args.schedules:
            res["schedules"][name] = run_schedule(name, args, root, mem_root, cal, refs["disk"])
    finally:
        shutil.rmtree(mem_root, ignore_errors=True)
    res["load_avg_at_end"] = os.getloadavg()
    _print(res, console)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    _check(ap, args)
    argv = sys.argv[1:] if argv is None else argv
    return run(args, "python -m bench.ettr " + shlex.join(argv))


def register(sub) -> None:
    """Add ``ettr`` to a ``bench`` subparser set (``leto bench ettr``)."""
    p = sub.add_parser(
        "ettr",
        help="measured ETTR of Leto vs a Gemini-style and a torchrun + DCP baseline, "
        "same job and failure schedule, with the simulator's prediction",
        description=__doc__.splitlines()[0],
    )
    add_arguments(p)

    def cmd(args) -> int:
        _check(p, args)
        try:
            run(args, "leto " + shlex.join(sys.argv[1:]))
        except (InvalidInput, RuntimeError) as e:
            print(f"leto bench ettr: {e}", file=sys.stderr)
            return 1
        return 0

    p.set_defaults(fn=cmd)


if __name__ == "__main__":
    main()
