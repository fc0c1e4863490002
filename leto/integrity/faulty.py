"""Faulty devices: a GPU that the checks named twice as computing wrong.

Runs in the agent. Gradient replay, the replica check (at world >= 3, by majority) and
the update recheck name the rank that computed wrong; the trainer's error file carries
the iteration and the ranks (``leto.errors.WrongComputation``). One naming is taken for
a transient fault and recovered like any failure. A device named in two detections
(different iterations, or the same iteration again after its redo) is reported as
faulty: logged when it happens, listed in the node's recovery record (``faulty``) and
appended to ``<log-dir>/faulty-devices.json``. With ``leto run --exclude-faulty`` it is
a hardware failure: the job stops (its verified checkpoints stay), and ``leto run
--exclude-faulty`` started again with the same log directory leaves that node's faulty
GPUs out of ``CUDA_VISIBLE_DEVICES`` and resumes from the newest checkpoint.

Not covered: a world-2 replica disagreement (no majority names a rank; the fallback's
redo does, in the trainers' logs, not counted here); moving a rank to a spare GPU
inside a running job (the restart does it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

from leto.errors import InvalidInput

FILE = "faulty-devices.json"


def device_of(device: str, local_rank: int, ranks_per_gpu: int = 1) -> str:
    """The physical device a local rank trains on: ``cuda:<index>`` as the node numbers
    it (through ``CUDA_VISIBLE_DEVICES`` when set), or ``cpu``. With ``--ranks-per-gpu
    N`` local ranks ``N*g .. N*g+N-1`` share GPU ``g`` (``leto.trainer.api.placement``)."""
    if device == "cpu":
        return "cpu"
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    i = local_rank // ranks_per_gpu
    return f"cuda:{visible[i] if i < len(visible) else i}"


class Tally:
    """Every detection that named a rank, by rank; the ranks of this node, by device."""

    def __init__(self, node: str, devices: dict[int, str]):
        self.node, self.devices = node, devices
        self.seen: dict[int, dict[tuple, dict]] = {}  # rank -> detection key -> what

    def observe(self, gen: int, errors: list[dict | None]) -> list[dict]:
        """The error files of generation ``gen``'s dead trainers (every rank raises the
        same detection: counted once); returns this node's devices named for the second
        time now, as records."""
        new = []
        for e in errors:
            if not e or not e.get("named"):
                continue
            key = (gen, e["exception"], e.get("iteration"))
            for r in e["named"]:
                found = self.seen.setdefault(r, {})
                if key in found:
                    continue
                found[key] = {"generation": gen, "check": e["exception"],
                              "iteration": e.get("iteration")}  # fmt: skip
                if len(found) == 2 and r in self.devices:
                    new.append(self.record(r))
        return new

    def record(self, rank: int) -> dict:
        return {
            "node": self.node,
            "rank": rank,
            "device": self.devices[rank],
            "detections": list(self.seen.get(rank, {}).values()),
        }

    def faulty(self) -> list[dict]:
        """This node's devices named twice or more so far."""
        return [self.record(r) for r, f in sorted(self.seen.items())
                if len(f) >= 2 and r in self.devices]  # fmt: skip


def append(log_dir: str | Path, records: list[dict]) -> Path:
    """Add ``records`` to ``<log_dir>/faulty-devices.json`` (whole, or not there)."""
    path = Path(log_dir) / FILE
    have = json.loads(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(have + records, indent=1))
    tmp.replace(path)
    return path


def excluded(log_dir: str | Path, node: str) -> set[str]:
    """The GPU indices of ``node`` that ``<log_dir>/faulty-devices.json`` lists."""
    path = Path(log_dir) / FILE
    if not path.exists():
        return set()
    try:
        records = json.loads(path.read_text())
        return {
            r["device"].split(":", 1)[1]
            for r in records
            if r["node"] == node and r["device"].startswith("cuda:")
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidInput(
            f"{path} is not a list of faulty-device records ({e}); nothing was excluded "
            f"and nothing started: fix or remove it"
        ) from None


def node_gpus() -> list[str]:
    """The node's GPUs as ``CUDA_VISIBLE_DEVICES`` names them: its entries when it is
    set, else every index ``nvidia-smi`` lists (the agent itself never touches CUDA:
    its trainers are forked from it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v for v in visible.split(",") if v]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise InvalidInput(
            "--exclude-faulty: CUDA_VISIBLE_DEVICES is not set and nvidia-smi is not "
            "found, so the node's GPUs cannot be listed; nothing started"
        )
    out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def gpus_needed(nproc: int, ranks_per_gpu: int = 1) -> int:
    """GPUs ``nproc`` ranks a node take, ``ranks_per_gpu`` of them sharing each."""
    return -(-nproc // ranks_per_gpu)


def visible_devices(gpus: list[str], bad: set[str], nproc: int, ranks_per_gpu: int = 1) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``nproc`` ranks on ``gpus`` without ``bad``
    (``ranks_per_gpu`` of them a GPU); ``InvalidInput`` when too few are left."""
    left = [g for g in gpus if g not in bad]
    need = gpus_needed(nproc, ranks_per_gpu)
    if len(left) < need:
        shared = f", {ranks_per_gpu} a GPU" if ranks_per_gpu > 1 else ""
        raise InvalidInput(
            f"--exclude-faulty: this node's GPUs {gpus} without the faulty {sorted(bad)} "
            f"leave {len(left)} for {nproc} rank(s) a node{shared}; nothing started (run "
            f"fewer ranks a node with --nproc-per-node, or on another node)"
        )
    return ",".join(left[:need])


def enough_gpus(gpus: list[str], nproc: int, ranks_per_gpu: int = 1) -> None:
    """``InvalidInput`` when ``nproc`` ranks a node do not fit on ``gpus`` (one a GPU,
    or ``ranks_per_gpu`` sharing each): a rank past the last GPU would otherwise share
    one with NCCL (which refuses it mid-start-up) or put its pool on a GPU that does
    not exist."""
    need = gpus_needed(nproc, ranks_per_gpu)
    if len(gpus) < need:
        shared = f", {ranks_per_gpu} a GPU" if ranks_per_gpu > 1 else ""
        raise InvalidInput(
            f"--nproc-per-node {nproc}{shared} needs {need} GPU(s), and this node has "
            f"{len(gpus)} ({','.join(gpus) or 'none'}, as CUDA_VISIBLE_DEVICES or nvidia-smi "
            f"lists them); nothing started (run fewer ranks a node, or, to test on fewer "
            f"GPUs, --ranks-per-gpu {gpus_needed(nproc, max(len(gpus), 1))})"
        )


def node_name() -> str:
    return socket.gethostname()
