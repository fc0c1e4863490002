"""``faultkit inject``, ``faultkit matrix`` and ``faultkit run-plan``: fault-free
reference runs and faulted runs of the example job, then a verdict from ``verifiers`` —
EXACT when every rank's loss and every retained tensor match bit for bit at every
iteration.

Runs in the faultkit process; the job's ranks and state managers are separate processes
(``faultkit.job``, the stop-gap launcher until ``leto run``). A fault: rank ``rank``
dies at the injection point of ``phase`` (mode ``kill``: SIGKILL there; mode
``copy-corrupt``: random bytes into the destination of the parity copy in progress,
then SIGKILL); every other rank is killed wherever it is; then ``pages`` device pages
are lost in *each* protection group of the model state of every rank (spread over its
parameters and moments), ``host_parity_pages`` tier-1 host pages of the first group, and
a gradient page; every rank restarts cold and recovers. One fault in the middle
iteration, or one every ``every`` iterations.

Not covered: mode ``kernel-abort`` (the trip-wire in the project's kernels is not built
yet: on CUDA, kill mode already SIGKILLs with kernels in flight), faults while
recovering, checkpoint fallback after a fatal failure (reported, not recovered).
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from faultkit.job import JobFault, run_job
from faultkit.loss import lose_pages
from faultkit.schedule import Schedule
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig
from verifiers import compare

PHASES = {
    "compute": "compute.backward",
    "allreduce": "allreduce",
    "grad-parity": "grad_parity",
    "sync": "sync",
    "update": "update.optimizer",
    "parity-copy": "update.store",
    "tier2": "update.tier2",
}
# Phases whose injection point is in the middle of a parity copy (copy-corrupt needs one).
COPY_PHASES = ("grad-parity", "parity-copy")
MODES = ("kill", "copy-corrupt", "kernel-abort")


@dataclass(frozen=True)
class InjectConfig:
    phase: str = "update"  # one of PHASES, or "any" (drawn from the seed)
    pages: int = 0  # device pages lost per protection group of model state
    host_parity_pages: int = 0  # tier-1 host pages lost in the first group
    mode: str = "kill"
    rank: int = 0
    iterations: int = 6
    seed: int = 0
    world_size: int = 2
    device: str = "cpu"
    tier1_pages: int = 16  # H1 of the job's pools
    data_pages: int = 64  # D of the job's pools (small pages keep the CPU build quick)
    page_bytes: int = 16384
    every: int = 0  # 0: one fault in the middle iteration; K: one every K iterations


def _phase(cfg: InjectConfig, phase: str, salt: int = 0) -> str:
    if phase == "any":
        phase = random.Random(cfg.seed * 1_000 + salt).choice(sorted(PHASES))
    if phase not in PHASES:
        raise ValueError(f"--phase {phase!r}: choose one of {sorted(PHASES)} or any")
    return phase


def _check(cfg: InjectConfig, phase: str, mode: str) -> None:
    if mode == "kernel-abort":
        raise ValueError(
            "--mode kernel-abort is not available: the trip-wire in the project's kernels "
            "(nvbit_tools) is not built yet; on --device cuda, --mode kill already SIGKILLs "
            "the rank with its kernels in flight"
        )
    if mode not in MODES:
        raise ValueError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "copy-corrupt" and phase not in COPY_PHASES:
        raise ValueError(
            f"--mode copy-corrupt needs a phase that copies parity ({', '.join(COPY_PHASES)}), "
            f"not {phase!r}"
        )
    if not 0 <= cfg.rank < cfg.world_size:
        raise ValueError(f"--rank {cfg.rank} outside 0..{cfg.world_size - 1}")
    if cfg.every < 0 or (cfg.every and cfg.every >= cfg.iterations):
        raise ValueError(f"--every {cfg.every}: expected 0 or 1..{cfg.iterations - 1}")


def _loser(cfg: InjectConfig, lost: dict, pages: int, host_pages: int, salt: int = 0):
    rng = random.Random(cfg.seed * 7_919 + salt + 1)

    def lose(rank: int, f) -> None:
        for k, v in lose_pages(f, pages, host_pages, rng).items():
            lost[k] += v

    return lose


def _job(cfg: InjectConfig):
    train = TrainConfig(
        iterations=cfg.iterations,
        seed=cfg.seed,
        device=cfg.device,
        keep_tensors=cfg.device == "cpu",  # small CPU job: name the byte offset
    )
    pool = PoolConfig(
        device="cpu" if cfg.device == "cpu" else "cuda:0",
        page_bytes=cfg.page_bytes if cfg.device == "cpu" else 2 << 20,
        data_pages=cfg.data_pages,
        tier1_pages=cfg.tier1_pages,
        allow_fault_injection=True,
    )
    if cfg.device != "cpu":
        return train, lambda r: PoolConfig(**{**asdict(pool), "device": f"cuda:{r}"})
    return train, pool


def reference_run(cfg: InjectConfig, work: Path) -> dict:
    """The fault-free run every faulted run of the same job is compared with."""
    train, pool_of = _job(cfg)
    t0 = time.perf_counter()
    ref = run_job(cfg.world_size, train, work / "reference", pool=pool_of)
    ref["run_s"] = time.perf_counter() - t0
    return ref


def faulted_run(
    cfg: InjectConfig, faults: list[JobFault], lost: dict, ref: dict, work: Path, label: str
) -> dict:
    train, pool_of = _job(cfg)
    t0 = time.perf_counter()
    got = run_job(
        cfg.world_size, train, work / label, faults=faults, pool=pool_of, allow_failure=True
    )
    t_faulted = time.perf_counter() - t0
    failed = [r for r, c in enumerate(got["codes"]) if c != 0]
    status = got["pool_status"]
    rebuilt = sum(s["rebuilt_pages_total"] for s in status)
    pending = sum(len(v) for s in status for g in s["groups"] for v in g["pending"].values())
    verdict = None if failed else compare(Path(ref["out"]), Path(got["out"]))
    recovery = [r["resume_s"] for r in got["recovery"] if r]
    exact = not failed and verdict.exact and pending == 0
    return {
        "exact": exact,
        "fatal": bool(failed),
        "fatal_detail": (
            f"ranks {failed} could not recover their retained state (more lost pages than parity "
            "covers): the checkpoint fallback arrives with the runtime issue"
            if failed
            else None
        ),
        "points": [f.at for f in faults],
        "injections": got["injections"],
        "recoveries": 0 if failed else got["injections"],
        "pages_lost_device": lost["device"],
        "pages_lost_host": lost["host"],
        "pages_rebuilt": rebuilt,
        "host_pages_rebuilt": lost["host"] if not failed and pending == 0 else 0,
        "poison_mechanism": status[0]["mechanism"] if status else None,
        "first_divergence": None if failed else verdict.describe(),
        "verdict": None if failed else verdict.as_dict(),
        "recovery_s": max(recovery) if recovery else None,
        "reference_run_s": ref.get("run_s"),
        "faulted_run_s": t_faulted,
        "workdir": str(work),
    }


def _iterations(cfg: InjectConfig) -> list[int]:
    if cfg.every:
        return list(range(cfg.every, cfg.iterations, cfg.every))
    return [cfg.iterations // 2]


def inject(cfg: InjectConfig, workdir: Path | None = None, reference: dict | None = None) -> dict:
    phase = _phase(cfg, cfg.phase)
    _check(cfg, phase, cfg.mode)
    work = Path(workdir or tempfile.mkdtemp(prefix="faultkit-"))
    ref = reference or reference_run(cfg, work)
    lost = {"device": 0, "host": 0}
    faults = [
        # nth=1: the first chunk/group, reached whatever the model's size and page size
        JobFault(
            cfg.rank,
            f"{PHASES[_phase(cfg, cfg.phase, k)]}@{it}#1",
            cfg.mode,
            _loser(cfg, lost, cfg.pages, cfg.host_parity_pages, k),
        )
        for k, it in enumerate(_iterations(cfg))
    ]
    label = f"faulted-{phase}-{cfg.mode}-p{cfg.pages}-h{cfg.host_parity_pages}"
    res = faulted_run(cfg, faults, lost, ref, work, label)
    return {
        **res,
        "phase": phase,
        "mode": cfg.mode,
        "point": res["points"][0],
        "config": asdict(cfg),
    }


def matrix(
    base: InjectConfig, workdir: Path | None = None, phases: tuple[str, ...] | None = None
) -> list[dict]:
    """Every phase x {0, H1} lost pages per group x host parity page lost or not x
    {kill, copy-corrupt} (copy-corrupt where the phase copies parity), against one
    shared fault-free reference."""
    work = Path(workdir or tempfile.mkdtemp(prefix="faultkit-matrix-"))
    ref = reference_run(base, work)
    rows = []
    for phase in phases or tuple(PHASES):
        _phase(base, phase)  # a clear error for an unknown name
        for mode in ("kill", "copy-corrupt"):
            if mode == "copy-corrupt" and phase not in COPY_PHASES:
                continue
            for pages in (0, base.tier1_pages):
                for host in (0, 1):
                    cfg = replace(base, phase=phase, mode=mode, pages=pages, host_parity_pages=host)
                    rows.append(inject(cfg, work, reference=ref))
    return rows


def run_plan(schedule: Schedule, base: InjectConfig, iteration_s: float, workdir=None) -> dict:
    """Replay a schedule against the example job: each failure strikes the iteration in
    flight at its time (``iteration_s`` per iteration), at its phase, on its rank. A HOF
    loses its ``pages`` per group (within parity); an FF loses H1 + 1 (beyond it): the
    run must then end in the fatal path. Failures past the job's last iteration are
    reported as not replayed."""
    if schedule.world_size != base.world_size:
        raise ValueError(
            f"the schedule is for {schedule.world_size} ranks, the job has {base.world_size}"
        )
    placed = schedule.at_iteration(iteration_s)
    replay = [p for p in placed if p.iteration < base.iterations]
    if not replay:
        raise ValueError(
            f"no failure of the schedule falls in the job's {base.iterations} iterations of "
            f"{iteration_s} s; lengthen --iterations or shorten --iteration-s"
        )
    work = Path(workdir or tempfile.mkdtemp(prefix="faultkit-plan-"))
    ref = reference_run(base, work)
    lost = {"device": 0, "host": 0}
    faults, seen = [], set()
    for k, p in enumerate(replay):
        f = p.failure
        phase = _phase(base, f.phase, k)
        mode = f.mode
        _check(replace(base, rank=f.rank), phase, mode)
        if p.iteration in seen:
            continue  # the first failure of an iteration already stops every rank
        seen.add(p.iteration)
        pages = f.pages if f.kind == "HOF" else base.tier1_pages + 1
        faults.append(
            JobFault(
                f.rank,
                f"{PHASES[phase]}@{p.iteration}#1",
                mode,
                _loser(base, lost, pages, f.host_parity_pages, k),
            )
        )
    # The launcher injects in order: sort by iteration, stable on schedule order.
    faults.sort(key=lambda fl: int(fl.at.split("@")[1].split("#")[0]))
    res = faulted_run(base, faults, lost, ref, work, "plan")
    res["not_replayed"] = len(placed) - len(replay)
    res["ff"] = sum(p.failure.kind == "FF" for p in replay)
    return res
