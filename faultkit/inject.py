"""``faultkit inject``, ``faultkit matrix`` and ``faultkit run-plan``: fault-free
reference runs and faulted runs of the example job under ``leto run``, then a verdict
from ``verifiers`` — EXACT when every rank's loss and every retained tensor match bit
for bit at every iteration.

Runs in the faultkit process; the job is ``leto run examples/train_gpt.py``
(``faultkit.job``): its agent, state managers, trainers and shadows are the runtime's.
A fault: rank ``rank`` fails at the injection point of ``phase`` — mode ``kill``:
SIGKILL there; ``copy-corrupt``: random bytes into the destination of the parity copy
in progress, then SIGKILL; ``kernel-abort``: the next of Leto's own kernels (parity
copy, optimizer landing, parity update, tier-2 encode) stops after N blocks and the
rank is SIGKILLed with it in flight (``nvbit_tools.tripwire``; emulated on the CPU
build). The agents detect the death, fence every trainer; ``pages`` device pages are
lost in *each* protection group of every rank (spread over parameters and moments),
``host_parity_pages`` tier-1 host pages of the first group, and a gradient page; then
the shadows are promoted and recover in place (``all_ranks``: every rank fails at the
point at once, one failure, its losses taken once). More pages than parity covers is a
fatal failure: the runtime falls back to its newest checkpoint (or the initial state)
and the verdict says so. One fault in the middle iteration, or one every ``every`` (for
``sdc-grad`` and ``sdc-activation`` too: a GPU that computes wrong every K iterations,
replayed every K, is named twice and reported faulty — the verdict's ``faulty``).
Modes ``corrupt-data`` / ``corrupt-parity`` flip one bit in each of ``pages`` retained
pages of the rank, silently (no death, no loss): the verdict also says what the scrub
did (parity repaired in place; device pages named and the checkpoint fallback; or
nothing found, when the bytes were overwritten before anything read them).
Mode ``sdc-update`` is a wrong computation: one bit of the rank's freshly updated
parameters flipped inside the update of the middle iteration (its first chunk), after
the optimizer computed them and before parity absorbs them — parity agrees, the scrub
cannot see it, nothing dies. The verdict says whether the replica check
(``leto.integrity.replica``) detected it, in which iteration, which rank it named, where
the job rolled back to, and whether the run still ended EXACT (``replica_check=False``
runs the job with ``--no-replica-check``: then it must not). Modes ``sdc-grad`` (one
bit of the rank's local gradient flipped after backward, before the all-reduce) and
``sdc-activation`` (one bit of the output of the model's first ``nn.Linear`` flipped in
the rank's first forward of the iteration) are wrong computations that every replica
then shares: the job runs with ``--replay-every`` set so that the struck iteration is
replayed (``leto.integrity.replay``), and the verdict says whether the replay found it,
which rank it named, and that the iteration was redone in place (``replay=False``: the
job runs with ``--replay-every 0``, and the run must end NOT EXACT).

Not covered: kernel-abort of torch's own kernels (forward, backward, all-reduce): use
kill on ``--device cuda``.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from faultkit.job import JobFault, run_job
from leto import plugins
from leto.integrity.recheck import ENV_UPDATE_RECHECK
from leto.job.config import DEFAULT_SHADOW_LEVEL, LEVELS, UNDO_MODES
from leto.memory.config import PoolConfig
from leto.sim.schedule import Schedule
from leto.trainer import shared_gpu
from leto.workload.train import TrainConfig
from verifiers import compare
from verifiers.recorder import ENV_KEEP

# Progress, a line per stage (the runs, what the agent saw, the verdict): shown by the
# CLI (faultkit.cli); silent in a test or a benchmark, where no one sets INFO.
log = logging.getLogger("faultkit")

PHASES = plugins.PHASES  # phase -> point (defined beside the points, in leto)
# Phases whose injection point is in the middle of a parity copy (copy-corrupt needs one).
COPY_PHASES = ("grad-parity", "parity-copy")
# Phases followed by one of Leto's own kernels (kernel-abort stops it after N blocks):
# the grad-parity copy, the optimizer's landing, the parity update, the parity store,
# the tier-2 encode.
KERNEL_PHASES = ("grad-parity", "update", "parity", "parity-copy", "tier2")
# Silent corruption (no death): bits flipped in the retained pages of the last state
# group (corrupt-data: parameters, optimizer state) or the first group's host tier 1
# (corrupt-parity); ``pages`` says how many pages (one bit each; at least 1).
CORRUPT_MODES = ("corrupt-data", "corrupt-parity")
# A wrong computation (no death, no loss): a bit of the updated values, parity agreeing;
# of a rank's local gradient before the reduction; of a forward GEMM's output. Each
# strikes at its own phase.
SDC_PHASE = {"sdc-update": "update", "sdc-grad": "allreduce", "sdc-activation": "compute"}
SDC_MODES = tuple(SDC_PHASE)
MODES = ("kill", "copy-corrupt", "kernel-abort", *CORRUPT_MODES, *SDC_MODES)
# The job each parallelism runs: "dp" the example GPT with data parallelism; the others
# examples/parallel, each rank retaining its shards: "fsdp" FSDP2 over every rank, "tp"
# tensor-parallel MLPs over every rank, "fsdp+tp" FSDP2 x TP with TP over pairs of
# ranks, "pp" one pipeline stage per rank (GPipe); "ep" a mixture of experts, 8 experts
# a layer sharded over the ranks (expert parallel, all-to-all dispatch), the rest data
# parallel, "ep+fsdp" the same with FSDP2 over the rest; "dp-loader" a data-parallel script reading a shuffled two-worker
# StatefulDataLoader given to leto.Run(data=...); "titan" torchtitan's Llama 3 debug
# model under LetoTrainer (examples/titan/debug_job.py; torchtitan 0.2 installed; on a CPU
# at world 1 only, see examples/titan/cpu.py).
# -> (script, its flags for a world size)
_PAR = Path(__file__).resolve().parents[1] / "examples" / "parallel"
_PORTING = Path(__file__).resolve().parents[1] / "examples" / "porting"
PARALLEL = {
    "dp": None,
    "fsdp": (_PAR / "gpt_parallel_leto.py", lambda world: ["--tp", "1"]),
    "tp": (_PAR / "gpt_parallel_leto.py", lambda world: ["--tp", str(world)]),
    "fsdp+tp": (_PAR / "gpt_parallel_leto.py", lambda world: ["--tp", "2"]),
    "pp": (_PAR / "gpt_pipeline_leto.py", lambda world: []),
    "ep": (_PAR / "gpt_moe_leto.py", lambda world: []),
    "ep+fsdp": (_PAR / "gpt_moe_leto.py", lambda world: ["--fsdp"]),
    "dp-loader": (_PORTING / "loader_leto.py", lambda world: []),
    "titan": (_PAR.parent / "titan" / "debug_job.py", lambda world: []),
}


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
    shadow_level: str = DEFAULT_SHADOW_LEVEL  # leto run's shadows (off: cold restarts in place)
    abort_after_blocks: int = 3  # kernel-abort: blocks of the kernel that run
    parallel: str = "dp"  # the job's parallelism: one of PARALLEL
    replica_check: bool = True  # False: the job runs with leto run --no-replica-check
    ranks_per_gpu: int = 1  # >1: leto run --ranks-per-gpu (ranks share a GPU over gloo)
    undo: str = "chunk"  # leto run --undo: where the update's undo copies come from
    # Every rank fails at the point at once (kill, copy-corrupt, kernel-abort): one
    # failure of several ranks, its page losses taken once.
    all_ranks: bool = False
    replay: bool = True  # False: sdc-grad / sdc-activation jobs run with --replay-every 0
    # The user's own script (faultkit certify) instead of ``parallel``'s, with its own
    # arguments as given: it sets its iterations, seed and output itself.
    script: str = ""
    script_args: tuple[str, ...] = ()
    timeout_s: float = 600.0  # each leto run job
    keep_tensors: bool | None = None  # save the traced tensors (None: on the CPU only)
    cwd: str = ""  # where the script starts ("": the run's own folder)


def _phase(cfg: InjectConfig, phase: str, salt: int = 0) -> str:
    if phase == "any":
        # Only phases the mode can strike: a draw the mode refuses would be a refusal
        # the user never asked for.
        valid = {"kernel-abort": KERNEL_PHASES, "copy-corrupt": COPY_PHASES}.get(cfg.mode, PHASES)
        phase = random.Random(cfg.seed * 1_000 + salt).choice(sorted(valid))
    if phase not in PHASES:
        raise ValueError(f"--phase {phase!r}: choose one of {sorted(PHASES)} or any")
    return phase


def _outside(flag: str, value, lo: int, hi: int | None, why: str) -> ValueError:
    """The refusal of a number out of range, naming the flag and the range."""
    span = f"in {lo}..{hi}" if hi is not None else f"{lo} or more"
    return ValueError(f"{flag} {value}: must be {span} ({why}); nothing was run")


def check_job(cfg: InjectConfig) -> None:
    """Refuse a job configuration before anything runs: every flag of the job (not the
    phase and mode, ``check_fault``) against its range. A bad value found later costs a
    reference run first (a minute) and ends in a trainer's traceback — ``--pages -1``
    reached ``random.sample`` in the agent, ``--iterations 0`` a missing loss file."""
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {cfg.device!r}: choose cpu or cuda")
    if cfg.undo not in UNDO_MODES:
        raise ValueError(f"--undo {cfg.undo!r}: choose {' or '.join(UNDO_MODES)}")
    if cfg.shadow_level not in (*LEVELS, "auto"):
        raise ValueError(
            f"--shadow-level {cfg.shadow_level!r}: choose one of {', '.join(LEVELS)} or auto"
        )
    if cfg.parallel not in PARALLEL:
        raise ValueError(f"--parallel {cfg.parallel!r}: choose one of {', '.join(PARALLEL)}")
    # Ranks sharing a GPU (leto run --ranks-per-gpu) talk over gloo: refused here, not by
    # leto run after the reference run began, and before the device is looked at.
    if cfg.ranks_per_gpu < 1:
        raise _outside("--ranks-per-gpu", cfg.ranks_per_gpu, 1, None, "ranks sharing each GPU")
    if cfg.ranks_per_gpu > 1 and cfg.device != "cuda":
        raise ValueError(
            f"--ranks-per-gpu {cfg.ranks_per_gpu} shares GPUs between ranks: it needs --device "
            "cuda (on the CPU every rank has its own process and memory anyway); nothing was run"
        )
    if cfg.ranks_per_gpu > 1 and cfg.world_size > 1 and (why := shared_gpu.refusal(cfg.parallel)):
        raise ValueError(
            f"--parallel {cfg.parallel} --ranks-per-gpu {cfg.ranks_per_gpu}: {why}; nothing was run"
        )
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu")
    # The world size before the rank: --world-size 0 must not read as a bad --rank.
    if cfg.world_size < 1:
        raise _outside("--world-size", cfg.world_size, 1, None, "ranks of the job")
    if cfg.parallel == "fsdp+tp" and (cfg.world_size < 4 or cfg.world_size % 2):
        raise ValueError(
            f"--parallel fsdp+tp puts TP over pairs of ranks and FSDP2 across the pairs: "
            f"it needs an even world size of at least 4, not {cfg.world_size}"
        )
    if cfg.parallel == "titan" and cfg.device == "cpu" and cfg.world_size != 1:
        raise ValueError(
            "--parallel titan on the CPU runs at --world-size 1: torchtitan shards with "
            "FSDP2 above it, whose reduce-scatter over gloo needs PREMUL_SUM (gloo lacks it)"
        )
    if cfg.parallel in ("ep", "ep+fsdp") and 8 % cfg.world_size:
        raise ValueError(
            f"--parallel {cfg.parallel} shards 8 experts a layer over the ranks: the world size must "
            f"divide 8 (1, 2, 4 or 8), not {cfg.world_size}"
        )
    if not 0 <= cfg.rank < cfg.world_size:
        raise _outside("--rank", cfg.rank, 0, cfg.world_size - 1, "the ranks of --world-size")
    if cfg.iterations < 1:
        raise _outside("--iterations", cfg.iterations, 1, None, "training iterations")
    if cfg.every < 0 or (cfg.every and cfg.every >= cfg.iterations):
        raise ValueError(
            f"--every {cfg.every}: expected 0 (one fault, mid-run) or 1..{cfg.iterations - 1} "
            f"(a fault every K of the {cfg.iterations} iterations)"
        )
    if not 0 <= cfg.pages <= cfg.data_pages:
        raise _outside(
            "--pages", cfg.pages, 0, cfg.data_pages,
            f"pages per protection group: D={cfg.data_pages}; more than "
            f"H1={cfg.tier1_pages} is a fatal failure",
        )  # fmt: skip
    if not 0 <= cfg.host_parity_pages <= cfg.tier1_pages:
        raise _outside(
            "--host-parity-pages", cfg.host_parity_pages, 0, cfg.tier1_pages,
            f"tier-1 pages of a group: H1={cfg.tier1_pages}",
        )  # fmt: skip
    if cfg.abort_after_blocks < 1:
        raise _outside(
            "--abort-after-blocks", cfg.abort_after_blocks, 1, None,
            "blocks of the aborted kernel that run",
        )  # fmt: skip


def check_fault(phase: str, mode: str) -> None:
    """Refuse a mode the phase cannot take (also for schedules: ``faultkit plan``)."""
    if mode not in MODES:
        raise ValueError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    if phase != "any" and phase not in PHASES:
        raise ValueError(f"--phase {phase!r}: choose one of {sorted(PHASES)} or any")
    if mode == "kernel-abort" and phase not in (*KERNEL_PHASES, "any"):
        raise ValueError(
            f"--mode kernel-abort needs a phase that runs one of Leto's kernels "
            f"({', '.join(KERNEL_PHASES)}), not {phase!r}: torch's own kernels are not "
            "instrumented (use --mode kill on --device cuda)"
        )
    if mode == "copy-corrupt" and phase not in (*COPY_PHASES, "any"):
        raise ValueError(
            f"--mode copy-corrupt needs a phase that copies parity ({', '.join(COPY_PHASES)}), "
            f"not {phase!r}"
        )


def _check(cfg: InjectConfig, phase: str, mode: str) -> None:
    check_job(cfg)
    check_fault(phase, mode)
    if mode == "sdc-update" and phase not in ("update", "any"):
        raise ValueError(
            f"--mode {mode} strikes inside the update (after the optimizer computed a "
            f"chunk, before its parity absorbed it): give --phase update, not {phase!r}"
        )
    if mode in SDC_MODES and phase not in (SDC_PHASE[mode], "any"):
        raise ValueError(
            f"--mode {mode} strikes at phase {SDC_PHASE[mode]} ("
            + ("the local gradient, before the all-reduce" if mode == "sdc-grad"
               else "a forward GEMM's output")
            + f"): give --phase {SDC_PHASE[mode]}, not {phase!r}"
        )  # fmt: skip
    if mode in ("sdc-grad", "sdc-activation") and cfg.world_size < 2:
        raise ValueError(
            f"--mode {mode}: gradient replay recomputes a rank's micro-batch on another "
            "rank, so it needs --world-size 2 or more"
        )
    if mode in (*CORRUPT_MODES, "sdc-update") and cfg.every:
        raise ValueError(f"--mode {mode} injects one fault: --every is not for it")
    if cfg.all_ranks and mode in (*CORRUPT_MODES, *SDC_MODES):
        raise ValueError(
            f"--all-ranks fails every rank at once (kill, copy-corrupt, kernel-abort); --mode "
            f"{mode} is silent, on one rank: a wrong value on every rank is no disagreement"
        )
    if cfg.all_ranks and cfg.world_size < 2:
        raise ValueError("--all-ranks fails every rank at once: give --world-size 2 or more")
    if mode == "corrupt-parity" and cfg.pages > cfg.tier1_pages:
        raise _outside(
            "--pages", cfg.pages, 0, cfg.tier1_pages,
            f"corrupt-parity flips tier-1 pages: a group has H1={cfg.tier1_pages}",
        )  # fmt: skip


def check(cfg: InjectConfig) -> None:
    """Everything ``inject`` would refuse, refused now (nothing runs)."""
    _check(cfg, _phase(cfg, cfg.phase), cfg.mode)


def _job(cfg: InjectConfig) -> tuple[TrainConfig, PoolConfig]:
    train = TrainConfig(iterations=cfg.iterations, seed=cfg.seed)
    pool = PoolConfig(
        device="cpu" if cfg.device == "cpu" else "cuda:0",
        page_bytes=cfg.page_bytes if cfg.device == "cpu" else 2 << 20,
        data_pages=cfg.data_pages,
        tier1_pages=cfg.tier1_pages,
        allow_fault_injection=True,
    )
    return train, pool


def _agent_line(line: str) -> None:
    """A line of the job's agent log worth a progress line (a failure, the recovery's
    steps), without its timestamp: ``... leto.agent node 0 WARNING: generation 0: ...``."""
    head, sep, msg = line.partition(": ")
    if sep and " leto.agent " in head and msg.startswith("generation "):
        log.info("  %s", msg)


def _run(cfg: InjectConfig, out: Path, faults: list[JobFault] = ()) -> dict:
    train, pool = _job(cfg)
    t0 = time.perf_counter()
    env = {"LETO_TRIPWIRE_BLOCKS": str(cfg.abort_after_blocks)}
    # A small CPU job: save the tensors, so a divergence names its byte.
    if cfg.keep_tensors or (cfg.keep_tensors is None and cfg.device == "cpu"):
        env[ENV_KEEP] = "1"
    if cfg.mode == "sdc-update":  # where no replica checks the update, every chunk rechecked
        env[ENV_UPDATE_RECHECK] = "all"
    par = PARALLEL[cfg.parallel]
    if cfg.script:
        job = {"script": Path(cfg.script), "script_args": list(cfg.script_args)}
        if cfg.cwd:
            job["cwd"] = Path(cfg.cwd)
    elif par is None:
        job = {}
    else:
        job = {
        "script": par[0],
        "script_args": ["--iterations", str(cfg.iterations), "--seed", str(cfg.seed),
                        *par[1](cfg.world_size), "--out", str(Path(out) / "train")],
        }  # fmt: skip
    extra = () if cfg.replica_check else ("--no-replica-check",)
    if cfg.ranks_per_gpu > 1:
        extra += ("--ranks-per-gpu", str(cfg.ranks_per_gpu))
    if cfg.undo != "chunk":
        extra += ("--undo", cfg.undo)
    if cfg.mode in ("sdc-grad", "sdc-activation") and faults:
        # The struck iterations replayed (and the first), or nothing replayed at all.
        k = cfg.every or max(1, cfg.iterations // 2)
        extra += ("--replay-every", str(k if cfg.replay else 0))
    got = run_job(
        cfg.world_size, train, out, faults, pool=pool, device=cfg.device,
        shadow_level=cfg.shadow_level, allow_failure=bool(faults), env=env, extra=extra,
        timeout_s=cfg.timeout_s,
        # The agent's lines only when someone shows them (the CLI's progress).
        watch=_agent_line if log.isEnabledFor(logging.INFO) else None, **job,
    )  # fmt: skip
    got["run_s"] = time.perf_counter() - t0
    return got


def reference_run(cfg: InjectConfig, work: Path) -> dict:
    """The fault-free run every faulted run of the same job is compared with. Without
    shadows: a parked shadow computes nothing, so the bytes are the same and the job
    starts half the processes."""
    # A user's script (certify) runs its own loop: its count is known only after this run.
    what = (
        f"{Path(cfg.script).name}, {cfg.world_size} ranks, the script's own iterations"
        if cfg.script
        else f"{cfg.parallel}, {cfg.world_size} ranks, {cfg.iterations} iterations"
    )
    log.info("reference run (fault-free, %s) started", what)
    ref = _run(replace(cfg, shadow_level="off"), work / "reference")
    log.info("reference run finished in %.1f s", ref["run_s"])
    return ref


def faulted_run(cfg: InjectConfig, faults: list[JobFault], ref: dict, work: Path, label: str):
    what = "; ".join(
        f"{f.mode} rank {f.rank} at {f.at}"
        + (f", {f.lose_pages} page(s) lost per group" if f.lose_pages else "")
        + (f", {f.host_parity_pages} host parity page(s)" if f.host_parity_pages else "")
        for f in faults
    )
    log.info("faulted run started: %s", what)
    got = _run(cfg, work / label, faults)
    log.info("faulted run finished in %.1f s (exit code %d); comparing", got["run_s"], got["code"])
    recs = got.get("recoveries", [])
    ff = [r for r in recs if r["class"] == "FF"]
    ok = got["code"] == 0
    pools = [p for p in got.get("pools", []) if "error" not in p]
    rebuilt = sum(p["rebuilt_pages_total"] for p in pools)
    pending = sum(len(v) for p in pools for g in p["groups"] for v in g["pending"].values())
    lost = {k: sum(r.get("pages_lost", {}).get(k, 0) for r in recs) for k in ("device", "host")}
    # [rank, group, pages it holds] for every group smaller than the pages asked of it.
    short = [x for r in recs for x in r.get("pages_lost", {}).get("short", [])]
    verdict = compare(Path(ref["out"]), Path(got["out"])) if ok else None
    # A silent-corruption case whose flips never happened proves nothing: not EXACT.
    flips = got.get("corruptions", [])
    asked = sum(f.mode.startswith("corrupt") for f in faults)
    exact = ok and verdict.exact and pending == 0 and len(flips) >= asked
    hof = [r for r in recs if r["class"] == "HOF"]
    # A HOF's recovery as the paper measures it (I + R: failure until the interrupted
    # iteration has completed again), else — a job that ended before the promoted
    # trainer's first iteration — the slowest rank's resume after the detection.
    recovery = [r.get("regained_s", r.get("recovery_s")) for r in hof]
    recovery = [x for x in recovery if x is not None]
    # Each failure's own figures, in the order they happened (certify gives each fault
    # its own, not the run's maximum).
    timed = [
        {k: r.get(k) for k in ("class", "init_s", "recompute_s", "regained_s", "recovery_s")}
        for r in sorted(recs, key=lambda r: r["generation"])
    ]
    if ff:
        back = [t["next_iteration"] for r in ff for t in r.get("trainers", {}).values()]
        detail = (
            f"{len(ff)} fatal failure(s) (more lost pages than parity covers): every rank "
            f"restarted on fresh pools from the checkpoint fallback, at iteration "
            f"{min(back) if back else '?'}"
        )
    elif not ok:
        detail = f"leto run exited {got['code']} (logs in {work / label / 'logs'})"
    elif len(flips) < asked:
        detail = f"{asked} corruption(s) asked, {len(flips)} made: the point was not reached"
    else:
        detail = None
    scrub = _scrub_outcome(Path(got["out"])) if ok else None
    replica = _replica_outcome(Path(got["out"]))
    back_to = min(back) if ff and back else None
    if replica is not None and ff:
        named = replica["named"]
        detail = (
            f"the replica check found ranks' states disagreeing after the update of "
            f"iteration {replica['iteration']} (named: rank(s) {named}"
            + ("" if replica["majority"] else ", no majority to tell which")
            + f"); every rank restarted on fresh pools from the verified checkpoint, at "
            f"iteration {back_to if back_to is not None else '?'}"
        )
    # (gradient replay's redo is in place: the verdict's detection fields say it)
    replay = _replay_outcome(Path(got["out"]))
    recheck = _recheck_outcome(Path(got["out"]))
    if recheck is not None and ff:
        detail = (
            f"the update recheck found rank {recheck['rank']}'s update of iteration "
            f"{recheck['iteration']} differing from its recomputation; every rank restarted "
            f"on fresh pools from the verified checkpoint, at iteration "
            f"{back_to if back_to is not None else '?'}"
        )
    if scrub and ff:
        detail = (
            f"the scrub found silently corrupted state ({scrub}); every rank restarted on "
            f"fresh pools from the verified checkpoint, at iteration {min(back) if back else '?'}"
        )
    log.info(
        "verdict: %s%s%s",
        "EXACT" if exact else "NOT EXACT",
        f" — {verdict.describe()}" if verdict is not None and not verdict.exact else "",
        f" — {detail}" if detail else "",
    )
    return {
        "exact": exact,
        "fatal": bool(ff) or not ok,
        "fatal_detail": detail,
        "points": [f.at for f in faults],
        "injections": len(recs),
        "recoveries": len(recs) if ok else 0,
        # The ranks the agent found dead at each failure's detection (--all-ranks: all,
        # unless one was fenced before it reached the point).
        "failed_ranks": [r.get("failed_ranks", []) for r in recs],
        "pages_asked_per_group": max((f.lose_pages for f in faults), default=0),
        "groups_smaller_than_asked": short,
        "pages_lost_device": lost["device"],
        "pages_lost_host": lost["host"],
        # After a fatal failure the fresh pools rebuilt nothing: the checkpoint did.
        "pages_rebuilt": rebuilt,
        "host_pages_rebuilt": lost["host"] if exact and not ff else 0,
        "poison_mechanism": pools[0]["mechanism"] if pools else None,
        "kernel_abort": got.get("aborts") or None,
        "shadow_level": cfg.shadow_level,
        "undo": cfg.undo,
        "first_divergence": verdict.describe() if verdict else None,
        "verdict": verdict.as_dict() if verdict else None,
        "recovery_s": max(recovery) if recovery else None,
        "recoveries_timed": timed,
        # Files the script emptied when a promoted trainer ran its set-up again
        # (leto.trainer.truncation's console lines): noticed, not judged.
        "files_truncated": _truncated(work / label / "logs"),
        "scrub": scrub,
        # A wrong computation: detected, by what, when, whom it named (_detection).
        **_detection(replay, recheck, replica, back_to),
        # Devices named in two detections (sdc-grad / sdc-activation with --every).
        "faulty": got.get("faulty", []),
        # What faultkit flipped: target, group, [page, byte, bit] of each page.
        "flipped": [{k: x[k] for k in ("corrupt", "group", "at", "pages")} for x in flips],
        # Plan entries that never struck (their point was not reached): leto run's list.
        "unfired": got.get("unfired_faults", []),
        "reference_run_s": ref.get("run_s"),
        "faulted_run_s": got["run_s"],
        "workdir": str(work),
    }


def _hook_mode(cfg: InjectConfig) -> str:
    """faultkit.hooks' mode string: corrupt modes name target, pages and group. Data
    pages of the *last* group: at an update phase the first group's first chunk is in
    flight, the one window parity cannot see (docs/integrity.md)."""
    k = max(1, cfg.pages)
    if cfg.mode == "corrupt-data":
        return f"corrupt:data:{k}:-1"
    if cfg.mode == "corrupt-parity":
        return f"corrupt:tier1:{k}:0"
    if cfg.mode in ("sdc-update", "sdc-grad"):
        return "corrupt:computed:1"
    if cfg.mode == "sdc-activation":
        return "corrupt:activation:1"
    return cfg.mode


def _replica_outcome(train_out: Path) -> dict | None:
    """The first disagreement the replica check logged (``rank<r>.replica.jsonl``, every
    rank writes the same), or None. At world 2 the fallback's redo of that iteration
    names the rank (a ``resolved`` line): then it is the one named, as by a majority."""
    found = [
        json.loads(x)
        for f in sorted(train_out.glob("rank*.replica.jsonl"))
        for x in f.read_text().splitlines()
    ]
    first = min((x for x in found if not x.get("resolved")), key=lambda x: x["iteration"],
                default=None)  # fmt: skip
    if first is None or first["majority"]:
        return first
    redo = [x for x in found if x.get("resolved") and x["iteration"] == first["iteration"]]
    if redo and len(redo[0]["named"]) == 1:
        return {**first, "named": redo[0]["named"], "majority": True, "named_by": "redo"}
    return first


def _replay_outcome(train_out: Path) -> dict | None:
    """The first mismatch gradient replay logged (``rank<r>.replay.jsonl``, every rank
    writes the same), or None."""
    found = [
        json.loads(x)
        for f in sorted(train_out.glob("rank*.replay.jsonl"))
        for x in f.read_text().splitlines()
    ]
    return min(found, key=lambda x: x["iteration"]) if found else None


def _detection(replay, recheck, replica, back_to) -> dict:
    """The verdict's detection fields: which check found a wrong computation (gradient
    replay, the update recheck, the replica check), in which iteration, the rank it
    named (None when neither a majority nor the redo names one), the suspects, and the
    iteration the job went back to (replay: the same, redone in place)."""
    if replay is not None:
        return {**_sdc_fields(replay), "detected_by": "replay"}
    if recheck is not None:
        return {
            "detected": True, "detected_at": recheck["iteration"], "named_rank": recheck["rank"],
            "suspects": [recheck["rank"]], "rolled_back": back_to, "detected_by": "recheck",
        }  # fmt: skip
    return {
        "detected": replica is not None,
        "detected_at": replica["iteration"] if replica else None,
        "named_rank": replica["named"][0] if replica and replica["majority"] else None,
        "suspects": replica["named"] if replica else [],
        "rolled_back": back_to,
        "detected_by": "replica check" if replica else None,
    }


def _recheck_outcome(train_out: Path) -> dict | None:
    """The first wrong update the update recheck logged (``rank<r>.recheck.jsonl``: the
    rank that computed it writes it), or None."""
    found = [
        json.loads(x)
        for f in sorted(train_out.glob("rank*.recheck.jsonl"))
        for x in f.read_text().splitlines()
    ]
    return min(found, key=lambda x: x["iteration"]) if found else None


def _sdc_fields(replay: dict) -> dict:
    """The verdict's detection fields from a replay mismatch: named when one rank is; the
    suspects are the ranks that computed the differing digests; the iteration was redone
    in place (its update had not run)."""
    named = replay["named"]
    suspects = sorted(
        {f[k] for f in replay["found"] for k in ("original", "replayer")} if not named else named
    )
    return {
        "detected": True,
        "detected_at": replay["iteration"],
        "named_rank": named[0] if len(named) == 1 else None,
        "suspects": suspects,
        "rolled_back": replay["iteration"],
    }


def _truncated(logs: Path) -> list[str]:
    """The files promoted trainers said the script opened with "w" (each once)."""
    from leto.trainer.truncation import SAID

    found: dict[str, None] = {}
    for f in sorted(logs.glob("rank*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if SAID in line:
                path = line.split(SAID, 1)[1].strip().split(' with "w"')[0]
                found.setdefault(path, None)
    return list(found)


def _scrub_outcome(train_out: Path) -> str | None:
    """What the scrub logged (``rank<r>.scrub.jsonl``), in a line; None if nothing."""
    found = []
    for f in sorted(train_out.glob("rank*.scrub.jsonl")):
        rank = f.name.split(".")[0][4:]
        found += [(rank, json.loads(x)) for x in f.read_text().splitlines()]
    if not found:
        return None
    parts = []
    for rank, x in found:
        what = "repaired" if x["repaired"] else "named, fatal"
        where = f"{x['allocation']} page {x['allocation_page']}" if x["allocation"] else x["tier"]
        parts.append(f"rank {rank} group {x['group']} {where}: {what} ({x['when']})")
    return "; ".join(dict.fromkeys(parts))


def _iterations(cfg: InjectConfig) -> list[int]:
    if cfg.every:
        return list(range(cfg.every, cfg.iterations, cfg.every))
    return [cfg.iterations // 2]


def _point(cfg: InjectConfig, salt: int) -> str:
    """The point a fault of ``cfg`` strikes at: its phase's, or for a wrong computation
    the update's seam between computing a chunk and its parity absorbing it."""
    if cfg.mode == "sdc-update":
        return plugins.SDC_POINT
    if cfg.mode == "sdc-grad":
        return plugins.SDC_GRAD_POINT
    if cfg.mode == "sdc-activation":  # the model's forward pre-hook: the flip is this forward's
        return "compute.forward"
    return PHASES[_phase(cfg, cfg.phase, salt)]


