"""Stop-gap launcher of the example job for faultkit and the tests, until ``leto run``.

Starts one state manager per rank and one trainer process per rank
(``python -m leto.workload.train``). A fault (``JobFault``) names a rank, a point
``"point@iteration#n"`` and a mode (kill, or copy-corrupt: garble the copy in progress,
then die): that rank is started with LETO_FAULT_AT/LETO_FAULT_MODE and SIGKILLs itself
there; the harness then kills every other rank wherever it is (the job-wide failure),
optionally loses pages while no trainer runs, and starts every rank again cold — once
per fault, in order. Returns each rank's loss log and final retained state; the
verifiers traces in ``out`` are what ``first_difference`` compares.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from faultkit.hooks import ENV_FAULT_AT, ENV_FAULT_MODE
from leto.memory.client import PoolClient
from leto.memory.config import ENV_POOL_TOKEN, PoolConfig
from leto.memory.launch import start_state_manager
from leto.workload.train import TrainConfig
from verifiers import EVENT_INJECTION, Recorder, compare


@dataclass(frozen=True)
class JobFault:
    rank: int
    at: str  # NAME@ITERATION#N (faultkit.hooks)
    mode: str = "kill"  # or "copy-corrupt"
    lose: Callable | None = None  # (rank, faultkit PoolClient) -> None, while no rank runs


POOL = PoolConfig(
    page_bytes=16384, data_pages=16, tier1_pages=4, tier2_pages=1, allow_fault_injection=True
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(world, cfg, pools, out, fault=None):
    pg = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for r in range(world):
        env = dict(os.environ, **{ENV_POOL_TOKEN: pools[r].token})
        env.pop(ENV_FAULT_AT, None)
        env.pop(ENV_FAULT_MODE, None)
        if fault is not None and fault.rank == r:
            env[ENV_FAULT_AT] = fault.at
            env[ENV_FAULT_MODE] = fault.mode
        cmd = [
            sys.executable,
            "-m",
            "leto.workload.train",
            "--rank",
            str(r),
            "--world-size",
            str(world),
            "--pg",
            pg,
            "--pool-socket",
            str(pools[r].socket_path),
            "--out",
            str(out),
            "--config",
            json.dumps(asdict(cfg)),
        ]
        # Each rank's stderr goes to its log (a killed peer's gloo errors are noise on
        # the console); failures quote its tail.
        with open(out / f"rank{r}.stderr.log", "ab") as log:
            procs.append(subprocess.Popen(cmd, env=env, stderr=log))
    return procs


def _wait(procs, timeout_s: float, stop_all_on_kill: bool) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if stop_all_on_kill and any(c == -signal.SIGKILL for c in codes):
            for p in procs:  # the job-wide failure: every rank stops wherever it is
                if p.poll() is None:
                    p.kill()
            return [p.wait(30) for p in procs]
        if all(c is not None for c in codes):
            return codes
        time.sleep(0.02)
    for p in procs:
        p.kill()
        p.wait(30)
    raise TimeoutError(f"ranks did not finish within {timeout_s} s")


def run_job(
    world: int,
    cfg: TrainConfig,
    out: Path,
    fault=None,
    lose=None,
    timeout_s: float = 300,
    pool=POOL,
    allow_failure: bool = False,
    faults: list[JobFault] | None = None,
) -> dict:
    """``pool`` is a PoolConfig for every rank, or a function rank -> PoolConfig.
    ``fault=(rank, spec)`` with ``lose`` is one kill; ``faults`` is a list of them, in
    iteration order (the run stops at a fault a rank did not survive: a fatal failure)."""
    out.mkdir(parents=True, exist_ok=True)
    if fault is not None:
        faults = [JobFault(fault[0], fault[1], lose=lose)]
    faults = list(faults or [])
    pools = [start_state_manager(pool(r) if callable(pool) else pool) for r in range(world)]
    try:
        injected = []
        codes = None
        for fl in faults:
            codes = _wait(_start(world, cfg, pools, out, fl), timeout_s, stop_all_on_kill=True)
            if codes[fl.rank] != -signal.SIGKILL:
                if injected and any(c not in (0, -signal.SIGKILL) for c in codes):
                    break  # the previous fault was fatal: ranks exited with an error
                raise RuntimeError(
                    f"rank {fl.rank} was not killed at {fl.at} (exit {codes[fl.rank]}): the point "
                    "was never reached that often in that iteration; nothing was injected"
                )
            iteration = int(fl.at.split("@")[1].split("#")[0])
            with Recorder(out, fl.rank) as rec:
                rec.mark(EVENT_INJECTION, iteration, point=fl.at, mode=fl.mode)
            injected.append(fl)
            if fl.lose is not None:
                for r in range(world):
                    with PoolClient.connect(
                        pools[r].socket_path, pools[r].token, role="faultkit"
                    ) as f:
                        fl.lose(r, f)
        else:
            codes = _wait(_start(world, cfg, pools, out), timeout_s, stop_all_on_kill=False)
        restarted = bool(injected)
        result = {
            "out": str(out),
            "injections": len(injected),
            "restarted": restarted,
            "codes": codes,
            "losses": [],
            "states": [],
            "recovery": [],
            "pool_status": [],
        }
        for r in range(world):
            with PoolClient.connect(pools[r].socket_path, pools[r].token, role="observer") as c:
                result["pool_status"].append(c.status())
            rec = out / f"rank{r}.recovery.json"
            result["recovery"].append(json.loads(rec.read_text()) if rec.exists() else None)
        if codes != [0] * world:
            if allow_failure:
                return result
            tails = "".join(
                f"\n--- rank {r} ({out / f'rank{r}.stderr.log'}), last lines:\n"
                + "\n".join((out / f"rank{r}.stderr.log").read_text().splitlines()[-15:])
                for r, c in enumerate(codes)
                if c != 0
            )
            raise AssertionError(f"ranks exited with {codes}{tails}")
        for r in range(world):
            seen: dict[int, str] = {}
            for line in (out / f"rank{r}.losses.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if rec["iteration"] in seen:
                    assert seen[rec["iteration"]] == rec["loss"], (
                        f"rank {r} logged iteration {rec['iteration']} twice, differently"
                    )
                seen[rec["iteration"]] = rec["loss"]
            result["losses"].append(seen)
            result["states"].append(torch.load(out / f"rank{r}.state.pt"))
        return result
    finally:
        for p in pools:
            p.stop()


def first_difference(a: dict, b: dict) -> str | None:
    """The verifiers' verdict on two runs' traces: None when bit-exact, else the first
    rank, iteration, tensor and (with saved tensors) byte offset that differ."""
    return compare(Path(a["out"]), Path(b["out"])).describe()
