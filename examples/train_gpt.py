"""Train the example GPT under ``leto run``: the user-facing shape of a Leto job.

    leto run --nproc-per-node 2 --shadow-level L2 examples/train_gpt.py --iterations 20

``leto.init()`` returns the rank's context (a shadow parks inside it until promoted);
the model is built on the meta device and retained in one call; the loop resumes at
the right iteration after a promotion. The model definition (``leto.workload.gpt``) is
ordinary PyTorch, unmodified.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import leto
from faultkit.hooks import point
from leto.errors import FatalFailure
from leto.runtime.agent import EXIT_FATAL
from leto.runtime.retained import RetainedTraining
from leto.update.rmu import UpdaterConfig
from leto.update.schedule import WarmupCosine
from leto.workload.corpus import batch
from leto.workload.gpt import GPT, GPTConfig, init_weights


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20, help="training iterations")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--seed", type=int, default=0, help="seed of data, dropout and weights")
    ap.add_argument("--out", default="leto-run/train", help="loss logs and verifiers traces")
    ap.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    ap.add_argument("--n-embd", type=int, default=64, help="model width")
    ap.add_argument("--n-head", type=int, default=2, help="attention heads")
    ap.add_argument("--chunk-units", type=int, default=2, help="updater chunk size (units)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    gcfg = GPTConfig(
        block=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.1,
    )

    def prepare():  # runs while a shadow is parked (L2 and up): no pool access here
        with torch.device("meta"):
            return GPT(gcfg)

    ctx = leto.init(prepare=prepare)
    model = ctx.prepared if ctx.prepared is not None else prepare()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        t_resume = time.time()
        job = RetainedTraining(
            ctx.pool,
            model,
            lambda: init_weights(model, args.seed),
            WarmupCosine(peak_lr=1e-3, total_iters=args.iterations),
            ctx.rank,
            ctx.world_size,
            out,
            UpdaterConfig(chunk_units=args.chunk_units),
            heartbeat=ctx.heartbeat,
        )
        t = job.resume(ctx.report, checkpoints=ctx.checkpoint_dir)
        ctx.resumed(t, resume_s=time.time() - t_resume)
        ckpt = ctx.checkpointer()  # insurance against fatal failures only
        while t < args.iterations:
            job.begin(t)
            torch.manual_seed(((args.seed * 7_919) + t) * 104_729 + ctx.rank)  # dropout
            x, y = (
                v.to(ctx.device)
                for v in batch(args.seed, t, ctx.rank, args.batch_size, args.seq_len)
            )
            point("compute.forward", t)
            with job.compute():
                loss = model(x, y)
                point("compute.backward", t)
                loss.backward()
            job.step(t, loss)
            if ckpt is not None:
                ckpt.after_iteration(t, job)
            t += 1
        ctx.heartbeat("done")
        if ckpt is not None:
            ckpt.close()
        dist.barrier()
    except FatalFailure as e:
        print(f"rank {ctx.rank}: fatal failure: {e}", file=sys.stderr)
        return EXIT_FATAL
    finally:
        ctx.pool.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
