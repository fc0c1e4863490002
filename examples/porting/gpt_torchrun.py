"""A nanoGPT-style training script for torchrun + DDP, tuned as users tune it: fused
AdamW with two parameter groups, a warm-up ``LambdaLR``, gradient accumulation with
``no_sync``, ``clip_grad_norm_``, bf16 autocast and TF32 on CUDA, the loss logged every
iteration. ``gpt_leto.py`` is the same script under Leto; ``bench/user_path.py`` runs
the two side by side, started as users start them.

    torchrun --standalone --nproc-per-node 2 examples/porting/gpt_torchrun.py --out out

Rank 0 writes ``<out>/iterations.jsonl``, a line per iteration: its wall seconds (the
device waited for at its end; the first from just before the loop), the loss and the
device's peak allocated bytes so far. At the end every rank writes
``<out>/rank{r}.params.pt`` (name -> parameter, on the CPU) for bit-identity checks.
Tokens per iteration: world x accum x batch x seq.
"""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from nanogpt_model import GPT, GPTConfig, batch
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=12, help="transformer blocks")
    ap.add_argument("--n-embd", type=int, default=768, help="model width")
    ap.add_argument("--n-head", type=int, default=12, help="attention heads")
    ap.add_argument("--vocab", type=int, default=50304, help="vocabulary size")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch and rank")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per iteration")
    ap.add_argument("--iterations", type=int, default=20, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=10, help="iterations of linear LR warm-up")
    ap.add_argument("--out", default="out", help="folder for iterations.jsonl and params")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and token stream")
    ap.add_argument(
        "--tokens",
        choices=("uniform", "zipf"),
        default="uniform",
        help="token frequencies: uniform, or zipf (as in text: rare rows of a tied embedding)",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True): runs repeat bit for bit on CUDA",
    )
    args = ap.parse_args()
    if args.deterministic:
        # Before the first cuBLAS handle: its workspace is fixed when it is made.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    local_rank = int(os.environ["LOCAL_RANK"])
    # Testing on fewer GPUs (docs/runtime.md): LETO_RANKS_PER_GPU=N puts ranks N*g..N*g+N-1
    # on GPU g, over gloo (NCCL refuses two ranks on one GPU); leto run --ranks-per-gpu sets it.
    per_gpu = int(os.environ.get("LETO_RANKS_PER_GPU", "1"))
    cuda_device = torch.device("cuda", local_rank // per_gpu)
    device = cuda_device if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" and per_gpu == 1 else "gloo")
    rank = dist.get_rank()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPTConfig(args.vocab, args.seq, args.n_layer, args.n_head, args.n_embd)
    with device:  # built where it trains: a 1 B model's CPU init takes seconds
        model = GPT(config)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: min(1.0, (t + 1) / args.warmup)
    )
    # Appended to: a restarted process (a promoted Leto shadow) runs this set-up again.
    log = open(os.path.join(args.out, "iterations.jsonl"), "a") if rank == 0 else None
    model = DDP(model, device_ids=[device] if cuda else None)
    t_end = time.perf_counter()
    for it in range(args.iterations):
        total = torch.zeros((), device=device)
        for micro in range(args.accum):
            x, y = batch(
                args.seed, rank, it, micro, args.batch, args.seq, args.vocab, device, args.tokens
            )
            with model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext():
                with amp:
                    loss = model(x, y) / args.accum
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = total.item()  # logged, as users do: the host waits for the device
        if cuda:
            torch.cuda.synchronize(device)
        t_prev, t_end = t_end, time.perf_counter()
        if log is not None:
            peak = torch.cuda.max_memory_allocated(device) if cuda else 0
            line = {"iteration": it, "wall_s": t_end - t_prev, "loss": loss_value}
            # (done_at: when it ended, for the time from the job's launch to its first iteration)
            line.update(done_at=time.time(), peak_allocated_bytes=peak)
            log.write(json.dumps(line) + "\n")
            log.flush()
    if log is not None:
        log.close()
    state = {n: p.detach().to("cpu", copy=True) for n, p in model.module.named_parameters()}
    torch.save(state, os.path.join(args.out, f"rank{rank}.params.pt"))
    # DDP's reducer must not hold the last reference to the process group: freed there,
    # gloo's destructor joins its threads with the GIL held and can deadlock (torch #56297).
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