def inject(cfg: InjectConfig, workdir: Path | None = None, reference: dict | None = None) -> dict:
    """One faulted run against the fault-free reference (run first unless given), in
    ``workdir`` (default: a new temporary directory, left for the caller)."""
    phase = SDC_PHASE[cfg.mode] if cfg.mode in SDC_MODES else _phase(cfg, cfg.phase)
    _check(cfg, phase, cfg.mode)
    work = Path(workdir or tempfile.mkdtemp(prefix="faultkit-"))
    ref = reference or reference_run(cfg, work)
    faults = []
    for k, it in enumerate(_iterations(cfg)):
        # nth=1: the first chunk/group, reached whatever the model's size and page size
        at = f"{_point(cfg, k)}@{it}#1"
        faults.append(
            JobFault(
                cfg.rank,
                at,
                _hook_mode(cfg),
                lose_pages=0 if cfg.mode in (*CORRUPT_MODES, *SDC_MODES) else cfg.pages,
                host_parity_pages=(
                    0 if cfg.mode in (*CORRUPT_MODES, *SDC_MODES) else cfg.host_parity_pages
                ),
            )
        )
        if cfg.all_ranks:  # the other ranks, at the same point of the same failure
            others = [r for r in range(cfg.world_size) if r != cfg.rank]
            faults += [JobFault(r, at, _hook_mode(cfg), with_previous=True) for r in others]
    label = f"faulted-{phase}-{cfg.mode}-p{cfg.pages}-h{cfg.host_parity_pages}"
    label += "-all" if cfg.all_ranks else ""
    res = faulted_run(cfg, faults, ref, work, label)
    return {
        **res,
        "phase": phase,
        "mode": cfg.mode,
        "point": res["points"][0],
        "config": asdict(cfg),
    }


