"""``faultkit certify``: the toolkit on the user's own ported script — the correctness
gate a user runs before trusting Leto with a job.

Runs in the faultkit process. It starts the script under ``leto run`` (``faultkit.job``,
as every faultkit run) fault-free — the reference — then again with a rank killed at
each phase of an iteration (``leto.plugins.PHASES``) and H1 device pages lost in each
protection group of every rank (and, at every other phase, a tier-1 host parity page
too), and compares every iteration's loss and retained-state digest of every rank with
the reference (``verifiers``). One verdict:

* EXACT — every fault struck, was recovered in place, and the run equals the reference
  bit for bit;
* NOT EXACT — the first divergence (rank, iteration, tensor) and what usually causes
  it (``hint``);
* INCOMPLETE — the time budget ran out, or a phase's point was never reached (the phases
  run are still judged; the missing ones are named).

By default the faults strike in one run, one per recovery, at iterations spread over
the script's loop (fault k lands in generation k: after each recovery the next one
strikes), so certifying costs two runs; ``separately`` gives each phase its own run
(one run per phase, each divergence tied to one fault). Which fault a divergence
follows is told by its iteration: the last fault at or before it.

Each run starts the script in a folder of its own under the work directory, so nothing
it writes lands beside the user's files; script arguments that name existing relative
paths (inputs: data files, a config) are passed as absolute paths, so the script finds
them (``resolve_args`` says which). A script that opens files relative to where it
starts (nanoGPT's ``configurator.py``) is given ``cwd``: every run starts there, and
what the script writes there every run writes (give its outputs absolute paths).

Not covered: the script's own outputs (only what ``leto.Run`` retains and the losses
``run.record_loss`` logs are compared), faults other than kills with pages lost
(``faultkit inject``/``matrix`` run those against the example jobs), multi-node jobs.
"""

from __future__ import annotations

import glob
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

from faultkit.inject import PHASES, InjectConfig, check_job, faulted_run, reference_run
from faultkit.job import JobFault
from verifiers.trace import read_run

log = logging.getLogger("faultkit")

# leto run's default pools (its --data-pages / --tier1-pages; the page size is the
# device's default), fault injection allowed.
DEFAULT_DATA_PAGES = 1024
DEFAULT_TIER1_PAGES = 4
CPU_PAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class CertifyConfig:
    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    device: str = "cpu"
    phases: tuple[str, ...] = tuple(PHASES)
    separately: bool = False  # one run per phase, not all faults in one run
    budget_s: float | None = None  # stop starting runs past this (wall seconds)
    keep_tensors: bool = False  # save traced tensors: a divergence names its byte
    cwd: str = ""  # every run starts the script here ("": each in its own folder)
    ranks_per_gpu: int = 1  # leto run --ranks-per-gpu (testing several ranks on one GPU)
    undo: str = "chunk"  # leto run --undo

    def inject_config(self) -> InjectConfig:
        return InjectConfig(
            world_size=self.nproc_per_node,
            device=self.device,
            ranks_per_gpu=self.ranks_per_gpu,
            undo=self.undo,
            data_pages=DEFAULT_DATA_PAGES,
            tier1_pages=DEFAULT_TIER1_PAGES,
            page_bytes=CPU_PAGE_BYTES,
            iterations=1,  # the script's own; set from the reference run
            script=self.script,
            script_args=self.script_args,
            keep_tensors=self.keep_tensors,
            cwd=self.cwd,
        )


def check(cfg: CertifyConfig) -> None:
    """Refuse what certify cannot run, before anything runs (ValueError: what and why)."""
    path = Path(cfg.script)
    if not path.is_file():
        raise ValueError(f"script {cfg.script!r} is not a file; nothing was run")
    if path.suffix != ".py":
        raise ValueError(f"script {cfg.script!r}: expected a Python file (.py); nothing was run")
    for phase in cfg.phases:
        if phase not in PHASES:
            raise ValueError(f"--phases: {phase!r} is not one of {', '.join(PHASES)}")
    if not cfg.phases:
        raise ValueError("--phases: name at least one phase")
    if cfg.cwd and not Path(cfg.cwd).is_dir():
        raise ValueError(f"--cwd {cfg.cwd!r} is not a folder; nothing was run")
    if cfg.budget_s is not None and not (cfg.budget_s > 0 and math.isfinite(cfg.budget_s)):
        raise ValueError(f"--time-budget {cfg.budget_s}: expected seconds > 0")
    check_job(cfg.inject_config())


