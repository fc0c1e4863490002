"""The example job under ``leto run``, with a fault plan: how faultkit and the tests run
faulted and fault-free jobs.

Runs in the caller (faultkit, a test, a benchmark) and starts one ``leto run`` process
(its agent starts the state managers, trainers and shadows) on
``examples/train_gpt.py``. Faults go in as ``leto run``'s fault plan
(``LETO_FAULT_PLAN``): fault k strikes in generation k (the k-th failure), at a named
point of an iteration (``faultkit.hooks``), in a mode (kill, copy-corrupt,
kernel-abort, hang); its page losses happen while every trainer is fenced, before the
shadows are promoted. Recovery is the runtime's: fencing, promotion (or a cold start
with shadows ``off``), localization, reconstruction, the job-wide resume rule, and the
checkpoint fallback after a fatal failure. The verifiers traces in ``out/train`` are
what ``first_difference`` compares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leto.job.config import DEFAULT_SHADOW_LEVEL, ENV_TRAIN_DIR
from leto.job.store import free_port
from leto.memory.config import PoolConfig
from leto.plugins import ENV_PLUGINS
from leto.workload.train import TrainConfig
from nvbit_tools.tripwire import ENV_LOG
from verifiers import EVENT_INJECTION, EVENT_RECOVERED, Recorder, compare
from verifiers.recorder import ENV_SAVE_STATE

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_gpt.py"
PRESSURE_SCRIPT = Path(__file__).resolve().parent / "pressure_job.py"


@dataclass(frozen=True)
class Pressure:
    """Device-memory growth past what is free at iteration ``at`` (the preinitialization
    demo: ``faultkit/pressure_job.py`` runs the example under it)."""

    at: int
    beyond_free_mib: float = 512.0
    chunk_mib: float = 256.0

    def args(self) -> list[str]:
        return [
            "--demand-at", str(self.at), "--demand-beyond-free-mib", str(self.beyond_free_mib),
            "--demand-chunk-mib", str(self.chunk_mib),
        ]  # fmt: skip


@dataclass(frozen=True)
class JobFault:
    rank: int
    at: str  # NAME@ITERATION#N (faultkit.hooks)
    mode: str = "kill"  # copy-corrupt, kernel-abort, hang
    lose_pages: int = 0  # data pages lost in each protection group of every rank
    host_parity_pages: int = 0  # tier-1 host pages of the first group
    inject: tuple = field(default=())  # explicit ((kind, name, (pages...)), ...) losses
    # Another rank failing in the same failure as the fault before it (several ranks at
    # once): the same generation; the losses are the first fault's, taken once.
    with_previous: bool = False
    # "parked": at the point the trainer first waits until the next generation's shadows
    # have all parked (leto's fault plan key ``when``): the failure meets what it meets in
    # a job that has run a while, not a shadow still starting after the last recovery.
    when: str = "now"

    @property
    def iteration(self) -> int:
        return int(self.at.split("@")[1].split("#")[0])

    def plan_entry(self, generation: int) -> dict:
        return {
            "generation": generation,
            "rank": self.rank,
            "at": self.at,
            "mode": self.mode,
            "lose_pages": self.lose_pages,
            "host_parity_pages": self.host_parity_pages,
            "inject": [[k, n, list(p)] for k, n, p in self.inject],
            "when": self.when,
        }


POOL = PoolConfig(
    page_bytes=16384, data_pages=16, tier1_pages=4, tier2_pages=1, allow_fault_injection=True
)


def _pool_flags(pool: PoolConfig) -> list[str]:
    flags = [
        "--data-pages", str(pool.data_pages), "--tier1-pages", str(pool.tier1_pages),
    ]  # fmt: skip
    if pool.page_bytes:
        flags += ["--page-bytes", str(pool.page_bytes)]
    if pool.allow_fault_injection:
        flags.append("--allow-fault-injection")
    return flags


def plan_of(faults, pool: PoolConfig) -> list[dict]:
    """``leto run``'s fault plan for faults striking in order, one per generation (a
    fault ``with_previous`` in its predecessor's: another rank of the same failure); a
    fault that loses more pages than parity covers is fatal and takes two (the promoted
    trainers exit fatal, then the checkpoint fallback starts the next)."""
    plan, gen, step = [], 0, 0
    for f in faults:
        if f.with_previous and plan:
            plan.append(f.plan_entry(gen - step))
            continue
        plan.append(f.plan_entry(gen))
        step = 2 if f.lose_pages > pool.tier1_pages else 1
        gen += step
    return plan


def start_job(
    world: int,
    cfg: TrainConfig,
    out: Path,
    plan: list[dict] = (),
    pool: PoolConfig = POOL,
    device: str = "cpu",
    shadow_level: str = DEFAULT_SHADOW_LEVEL,
    extra: tuple[str, ...] = (),
    env: dict | None = None,
    nnodes: int = 1,
    agent_timeout_s: float = 120,
    script: Path = SCRIPT,
    script_args: list[str] | None = None,
    pressure: Pressure | None = None,
    save_state: bool = False,
    cwd: Path | None = None,
    verify: bool = True,
) -> list[subprocess.Popen]:
    """Start the job on ``world`` ranks over ``nnodes`` agents (nodes over loopback),
    without waiting (the example job with ``cfg``'s flags, or ``script`` with
    ``script_args``): one ``leto run`` process per node, node n in ``out/node{n}`` (its
    logs, the checkpoints) — node 0's are ``out/logs``. Training output goes to
    ``out/train``, with the verifiers' trace (``--verify``; with ``save_state`` also
    each rank's final state); ``pressure`` runs the example under memory pressure
    (``pressure_job.py``); ``cwd``: where node 0's script starts (default ``out``; its
    logs stay in ``out/logs``). ``finish_job`` waits. Every test, faultkit and the benchmarks
    start jobs here (or through ``run_job``)."""
    out = Path(out)
    script_cwd = cwd
    if world % nnodes:
        raise ValueError(f"{world} ranks do not split evenly over {nnodes} nodes")
    port = free_port()
    env = dict(os.environ, **(env or {}), LETO_FAULT_PLAN=json.dumps(list(plan)))
    # faultkit plugs into leto's fault points in every process of the job (leto never
    # imports faultkit: it loads what LETO_PLUGINS names).
    names = [n for n in env.get(ENV_PLUGINS, "").split(",") if n]
    env[ENV_PLUGINS] = ",".join(dict.fromkeys([*names, "faultkit.hooks"]))
    env[ENV_LOG] = str(out / "aborts.jsonl")
    env[ENV_TRAIN_DIR] = str(out / "train")  # a leto.Run's loss log and trace
    if save_state:
        env[ENV_SAVE_STATE] = "1"
    if pressure is not None:
        if script != SCRIPT or script_args is not None:
            raise ValueError("pressure runs the example job: give no script or script_args")
        script, script_args = PRESSURE_SCRIPT, pressure.args()
    if script_args is None or pressure is not None:
        script_args = [*(script_args or []), *cfg.flags(), "--out", str(out / "train")]
    procs = []
    for node in range(nnodes):
        cwd = out if node == 0 else out / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "leto.cli", "run", "--json", "--device", device,
            "--nnodes", str(nnodes), "--node-rank", str(node),
            "--nproc-per-node", str(world // nnodes), "--master-port", str(port),
            "--shadow-level", shadow_level, "--log-dir", str(cwd / "logs"),
            "--timeout-s", str(agent_timeout_s), *(["--verify"] if verify else []),
            *_pool_flags(pool), *extra,
            str(script), *script_args,
        ]  # fmt: skip
        log = open(cwd / "leto-run.log", "w")  # noqa: SIM115 - closed by finish_job
        start = script_cwd if node == 0 and script_cwd is not None else cwd
        p = subprocess.Popen(cmd, env=env, cwd=start, stdout=subprocess.PIPE, stderr=log, text=True)
        p.log = log  # type: ignore[attr-defined]
        procs.append(p)
    return procs


def shadow_pids(root: Path, generation: int) -> list[int]:
    """The shadows of ``generation`` of the job started in ``root`` (by the environment
    leto run gives them and their working directory, so another job on the same machine
    never matches)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if (
            b"LETO_ROLE=shadow" in env
            and f"LETO_GENERATION={generation}".encode() in env
            and cwd.startswith(str(root))
        ):
            found.append(int(d.name))
    return found