def matrix_cases(
    base: InjectConfig,
    phases: tuple[str, ...] | None = None,
    modes: tuple[str, ...] = ("kill", "copy-corrupt"),
    corrupt_pages: str = "both",
    losses: str = "all",
) -> list[tuple[str, str, int, int]]:
    """The cases of a matrix, (phase, mode, pages, host parity pages), checked
    (nothing runs). Every phase x {0, H1} lost pages per group x host parity page lost or not x
    ``modes`` (copy-corrupt where the phase copies parity, kernel-abort where it runs
    one of Leto's kernels), against one shared fault-free reference. Corrupt modes flip
    1 and H1 pages at every phase (``corrupt_pages="both"``), or half of those cases
    (``"alternate"``: 1 and H1 take turns along phases and modes, so every phase and
    every corrupt mode still sees both counts — the CI's cut). The other modes run
    every loss combination (``losses="all"``: {0, H1} pages x host page or not) at each
    phase, or one per phase and mode (``"alternate"``: the four take turns, so each is
    run at a quarter of the phases — the CI's cut for the parallel jobs), or two
    (``"pairs"``: none with H1 pages and a host page, or each alone, the pairs taking
    turns, so each loss is run at half the phases — the CI's cut for the example job), or
    one beyond parity (``"beyond"``: H1 + 1 device pages per group, all of a smaller
    group's, and every tier-1 host page of the first group — more than parity covers
    whatever the groups hold, so the fatal path: the checkpoint fallback)."""
    if corrupt_pages not in ("both", "alternate"):
        raise ValueError(f"--corrupt-pages {corrupt_pages!r}: expected both or alternate")
    if losses not in ("all", "pairs", "alternate", "beyond"):
        raise ValueError(f"--losses {losses!r}: expected all, pairs, alternate or beyond")
    check_job(base)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    for phase in phases or ():
        if phase not in PHASES:  # "any" is no phase of a matrix
            raise ValueError(f"--phases: {phase!r} is not one of {', '.join(sorted(PHASES))}")
    combos = [(0, 0), (base.tier1_pages, 1), (0, 1), (base.tier1_pages, 0)]
    cases = []  # every case, known (and checked) before the reference run
    for i, phase in enumerate(phases or tuple(PHASES)):
        for j, mode in enumerate(modes):
            if mode == "copy-corrupt" and phase not in COPY_PHASES:
                continue
            if mode == "kernel-abort" and phase not in KERNEL_PHASES:
                continue
            if mode in SDC_MODES:  # one flipped bit: its own phase only
                if phase == SDC_PHASE[mode] and (mode == "sdc-update" or base.world_size > 1):
                    cases.append((phase, mode, 0, 0))
                continue
            if mode in CORRUPT_MODES:  # 1 and H1 flipped pages, no loss
                counts = (1, base.tier1_pages)
                if corrupt_pages == "alternate":
                    counts = (counts[(i + j) % 2],)
                cases += [(phase, mode, pages, 0) for pages in counts]
                continue
            chosen = {
                "all": combos,
                "pairs": combos[2 * ((i + j) % 2) : 2 * ((i + j) % 2) + 2],
                "alternate": [combos[(i + j) % 4]],
                # A small group (2 MiB CUDA pages) holds fewer than H1 + 1 pages: its
                # tier-1 pages lost too put it beyond parity all the same.
                "beyond": [(base.tier1_pages + 1, base.tier1_pages)],
            }[losses]
            cases += [(phase, mode, pages, host) for pages, host in chosen]
    return cases