def resolve_args(args: tuple[str, ...], cwd: Path) -> tuple[tuple[str, ...], list[str]]:
    """The script's arguments with each relative path that exists under ``cwd`` (a file,
    a folder, or a glob pattern matching something) made absolute — each run starts in a
    folder of its own — and the list of those rewritten. ``--flag=value`` is looked at
    in its value."""
    out, changed = [], []
    for a in args:
        flag, eq, value = a.partition("=") if a.startswith("-") else ("", "", a)
        if not eq and a.startswith("-"):
            out.append(a)
            continue
        p = Path(value)
        hit = value and not p.is_absolute() and ((cwd / p).exists() or glob.glob(str(cwd / value)))
        if hit:
            value = str(cwd / value)
            changed.append(f"{a} -> {value}")
        out.append(f"{flag}{eq}{value}")
    return tuple(out), changed


def _iterations_of(ref: dict) -> tuple[int, int]:
    """The first iteration the script's loop ran in the reference and how many it ran
    (every rank's trace; a script resuming its own checkpoint starts past 0)."""
    run = read_run(Path(ref["out"]))
    its = [sorted(t.records) for t in run.traces.values() if t.records]
    if not its:
        return 0, 0
    return min(i[0] for i in its), min(len(i) for i in its)


def placement(
    phases: tuple[str, ...], iterations: int, world: int, h1: int, first: int = 0
) -> list[JobFault]:
    """One fault per phase, in the order given: rank k % world killed at phase k's point
    in an iteration spread over 1 .. iterations - 1 (repeating one when the loop is
    shorter than the list: each fault strikes in its own generation, so a redone
    iteration is struck again at the next phase), H1 device pages lost in each
    protection group of every rank, and a tier-1 host parity page at every other phase.
    ``first``: the loop's first iteration (the iterations are counted from it)."""
    n = len(phases)
    span = max(1, iterations - 1)
    return [
        JobFault(
            rank=k % world,
            at=f"{PHASES[phase]}@{first + (1 + (k * span) // n if iterations > 1 else 0)}#1",
            lose_pages=h1,
            host_parity_pages=1 if k % 2 == 0 else 0,
            # Each fault meets parked shadows, as a failure does in a long job: its
            # recovery is the one users get, not a promotion of a shadow still starting.
            when="parked",
        )
        for k, phase in enumerate(phases)
    ]


# What usually makes a recovered run part from the reference, by what differs first.
HINT_DATA = (
    "the loss of an iteration after a recovery differs while the state before it was "
    "equal: the recovered rank trained on other data or other random numbers. Usual "
    "causes: a data loader not handed over (leto.Run(..., data=loader): without it a "
    "recovered rank starts the loader again from its first batch); random numbers drawn "
    "from a global generator outside run.batches or the model (dropout masks come from "
    "torch's generator, which Leto restores; a generator the script made itself is not); "
    "per-rank seeds computed from something that changes on a restart (time, a pid, a "
    "counter kept outside leto.Run)"
)
HINT_STATE = (
    "retained state differs with the losses equal: the update after a recovery differs. "
    "Usual causes: a learning-rate schedule computed from a counter the script keeps "
    "(use the iteration run.iterations() yields, or hand the scheduler to leto.Run); "
    "state outside the model and the optimizer (an EMA, a loss scaler) not handed over; "
    "a second optimizer not given to leto.Run"
)
HINT_RERUN = (
    "an iteration redone after a failure gave other bytes than its first computation: "
    "the script is not deterministic. On CUDA: torch.use_deterministic_algorithms(True) "
    "and CUBLAS_WORKSPACE_CONFIG=:4096:8; no atomics-based kernels (index_add_, "
    "scatter_add_ without the deterministic flag)"
)
HINT_MISSING = (
    "iterations of the reference are missing from the faulted run: the job stopped early "
    "(its leto-run.log in the work directory says why), or the loop's length depends on "
    "something a restart changes"
)