def finish_job(
    procs: list[subprocess.Popen],
    timeout_s: float = 600,
    watch: Callable[[str], None] | None = None,
) -> list[tuple[int, dict]]:
    """Wait for a job's agents; (exit code, leto run's JSON summary) per node. ``watch``
    gets each line node 0's agent logs, as it logs it (faultkit's progress). Interrupted
    (a timeout, SIGTERM, Ctrl-C), every agent still running gets SIGTERM and a while to
    stop its trainers, shadows and state managers: a SIGKILLed agent would leave them
    running, and its state managers' directories in /tmp."""
    done = []
    stop = threading.Event()
    tail = None
    if watch is not None:
        tail = threading.Thread(
            target=_tail, args=(Path(procs[0].log.name), watch, stop), daemon=True
        )
        tail.start()
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout_s)
            lines = stdout.strip().splitlines()
            done.append((p.returncode, json.loads(lines[-1]) if lines else {}))
    finally:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.terminate()
        for p in running:
            try:  # reading its stdout: a summary larger than the pipe would block it
                p.communicate(timeout=STOP_TIMEOUT_S)
            except (subprocess.TimeoutExpired, ValueError):  # ValueError: stdout closed
                p.kill()
                p.wait()
        for p in procs:
            p.log.close()
        stop.set()
        if tail is not None:
            tail.join(timeout=5)
    return done


