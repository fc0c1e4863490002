"""Train the example GPT under ``leto run``: the user-facing shape of a Leto job.

    leto run --nproc-per-node 2 --shadow-level L2 examples/train_gpt.py --iterations 20

``leto.init()`` returns the rank's context (a shadow parks inside it until promoted);
the model is built on the meta device and retained in one call; the loop resumes at
the right iteration after a promotion. The model definition (``leto.workload.gpt``) is
ordinary PyTorch, unmodified. Flags: ``leto.workload.train.TrainConfig`` (faultkit, the
benchmarks and the tests run this script with them) plus ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import leto
from leto.errors import FatalFailure
from leto.plugins import point
from leto.proc import alive
from leto.runtime.agent import EXIT_FATAL
from leto.runtime.retained import RetainedTraining
from leto.update.optim import AdamWConfig
from leto.update.rmu import UpdaterConfig
from leto.update.schedule import WarmupCosine
from leto.workload.corpus import batch
from leto.workload.gpt import GPT, init_weights
from leto.workload.train import add_arguments, from_args
from verifiers import Recorder


def grow_demand(ctx, cfg) -> list[torch.Tensor]:
    """Memory pressure for the preinitialization demo: grow this rank's device memory
    past what is free while its shadow is parked, in chunks (each a cache miss the
    allocation hook sees). Without the controller this OOMs; with it the shadow is
    reclaimed first. Outside ``job.compute()``: the updater's lent buffers stay out."""
    parked = ctx.wait_shadow_parked(timeout_s=120)
    free = ctx.device_free_bytes()
    target = free + int(cfg.demand_beyond_free_mib * 2**20)
    chunk = max(1, int(cfg.demand_chunk_mib * 2**20))
    print(
        f"rank {ctx.rank}: demand {target / 2**30:.2f} GiB with {free / 2**30:.2f} GiB free "
        f"(shadow parked: {parked})",
        flush=True,
    )
    held, total = [], 0
    while total < target:
        n = min(chunk, target - total)
        held.append(torch.empty(n, dtype=torch.uint8, device=ctx.device).fill_(1))
        total += n
    # The beat reports a reclamation (on the emulated CPU device it is also where the
    # allocation path runs); the report is what makes the agent relaunch the shadow.
    ctx.heartbeat(cfg.demand_at)
    if parked is not None and not alive(parked["pid"]):
        # Reclaimed. The demo goes on once the relaunched (lower-level) shadow has parked,
        # so a later fault meets a parked shadow, not one still starting: that would time
        # the shadow's start-up, not its recovery. Bounded below the hang timeout.
        again = ctx.wait_shadow_parked(timeout_s=30, other_than=parked["pid"])
        print(f"rank {ctx.rank}: shadow relaunched and parked: {again}", flush=True)
    return held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--out", default="leto-run/train", help="loss logs and verifiers traces")
    args = ap.parse_args()
    cfg = from_args(args)
    torch.set_num_threads(1)  # ranks share the machine's cores
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32

    def prepare():  # runs while a shadow is parked (L2 and up): no pool access here
        with torch.device("meta"):
            return GPT(cfg.gpt()).to(getattr(torch, cfg.dtype))

    ctx = leto.init(prepare=prepare)
    model = ctx.prepared if ctx.prepared is not None else prepare()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        t_resume = time.time()
        job = RetainedTraining(
            ctx.pool,
            model,
            lambda: init_weights(model, cfg.seed),
            WarmupCosine(peak_lr=cfg.peak_lr, total_iters=cfg.iterations),
            ctx.rank,
            ctx.world_size,
            out,
            UpdaterConfig(chunk_units=cfg.chunk_units, adamw=AdamWConfig(impl=cfg.optimizer)),
            zero1=cfg.zero1,
            on_iteration=Recorder(out, ctx.rank, keep_tensors=cfg.keep_tensors).record
            if cfg.record
            else None,
            heartbeat=ctx.heartbeat,
            bucket_mib=cfg.bucket_mib,
        )
        t = job.resume(ctx.report, checkpoints=ctx.checkpoint_dir)
        ctx.resumed(t, resume_s=time.time() - t_resume, **job.timings)
        ckpt = ctx.checkpointer()  # insurance against fatal failures only
        demand = None
        first = t
        while t < cfg.iterations:
            job.begin(t)
            if t == cfg.demand_at and demand is None:
                demand = grow_demand(ctx, cfg)
            k = cfg.micro_batches
            loss = torch.zeros((), device=ctx.device)
            with job.compute():
                for mb in range(k):  # gradients accumulate in the retained buffer
                    stream = ctx.rank * k + mb  # data and dropout per (rank, micro-batch)
                    torch.manual_seed(((cfg.seed * 7_919) + t) * 104_729 + stream)  # dropout
                    x, y = (
                        v.to(ctx.device)
                        for v in batch(cfg.seed, t, stream, cfg.batch_size, cfg.seq_len)
                    )
                    point("compute.forward", t)  # the n-th hit is micro-batch n - 1
                    with cfg.autocast_context(ctx.device):
                        mb_loss = model(x, y) / k
                    point("compute.backward", t)
                    # As with DDP: only the last micro-batch's backward reduces gradients.
                    with job.no_sync() if mb < k - 1 else contextlib.nullcontext():
                        mb_loss.backward()
                    loss += mb_loss.detach()
            if t == first:
                print(
                    f"rank {ctx.rank}: attention backend {model.attention_backend()}, "
                    f"autocast {cfg.autocast}, TF32 {cfg.tf32}, AdamW {cfg.optimizer}, "
                    f"{k} micro-batch(es) of {cfg.batch_size} x {cfg.seq_len} tokens",
                    flush=True,
                )
            job.step(t, loss)
            if ckpt is not None:
                ckpt.after_iteration(t, job)
            t += 1
        ctx.heartbeat("done")
        if ckpt is not None:
            ckpt.close()
        dist.barrier()
        if cfg.save_state:
            job.save_state()
    except FatalFailure as e:
        print(f"rank {ctx.rank}: fatal failure: {e}", file=sys.stderr)
        return EXIT_FATAL
    finally:
        ctx.pool.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
