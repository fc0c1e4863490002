"""The same script as ``gpt_moe.py``, under Leto: each rank retains its experts (weights,
gradients, AdamW state: its own, as DDP's ignore list says) and the replicated rest
(data parallel: Leto reduces its gradients, as DDP did), and recovers them in place; the
all-to-alls of a redone iteration are redone with the same splits.

leto run --nproc-per-node 2 examples/parallel/gpt_moe_leto.py [--fsdp] --out leto-out

With ``--fsdp`` the experts are DTensors outside every ``fully_shard`` unit: Leto retains
them as the rank's shards, the rest as FSDP2 shards.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import leto

BATCH, SEQ, VOCAB, DIM, HEADS, LAYERS = 4, 32, 257, 64, 2, 2
EXPERTS, TOP_K, HIDDEN, AUX_WEIGHT = 8, 2, 128, 0.01


# Deterministic cuBLAS on a GPU (torch.use_deterministic_algorithms below), set before
# anything initializes it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def tokens(rank: int, it: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * it + 1_009 * rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


class Experts(nn.Module):
    """This rank's experts of one layer: GELU MLPs, weights stacked by expert. Built whole
    on every rank from the same seed, then sliced: the slice equals the full model's."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        local = EXPERTS // world
        w1 = torch.randn(EXPERTS, DIM, HIDDEN) * DIM**-0.5
        w2 = torch.randn(EXPERTS, HIDDEN, DIM) * HIDDEN**-0.5
        self.w1 = nn.Parameter(w1[rank * local : (rank + 1) * local].clone())
        self.w2 = nn.Parameter(w2[rank * local : (rank + 1) * local].clone())

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: tokens grouped by local expert, ``counts[e]`` of them for expert e (an
        expert with none still takes part: its gradient is zero, never missing)."""
        w1, w2 = local(self.w1), local(self.w2)
        out = [
            F.gelu(h @ w1[e]) @ w2[e]
            for e, h in enumerate(x.split(counts))
        ]  # fmt: skip
        return torch.cat(out)


class MoE(nn.Module):
    """A replicated router (top-2 of 8) and the rank's experts, tokens exchanged with the
    other ranks by two all-to-alls each way (the counts, then the tokens)."""

    def __init__(self, rank: int, world: int, group):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts(rank, world)
        self.world, self.group = world, group
        self.aux = torch.zeros(())  # the load-balancing loss of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, DIM)
        probs = self.router(x).softmax(-1)
        # Top-k with ties to the lower expert index: a stable descending sort.
        chosen = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :TOP_K]
        weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        # Switch Transformer's balance loss: experts' token shares times their mean
        # router probabilities.
        # (Integer sums of one-hot rows: bincount has no deterministic CUDA kernel.)
        counts = F.one_hot(chosen.flatten(), EXPERTS).sum(0)
        self.aux = EXPERTS * (counts.float() / chosen.numel() * probs.mean(0)).sum()
        # Dispatch: the (token, choice) slots grouped by expert — by destination rank,
        # then by its local expert.
        order = torch.argsort(chosen.flatten(), stable=True)
        slots = x[order // TOP_K]
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)  # [source rank][local expert]
        local = EXPERTS // self.world
        send = counts.view(self.world, local).sum(1).tolist()
        recv = got.view(self.world, local).sum(1).tolist()
        rows = all_to_all_single_autograd(slots, recv, send, self.group)
        # Received rows come by source rank; the experts take theirs from every source.
        expert_of = torch.arange(local, device=got.device).repeat(self.world).repeat_interleave(got)
        by_expert = torch.argsort(expert_of, stable=True)
        y = self.experts(rows[by_expert], got.view(self.world, local).sum(0).tolist())
        y = y[torch.argsort(by_expert)]
        # Combine: back to the sending ranks, back into slot order, weighted per token.
        back = all_to_all_single_autograd(y, send, recv, self.group)
        back = back[torch.argsort(order)].view(-1, TOP_K, DIM)
        return (back * weights.unsqueeze(-1)).sum(1).view(shape)


class Block(nn.Module):
    def __init__(self, rank: int, world: int, group):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.moe = MoE(rank, world, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    def __init__(self, rank: int, world: int, group):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(rank, world, group) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        return loss + AUX_WEIGHT * sum(b.moe.aux for b in self.blocks)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (with --fsdp the experts are DTensors); else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def expert_params(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".experts." in n]


def shard(model: nn.Module, mesh) -> None:
    """--fsdp: each layer's experts become DTensors sharded on dim 0 (the expert) over the
    ep mesh, outside every fully_shard unit; the rest is sharded by FSDP2 over the ranks."""
    experts = set()
    for b in model.blocks:
        for name in ("w1", "w2"):
            w = getattr(b.moe.experts, name).detach()
            w = nn.Parameter(DTensor.from_local(w, mesh, [Shard(0)], run_check=False))
            setattr(b.moe.experts, name, w)
            experts.add(w)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, ignored_params=experts)
    fully_shard(model, mesh=mesh, ignored_params=experts)


def finish_grads(model: nn.Module, max_norm: float, sharded: bool) -> None:
    """The experts' gradients averaged as DDP (FSDP2) averages the replicated ones, then
    every gradient clipped by the whole model's norm: the squares of every rank's experts
    (and, sharded, of its FSDP2 shards) summed over the ranks, plus the replicated part's
    (the same on every rank) when it is not sharded."""
    world = dist.get_world_size()
    named = [(n, local(p.grad)) for n, p in model.named_parameters() if p.grad is not None]
    experts = [g for n, g in named if ".experts." in n]
    rest = [g for n, g in named if ".experts." not in n]
    for g in experts:
        g.div_(world)
    sq = torch.nn.utils.get_total_norm(experts) ** 2
    if sharded:
        sq += torch.nn.utils.get_total_norm(rest) ** 2
    dist.all_reduce(sq)
    if not sharded:
        sq += torch.nn.utils.get_total_norm(rest) ** 2
    torch.nn.utils.clip_grads_with_norm_([g for _, g in named], max_norm, sq.sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="out", help="folder for iterations.jsonl and params")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 over the replicated parts, not DDP")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    # Testing on fewer GPUs (docs/runtime.md): LETO_RANKS_PER_GPU=N puts ranks N*g..N*g+N-1
    # on GPU g, over gloo (NCCL refuses two ranks on one GPU); leto run --ranks-per-gpu sets it.
    per_gpu = int(os.environ.get("LETO_RANKS_PER_GPU", "1"))
    ctx = leto.init()  # the process group (a shadow parks in here)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank // per_gpu) if cuda else torch.device("cpu")
    if cuda:  # (NCCL's all-to-alls)
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if EXPERTS % world:
        raise SystemExit(f"{EXPERTS} experts cannot be split over {world} ranks")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    torch.manual_seed(args.seed)  # the same full model on every rank; each keeps its experts
    model = MoEGPT(rank, world, mesh.get_group("ep")).to(device)
    if args.fsdp:
        shard(model, mesh)
    else:  # DDP leaves the experts alone
        DDP._set_params_and_buffers_to_ignore_for_model(model, expert_params(model))
    # Fused AdamW steps a parameter group in one call, which cannot mix DTensors and plain
    # tensors (--fsdp: the norms' and biases' shards are DTensors too): a group for each.
    params = list(model.parameters())
    groups = [
        {"params": g}
        for g in ([p for p in params if isinstance(p, DTensor)],
                  [p for p in params if not isinstance(p, DTensor)])
        if g
    ]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 3))
    # Rank 0's iteration times (bench.user_path); appended to: a restarted process (a
    # promoted Leto shadow) runs this set-up again.
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "iterations.jsonl"), "a") if rank == 0 else None
    run = leto.Run(ctx, model, optimizer, scheduler)  # experts: each rank its own
    model = run.model
    t_end = time.perf_counter()
    for it in run.iterations(args.iterations):
        x = tokens(rank, it).to(device)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        finish_grads(model, 1.0, args.fsdp)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        t_prev, t_end = t_end, time.perf_counter()
        if log is not None:
            line = {"iteration": it, "wall_s": t_end - t_prev, "loss": loss.item()}
            log.write(json.dumps(line) + "\n")
            log.flush()
    plain = getattr(model, "module", model)  # (DDP's, or Leto's run.model)
    state = {n: local(p).detach().clone() for n, p in plain.named_parameters()}
    torch.save(state, os.path.join(args.out, f"rank{rank}.params.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