def matrix(
    base: InjectConfig,
    workdir: Path | None = None,
    phases: tuple[str, ...] | None = None,
    modes: tuple[str, ...] = ("kill", "copy-corrupt"),
    corrupt_pages: str = "both",
    losses: str = "all",
) -> list[dict]:
    """Each case of ``matrix_cases`` (the same arguments) against one shared fault-free
    reference, in ``workdir``; one verdict per case."""
    cases = matrix_cases(base, phases, modes, corrupt_pages, losses)
    work = Path(workdir or tempfile.mkdtemp(prefix="faultkit-matrix-"))
    ref = reference_run(base, work)
    rows = []
    for n, (phase, mode, pages, host) in enumerate(cases, 1):
        log.info("case %d of %d: %s, %s, %d page(s)/group, host %d",
                 n, len(cases), phase, mode, pages, host)  # fmt: skip
        cfg = replace(base, phase=phase, mode=mode, pages=pages, host_parity_pages=host)
        rows.append(inject(cfg, work, reference=ref))
    return rows


def plan_faults(
    schedule: Schedule, base: InjectConfig, iteration_s: float
) -> tuple[list[JobFault], int, int]:
    """The faults replaying ``schedule`` (``run_plan``), every failure checked: (faults,
    failures past the job's end, FFs replayed). Nothing runs."""
    check_job(base)
    if not 0 < iteration_s < float("inf"):
        raise ValueError(f"--iteration-s {iteration_s}: expected a finite time > 0 s")
    if schedule.world_size != base.world_size:
        raise ValueError(
            f"the schedule is for {schedule.world_size} ranks, --world-size is "
            f"{base.world_size}: give --world-size {schedule.world_size}"
        )
    placed = schedule.at_iteration(iteration_s)
    replay = [p for p in placed if p.iteration < base.iterations]
    if not replay:
        raise ValueError(
            f"no failure of the schedule falls in the job's {base.iterations} iterations of "
            f"{iteration_s} s; lengthen --iterations or shorten --iteration-s"
        )
    faults, seen = [], set()
    for k, p in enumerate(replay):
        f = p.failure
        phase = _phase(base, f.phase, k)
        mode = f.mode
        pages = f.pages if f.kind == "HOF" else base.tier1_pages + 1
        try:
            one = replace(base, rank=f.rank, pages=pages, host_parity_pages=f.host_parity_pages)
            _check(one, phase, mode)
        except ValueError as e:  # name the schedule's entry: the flags are not the culprit
            raise ValueError(f"the schedule's failure at {f.at_s} s: {e}") from None
        if p.iteration in seen:
            continue  # the first failure of an iteration already stops every rank
        seen.add(p.iteration)
        faults.append(
            JobFault(
                f.rank,
                f"{PHASES[phase]}@{p.iteration}#1",
                mode,
                lose_pages=pages,
                host_parity_pages=f.host_parity_pages,
            )
        )
    # One failure per generation, in order: sort by iteration, stable on schedule order.
    faults.sort(key=lambda fl: fl.iteration)
    return faults, len(placed) - len(replay), sum(p.failure.kind == "FF" for p in replay)


def run_plan(
    schedule: Schedule,
    base: InjectConfig,
    iteration_s: float,
    workdir=None,
    reference: dict | None = None,
) -> dict:
    """Replay a schedule against the example job: each failure strikes the iteration in
    flight at its time (``iteration_s`` per iteration), at its phase, on its rank. A HOF
    loses its ``pages`` per group (within parity); an FF loses H1 + 1 (beyond it): the
    run must then end in the fatal path. Failures past the job's last iteration are
    reported as not replayed. Every failure is checked before the reference runs."""
    faults, not_replayed, ff = plan_faults(schedule, base, iteration_s)
    work = Path(workdir or tempfile.mkdtemp(prefix="faultkit-plan-"))
    ref = reference or reference_run(base, work)
    res = faulted_run(base, faults, ref, work, "plan")
    res["not_replayed"] = not_replayed
    res["ff"] = ff
    return res
