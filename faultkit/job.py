"""Stop-gap launcher of the example job for faultkit and the tests, until ``leto run``.

Starts one state manager per rank and one trainer process per rank
(``python -m leto.workload.train``). A fault is ``(rank, "point@iteration#n")``: that
rank is started with LETO_FAULT_AT and SIGKILLs itself there; the harness then kills
every other rank wherever it is (the job-wide failure), optionally loses pages while
no trainer runs, and starts every rank again cold. Returns each rank's loss log and
final retained state for a byte-for-byte comparison.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from faultkit.hooks import ENV_FAULT_AT
from leto.memory.client import PoolClient
from leto.memory.config import ENV_POOL_TOKEN, PoolConfig
from leto.memory.launch import start_state_manager
from leto.workload.train import TrainConfig

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
        if fault is not None and fault[0] == r:
            env[ENV_FAULT_AT] = fault[1]
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
        procs.append(subprocess.Popen(cmd, env=env))
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
) -> dict:
    """``pool`` is a PoolConfig for every rank, or a function rank -> PoolConfig."""
    out.mkdir(parents=True, exist_ok=True)
    pools = [start_state_manager(pool(r) if callable(pool) else pool) for r in range(world)]
    try:
        codes = _wait(
            _start(world, cfg, pools, out, fault), timeout_s, stop_all_on_kill=fault is not None
        )
        restarted = False
        if fault is not None:
            victim = fault[0]
            if codes[victim] != -signal.SIGKILL:
                raise RuntimeError(
                    f"rank {victim} was not killed at {fault[1]} (exit {codes[victim]}): the point was "
                    "never reached that often in that iteration; nothing was injected"
                )
            if lose is not None:
                for r in range(world):
                    with PoolClient.connect(
                        pools[r].socket_path, pools[r].token, role="faultkit"
                    ) as f:
                        lose(r, f)
            codes = _wait(_start(world, cfg, pools, out), timeout_s, stop_all_on_kill=False)
            restarted = True
        result = {
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
            raise AssertionError(f"ranks exited with {codes}")
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
    """Name the first iteration, rank, tensor and byte offset where two runs differ."""
    for r, (la, lb) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        for it in sorted(set(la) | set(lb)):
            if la.get(it) != lb.get(it):
                return f"rank {r} loss at iteration {it}: {la.get(it)} vs {lb.get(it)}"
    for r, (sa, sb) in enumerate(zip(a["states"], b["states"], strict=True)):
        for k in sorted(sa):
            if sa[k].shape != sb[k].shape:
                return f"rank {r} tensor {k} has shape {tuple(sa[k].shape)} vs {tuple(sb[k].shape)}"
            d = (sa[k].view(torch.uint8) != sb[k].view(torch.uint8)).nonzero()
            if d.numel():
                return f"rank {r} tensor {k} differs first at byte {int(d[0])}"
    return None
