"""Train the example GPT under ``leto run``: a plain PyTorch script with ``leto.Run``.

    leto run --nproc-per-node 2 --shadow-level L2 examples/train_gpt.py --iterations 20

The script keeps its own model, ``torch.optim.AdamW`` (two parameter groups: no weight
decay for biases and LayerNorm weights), ``LambdaLR`` schedule, gradient accumulation,
clipping and autocast; Leto's part is ``leto.init()`` (a shadow parks inside it until
promoted, with the model already built on the meta device and its step's kernels warmed
on one block) and ``leto.Run`` (retains the model and the optimizer's state, resumes
where the job left off, makes ``optimizer.step()`` crash-consistent). Fault points,
heartbeats and verification are the runtime's. The model (``leto.workload.gpt``) is
ordinary PyTorch. Flags: ``leto.workload.train.TrainConfig`` plus ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import sys

import torch

import leto
from leto.workload.corpus import batch, corpus
from leto.workload.gpt import GPT, init_weights
from leto.workload.train import add_arguments, from_args


def lr_shape(t: int, total: int) -> float:
    """The LR factor of the paper's appendix A.1: linear warm-up over the first 10 % of
    the iterations, then cosine decay to a tenth of the peak at the end."""
    warm = max(1, int(total * 0.10))
    if t < warm:
        return (t + 1) / warm
    progress = min(1.0, (t - warm) / max(1, total - warm))
    return 0.1 + 0.5 * (1.0 - 0.1) * (1 + math.cos(math.pi * progress))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--out", default=None, help="loss log (and trace under --verify)")
    args = ap.parse_args()
    cfg = from_args(args)
    torch.set_num_threads(1)  # ranks share the machine's cores
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32

    def build():  # runs while a shadow is parked (L2 and up): no pool access here
        # Open the data here too: a promoted shadow's first iteration then does not
        # (30 of the ~70 ms a fresh process's first iteration added on the CPU).
        corpus()
        with torch.device("meta"):
            return GPT(cfg.gpt()).to(getattr(torch, cfg.dtype))

    def warmup(device):  # runs in a parked shadow (L2 and up): no pool access here
        # One block at the real widths, batch and sequence length: the same kernels as
        # the model's forward, backward and clipping, loaded before a promotion needs
        # them. Its memory is the shadow's own and freed before it parks.
        with torch.device(device):
            small = GPT(dataclasses.replace(cfg.gpt(), n_layer=1)).to(getattr(torch, cfg.dtype))
        x, y = (v.to(device) for v in batch(cfg.seed, 0, 0, cfg.batch_size, cfg.seq_len))
        with cfg.autocast_context(device):
            loss = small(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(small.parameters(), 1.0, foreach=cfg.optimizer != "single")

    ctx = leto.init(prepare=build, warmup=warmup)
    model = ctx.prepared if ctx.prepared is not None else build()
    named = list(model.named_parameters())
    muon = []
    if cfg.optimizer == "muon":  # the blocks' matrices by Muon, the rest by AdamW
        mats = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
        muon = [torch.optim.Muon(mats, lr=cfg.peak_lr * 20, weight_decay=0.1)]
        named = [(n, p) for n, p in named if not any(p is m for m in mats)]
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    impl = {"foreach": False} if cfg.optimizer == "single" else {"fused": True}
    adamw = torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8, **impl)
    optimizers = [*muon, adamw]
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(o, functools.partial(lr_shape, total=cfg.iterations))
        for o in optimizers
    ]
    # fp16 needs loss scaling; disabled, the scaler passes everything through.
    scaler = torch.amp.GradScaler(
        ctx.device.type, init_scale=cfg.init_scale, enabled=cfg.autocast == "fp16"
    )
    run = leto.Run(
        ctx,
        model,
        optimizers,
        schedulers,
        scaler=scaler,
        init=lambda: init_weights(model, cfg.seed),
        out=args.out,
        zero1=cfg.zero1,
        chunk_units=cfg.chunk_units,
        bucket_mib=cfg.bucket_mib,
    )
    first = run.next_iteration
    k = cfg.micro_batches
    for t in run.iterations(cfg.iterations):
        loss = torch.zeros((), device=ctx.device)
        with run.compute():
            for mb in range(k):  # gradients accumulate in the retained buffer
                stream = ctx.rank * k + mb  # data and dropout per (rank, micro-batch)
                torch.manual_seed(((cfg.seed * 7_919) + t) * 104_729 + stream)  # dropout
                x, y = (
                    v.to(ctx.device)
                    for v in batch(cfg.seed, t, stream, cfg.batch_size, cfg.seq_len)
                )
                with cfg.autocast_context(ctx.device):
                    mb_loss = model(x, y) / k
                # As with DDP: only the last micro-batch's backward reduces gradients.
                with run.no_sync() if mb < k - 1 else contextlib.nullcontext():
                    scaler.scale(mb_loss).backward()
                loss += mb_loss.detach()
        if t == first:
            print(
                f"rank {ctx.rank}: attention backend {model.attention_backend()}, "
                f"autocast {cfg.autocast}, TF32 {cfg.tf32}, AdamW {cfg.optimizer}, "
                f"{k} micro-batch(es) of {cfg.batch_size} x {cfg.seq_len} tokens",
                flush=True,
            )
        for o in optimizers:
            scaler.unscale_(o)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=cfg.optimizer != "single")
        run.record_loss(loss)
        for o in optimizers:
            scaler.step(o)  # o.step(), unless fp16 gradients overflowed
        scaler.update()
        for sc in schedulers:
            sc.step()
        adamw.zero_grad(set_to_none=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