def hint(verdict: dict | None, first_fault_iteration: int) -> str | None:
    """What usually causes the divergence ``verdict`` (faulted_run's "verdict" dict)."""
    if not verdict or verdict["exact"]:
        return None
    div = verdict.get("first_divergence")
    if verdict.get("reruns_differed") and (div is None or div["iteration"] < first_fault_iteration):
        return HINT_RERUN
    if div is None:
        return HINT_MISSING if verdict.get("missing") else HINT_RERUN
    if div["iteration"] < first_fault_iteration:
        return (
            f"the runs part at iteration {div['iteration']}, before any fault struck: the "
            "script does not repeat itself fault-free (see: " + HINT_RERUN + ")"
        )
    return HINT_DATA if div["tensor"] == "loss" else HINT_STATE


def certify(cfg: CertifyConfig, work: Path) -> dict:
    """The reference run, then the faulted run(s), in ``work``; the verdict as a dict
    (``verdict``: EXACT, NOT EXACT or INCOMPLETE; ``exact``; per-fault rows; the first
    divergence and its hint)."""
    check(cfg)
    t0 = time.monotonic()
    base = cfg.inject_config()
    # With --cwd the script starts where its relative paths point: nothing to rewrite.
    args, rewritten = (
        (cfg.script_args, []) if cfg.cwd else resolve_args(cfg.script_args, Path.cwd())
    )
    base = replace(
        base,
        script=str(Path(cfg.script).resolve()),
        script_args=args,
        cwd=str(Path(cfg.cwd).resolve()) if cfg.cwd else "",
    )
    for r in rewritten:
        log.info("argument made absolute (each run starts in its own folder): %s", r)

    def left() -> float | None:
        return None if cfg.budget_s is None else cfg.budget_s - (time.monotonic() - t0)

    if left() is not None:
        base = replace(base, timeout_s=max(1.0, left()))
    try:
        ref = reference_run(base, work)
    except AssertionError as e:  # run_job: the fault-free run failed
        return _result(cfg, t0, "NOT EXACT", iterations=0, rows=[], reference_error=str(e))
    first_it, iterations = _iterations_of(ref)
    log.info("the script ran %d iteration(s) on %d rank(s)", iterations, cfg.nproc_per_node)
    if iterations < 1:
        return _result(
            cfg, t0, "NOT EXACT", iterations=0, rows=[], reference_error=(
                "the reference run recorded no iteration: does the script loop over "
                "run.iterations()?"
            ),
        )  # fmt: skip
    base = replace(base, iterations=iterations)
    faults = placement(cfg.phases, iterations, cfg.nproc_per_node, base.tier1_pages, first_it)
    todo = list(zip(cfg.phases, faults, strict=True))
    groups = [[x] for x in todo] if cfg.separately else [todo]
    rows: list[dict] = []
    truncated: list[str] = []  # files the script emptied when it ran again
    not_run: list[str] = []
    runs = 0
    while groups:
        group = groups.pop(0)
        budget = left()
        if budget is not None and budget < 1.5 * ref["run_s"]:
            not_run += [p for p, _ in group] + [p for g in groups for p, _ in g]
            log.info("time budget left %.0f s: %s not run", budget, ", ".join(not_run))
            break
        if budget is not None:
            base = replace(base, timeout_s=budget)
        runs += 1
        label = f"faulted-{runs}-" + (group[0][0] if cfg.separately else "all")
        got = faulted_run(base, [f for _, f in group], ref, work, label)
        truncated += got.get("files_truncated", [])
        unfired = {f["at"] for f in got["unfired"]}
        first_unfired = next((i for i, (_, f) in enumerate(group) if f.at in unfired), None)
        struck = group if first_unfired is None else group[:first_unfired]
        rows += _rows(struck, got)
        if first_unfired is not None:
            phase, f = group[first_unfired]
            rows.append(_row(phase, f, unreached=True))
            # The faults after an unreached one belong to generations that never came:
            # they get a run of their own.
            if first_unfired + 1 < len(group):
                groups.insert(0, group[first_unfired + 1 :])
    judged = [r for r in rows if r["struck"]]
    exact = bool(judged) and all(r["exact"] for r in judged)
    if judged and not exact:
        verdict = "NOT EXACT"
    elif not_run or any(r["unreached"] for r in rows) or not judged:
        verdict = "INCOMPLETE"
    else:
        verdict = "EXACT"
    return _result(
        cfg, t0, verdict, iterations, rows, not_run=not_run, ref=ref, truncated=truncated
    )


