"""The same script as ``gpt_parallel.py``, under Leto: each rank retains its shards
(parameters, reduced gradients, AdamW state) and recovers them in place.

leto run --nproc-per-node 2 examples/parallel/gpt_parallel_leto.py [--tp 2] --out leto-out
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import leto
from leto.workload.gpt import GPT, GPTConfig

# An odd vocabulary: the embedding and head rows do not split evenly, so FSDP2 pads
# one rank's shard (Leto retains the padding with it).
BATCH, SEQ, VOCAB = 4, 32, 257


def tokens(rank: int, it: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * it + 1_009 * rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def clip_grad_norm(params, max_norm: float) -> None:
    """``clip_grad_norm_`` for tensor-parallel gradients: torch's refuses plain tensors
    beside DTensors (TP alone) and DTensors of two meshes (FSDP2 x TP); each norm here
    is made whole first."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [g.norm() for g in grads]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = float(torch.linalg.vector_norm(torch.stack(norms)))
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    args = ap.parse_args()
    ctx = leto.init()  # the process group (a shadow parks in here)
    rank = ctx.rank
    device = ctx.device
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = GPT(GPTConfig(vocab=VOCAB, block=SEQ, n_layer=2, n_head=2, n_embd=64, dropout=0.0))
    model = model.to(device)
    dp = dist.get_world_size() // args.tp
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    if args.tp > 1:
        for block in model.blocks:
            parallelize_module(
                block, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()}
            )
    if dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    # Fused AdamW steps a parameter group in one call, which cannot mix DTensors and plain
    # tensors (TP alone leaves the embeddings and norms plain): a group for each.
    params = list(model.parameters())
    groups = [
        {"params": g}
        for g in ([p for p in params if isinstance(p, DTensor)],
                  [p for p in params if not isinstance(p, DTensor)])
        if g
    ]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 3))
    run = leto.Run(ctx, model, optimizer, scheduler)
    for it in run.iterations(args.iterations):
        x = tokens(rank, it).to(device)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        if args.tp == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    os.makedirs(args.out, exist_ok=True)
    state = {
        n: getattr(p, "_local_tensor", p).detach().clone() for n, p in model.named_parameters()
    }
    torch.save(state, os.path.join(args.out, f"rank{rank}.params.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