# How long an interrupted job's agent gets to stop everything it started (its own
# waits for a state manager's shutdown are 10 s).
STOP_TIMEOUT_S = 30.0


def _tail(path: Path, watch: Callable[[str], None], stop: threading.Event) -> None:
    """Hand each complete line appended to ``path`` to ``watch`` until ``stop``, then
    the rest."""
    buf = ""
    with open(path, errors="replace") as f:
        while True:
            chunk = f.read()
            if chunk:
                buf += chunk
                *lines, buf = buf.split("\n")
                for line in lines:
                    watch(line)
            elif stop.is_set():
                break
            else:
                stop.wait(0.2)
    if buf:
        watch(buf)


PORT_ATTEMPTS = 3


def _port_taken(out: Path) -> bool:
    try:
        text = (out / "leto-run.log").read_text()
    except OSError:
        return False
    return "is in use" in text and "nothing started" in text


def run_job(
    world: int,
    cfg: TrainConfig,
    out: Path,
    faults: list[JobFault] | tuple = (),
    pool: PoolConfig = POOL,
    device: str = "cpu",
    shadow_level: str = DEFAULT_SHADOW_LEVEL,
    allow_failure: bool = False,
    timeout_s: float = 600,
    extra: tuple[str, ...] = (),
    env: dict | None = None,
    plan: list[dict] | None = None,
    nnodes: int = 1,
    script: Path = SCRIPT,
    script_args: list[str] | None = None,
    pressure: Pressure | None = None,
    save_state: bool = False,
    watch: Callable[[str], None] | None = None,
    cwd: Path | None = None,
    verify: bool = True,
) -> dict:
    """Run the job on ``world`` ranks; returns leto run's summary (node 0's; every
    node's under ``"nodes"``) plus each rank's losses (and final state with
    ``save_state``). Raises on a non-zero exit unless ``allow_failure``. ``faults``
    become the plan (``plan_of``); ``plan`` gives one directly. ``verify=False``: no
    ``--verify`` (leto run's defaults: a benchmark of what users run; no trace to
    compare)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if plan is None:
        plan = plan_of(faults, pool)
    for attempt in range(PORT_ATTEMPTS):
        procs = start_job(
            world, cfg, out, plan, pool, device, shadow_level, extra, env, nnodes,
            script=script, script_args=script_args, pressure=pressure, save_state=save_state,
            cwd=cwd, verify=verify,
        )  # fmt: skip
        nodes = finish_job(procs, timeout_s, watch)
        code = next((c for c, _ in nodes if c != 0), 0)
        # The free port it picked was taken before leto run bound it (a job beside this
        # one, or an outgoing connection's ephemeral port): nothing started; another.
        if code != 2 or attempt == PORT_ATTEMPTS - 1 or not _port_taken(out):
            break
    summary = nodes[0][1]
    p = subprocess.CompletedProcess([], code)
    if p.returncode != 0 and not allow_failure:
        tail = "\n".join((out / "leto-run.log").read_text().splitlines()[-20:])
        raise AssertionError(
            f"leto run exited {p.returncode} (logs in {out / 'logs'}); last lines:\n{tail}"
        )
    aborts = out / "aborts.jsonl"
    # The log holds the trip-wire's kernel aborts and faultkit's silent bit flips.
    logged = [json.loads(x) for x in aborts.read_text().splitlines()] if aborts.exists() else []
    result = {
        **summary,
        "nodes": [n for _, n in nodes],
        "out": str(out / "train"),
        "code": p.returncode,
        "injections": len(summary.get("recoveries", [])),
        "aborts": [x for x in logged if "corrupt" not in x],
        "corruptions": [x for x in logged if "corrupt" in x],
        "losses": [],
        "states": [],
    }
    _mark(out / "train", faults, summary.get("recoveries", []))
    if p.returncode != 0:
        return result
    # A checkpoint fallback after silent corruption redoes iterations trained on the
    # corrupted state: their losses are logged again, differently (the latest counts).
    rolled_back = any(r["class"] == "FF" for r in summary.get("recoveries", []))
    for r in range(world):
        seen: dict[int, str] = {}
        for line in (out / "train" / f"rank{r}.losses.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["iteration"] in seen and not rolled_back:
                assert seen[rec["iteration"]] == rec["loss"], (
                    f"rank {r} logged iteration {rec['iteration']} twice, differently"
                )
            seen[rec["iteration"]] = rec["loss"]
        result["losses"].append(seen)
        if save_state:
            result["states"].append(torch.load(out / "train" / f"rank{r}.state.pt"))
    return result


def _mark(train_out: Path, faults, records: list[dict]) -> None:
    """The verifiers marks of each failure (for ``verifiers report``), at the agent's
    times: the injection when the agent detected it, on the failed rank; the recovery
    when every rank trained again, on each rank. A fatal failure's in-place attempt
    and its checkpoint fallback are one record each."""
    if not train_out.is_dir():
        return
    todo = list(faults)
    for rec in records:
        t0 = rec["detected_at"]
        if rec["class"] == "HOF" and todo:
            struck = [todo.pop(0)]
            while todo and todo[0].with_previous:  # the other ranks of the same failure
                struck.append(todo.pop(0))
            for f in struck:
                with Recorder(train_out, f.rank, clock=lambda t=t0: t) as victim:
                    victim.mark(EVENT_INJECTION, f.iteration, point=f.at, mode=f.mode)
        for r, tr in rec.get("trainers", {}).items():
            with Recorder(train_out, int(r), clock=lambda t=tr["time"]: t) as mark:
                mark.mark(EVENT_RECOVERED, tr["next_iteration"], since=t0, failure=rec["class"])


def first_difference(a: dict, b: dict) -> str | None:
    """The verifiers' verdict on two runs' traces: None when bit-exact, else the first
    rank, iteration, tensor and (with saved tensors) byte offset that differ."""
    return compare(Path(a["out"]), Path(b["out"])).describe()