def _row(phase: str, f: JobFault, unreached: bool = False) -> dict:
    return {
        "phase": phase,
        "point": f.at,
        "rank": f.rank,
        "iteration": f.iteration,
        "pages_lost_per_group": f.lose_pages,
        "host_parity_pages": f.host_parity_pages,
        "struck": not unreached,
        "unreached": unreached,
        "exact": None,
        "diverged_after": False,
        "after_divergence": False,
        "first_divergence": None,
        "hint": None,
    }


def _rows(struck: list[tuple[str, JobFault]], got: dict) -> list[dict]:
    """The rows of the faults that struck in one faulted run. A divergence is told to
    the last of them at or before its iteration (``diverged_after``); its hint is judged
    against the run's first fault."""
    rows = [_row(phase, f) for phase, f in struck]
    # One recovery a fault, in order (fault k in generation k): each row its own figures.
    timed = got.get("recoveries_timed") or []
    if len(timed) != len(rows):
        timed = [{} for _ in rows]
    div = (got["verdict"] or {}).get("first_divergence")
    first_it = min(f.iteration for _, f in struck) if struck else 0
    why = hint(got["verdict"], first_it) if got["verdict"] else got["fatal_detail"]
    after = [r for r in rows if div is not None and r["iteration"] <= div["iteration"]]
    blamed = after[-1] if after else (rows[0] if rows and not got["exact"] else None)
    for r, tm in zip(rows, timed, strict=True):
        r.update(
            exact=got["exact"],
            # I + R (the paper's measure), its parts, and the older "to leto.Run" figure
            recovery_s=tm.get("regained_s", tm.get("recovery_s")),
            init_s=tm.get("init_s"),
            recompute_s=tm.get("recompute_s"),
            resumed_s=tm.get("recovery_s"),
            first_divergence=got["first_divergence"],
            fatal_detail=got["fatal_detail"],
            run=str(Path(got["workdir"])),
            faulted_run_s=got["faulted_run_s"],
        )
        if r is blamed:
            r.update(diverged_after=True, hint=why)
        elif blamed is not None and r["iteration"] > blamed["iteration"]:
            r.update(after_divergence=True)  # its run had parted already: not judged alone
    return rows


def _result(
    cfg, t0, verdict, iterations, rows, not_run=(), ref=None, reference_error=None, truncated=()
):
    bad = next((r for r in rows if r["diverged_after"]), None)
    return {
        # Files the script emptied when it ran again after a recovery (noticed by the
        # promoted trainers, not judged: the training's state is what EXACT is about).
        "files_truncated": list(dict.fromkeys(truncated)),
        "verdict": verdict,
        "exact": verdict == "EXACT",
        "script": cfg.script,
        "script_args": list(cfg.script_args),
        "nproc_per_node": cfg.nproc_per_node,
        "device": cfg.device,
        "iterations": iterations,
        "faults": rows,
        "not_run": list(not_run),
        "unreached": [r["phase"] for r in rows if r["unreached"]],
        "first_divergence": (bad or {}).get("first_divergence"),
        "hint": (bad or {}).get("hint"),
        "reference_error": reference_error,
        "reference_run_s": ref["run_s"] if ref else None,
        "total_s": time.monotonic() - t0,
    }
