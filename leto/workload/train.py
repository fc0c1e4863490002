"""The example job's per-rank training loop: deterministic data parallelism with the RMU.

Runs in a trainer process (one per rank), started by a launcher (``leto run`` once it
exists; until then the tests' harness) with the process group address and the rank's
pool socket. On start it re-attaches to its pool, localizes and rebuilds lost pages,
reads its marker, agrees with the other ranks on the job-wide rule (finish the
interrupted update, or redo the interrupted iteration), and trains on. Everything a
rank computes is a function of (seed, iteration, rank): data, dropout, and the
gradient all-reduce (gloo/NCCL with a fixed world size), with deterministic algorithms
on, so a recovered run equals a fault-free one bit for bit.

Outputs (``--out``): ``rank{r}.losses.jsonl`` (iteration, loss as float.hex, one line
per completed iteration, rewritten identically if an iteration completes twice) and,
at the end, ``rank{r}.state.pt`` (every retained tensor); with ``record`` the
verifiers trace ``rank{r}.trace.jsonl`` (loss and SHA-256 of every retained tensor per
iteration, see docs/verifiers.md).

    LETO_POOL_TOKEN=... python -m leto.workload.train --rank 0 --world-size 2 \
        --pg tcp://127.0.0.1:29500 --pool-socket /tmp/leto-pool-x/pool.sock --out out/

Not covered: sharded optimizer state, tensor/pipeline parallelism, shadows (cold start).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from faultkit.hooks import point
from leto.memory.client import PoolClient
from leto.memory.config import ENV_POOL_TOKEN
from leto.runtime.retained import RetainedTraining
from leto.update.rmu import UpdaterConfig
from leto.update.schedule import WarmupCosine
from leto.workload.corpus import batch
from leto.workload.gpt import GPT, GPTConfig, init_weights
from verifiers import EVENT_RECOVERED


@dataclass(frozen=True)
class TrainConfig:
    iterations: int = 6
    batch_size: int = 4  # per rank
    seq_len: int = 64
    seed: int = 0
    dtype: str = "float32"  # or "bfloat16" (fp32 master weights and moments)
    peak_lr: float = 1e-3
    chunk_units: int = 2
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    dropout: float = 0.1
    zero1: bool = False  # shard optimizer state (and the update) across ranks
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank by LOCAL_RANK)
    timeout_s: float = 120.0  # process group formation and every collective
    record: bool = True  # verifiers trace: loss + SHA-256 of retained tensors per iteration
    keep_tensors: bool = False  # also save them, so a divergence names its byte offset

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            block=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )


class RankTrainer:
    """The example job's model, data and forward/backward around ``RetainedTraining``."""

    def __init__(self, rank: int, world: int, cfg: TrainConfig, client: PoolClient, out: Path):
        self.rank, self.world, self.cfg, self.out = rank, world, cfg, out
        torch.use_deterministic_algorithms(True)
        with torch.device("meta"):
            model = GPT(cfg.gpt()).to(getattr(torch, cfg.dtype))
        self.model = model
        self.job = RetainedTraining(
            client,
            model,
            lambda: init_weights(model, cfg.seed),
            WarmupCosine(peak_lr=cfg.peak_lr, total_iters=cfg.iterations),
            rank,
            world,
            out,
            UpdaterConfig(chunk_units=cfg.chunk_units),
            zero1=cfg.zero1,
            record=cfg.record,
            keep_tensors=cfg.keep_tensors,
        )
        self.up = self.job.up
        self.rec = self.job.rec
        self.device = self.job.device

    def resume(self, report: dict) -> int:
        return self.job.resume(report)

    def iteration(self, t: int) -> None:
        cfg = self.cfg
        self.job.begin(t)
        torch.manual_seed(((cfg.seed * 7_919) + t) * 104_729 + self.rank)  # dropout
        x, y = batch(cfg.seed, t, self.rank, cfg.batch_size, cfg.seq_len)
        x, y = x.to(self.device), y.to(self.device)
        point("compute.forward", t)
        with self.job.compute():
            loss = self.model(x, y)
            point("compute.backward", t)
            loss.backward()
        self.job.step(t, loss)

    def save_state(self) -> None:
        self.job.save_state()


def seconds_since_process_start() -> float:
    """Wall time since the kernel started this process (so imports count, as they do
    in a cold restart), from /proc; 10 ms resolution."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def run(
    rank: int, world: int, cfg: TrainConfig, pg: str, pool_socket: str, token: str, out: Path
) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    backend = "gloo"
    if cfg.device == "cuda":
        # Deterministic cuBLAS needs its workspace fixed before the first handle.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        backend = "nccl"
    dist.init_process_group(
        backend,
        init_method=pg,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    client = PoolClient.connect(pool_socket, token, takeover=True, timeout_s=cfg.timeout_s)
    try:
        report = client.localize()
        trainer = RankTrainer(rank, world, cfg, client, out)
        resumed = trainer.up.marker.state is not None
        t = trainer.resume(report)
        if resumed:  # a restart: how long from process start to training again
            record = {
                "resume_s": seconds_since_process_start(),
                "next_iteration": t,
                "report": report,
            }
            (out / f"rank{rank}.recovery.json").write_text(json.dumps(record))
            if trainer.rec is not None:
                since = time.time() - record["resume_s"]
                trainer.rec.mark(EVENT_RECOVERED, t, since=since, resume_s=record["resume_s"])
        while t < cfg.iterations:
            trainer.iteration(t)
            t += 1
        dist.barrier()
        trainer.save_state()
    finally:
        client.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m leto.workload.train", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--rank", type=int, required=True, help="this process's rank")
    ap.add_argument("--world-size", type=int, required=True, help="number of ranks")
    ap.add_argument(
        "--pg", required=True, help="process group init method, e.g. tcp://127.0.0.1:29500"
    )
    ap.add_argument("--pool-socket", required=True, help="this rank's state-manager socket")
    ap.add_argument("--out", required=True, help="directory for loss logs and final state")
    ap.add_argument("--config", default="{}", help="TrainConfig fields as JSON")
    args = ap.parse_args(argv)
    token = os.environ.get(ENV_POOL_TOKEN)
    if not token:
        print(f"{ENV_POOL_TOKEN} is not set", file=sys.stderr)
        return 2
    cfg = TrainConfig(**json.loads(args.config))
    run(args.rank, args.world_size, cfg, args.pg, args.pool_socket, token, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
