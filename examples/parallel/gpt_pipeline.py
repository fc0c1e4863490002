"""A pipeline-parallel job (``torch.distributed.pipelining``): the example GPT cut into
one stage per rank — the embeddings and the first blocks, ..., the last blocks, the
final norm and the head — run by a GPipe or 1F1B schedule over micro-batches. Fused AdamW,
a warm-up LR schedule, gradient clipping by the norm over every stage.
``gpt_pipeline_leto.py`` is the same script under Leto (docs/porting.md).

torchrun --standalone --nproc-per-node 2 examples/parallel/gpt_pipeline.py [--schedule 1f1b]
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from leto.workload.gpt import GPT, GPTConfig

BATCH, SEQ, VOCAB, LAYERS, MICRO = 8, 32, 257, 4, 4


def tokens(it: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * it)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


class Stage(nn.Module):
    """Blocks [a, b) of the GPT, with the embeddings on the first stage and the final
    norm and head on the last."""

    def __init__(self, gpt: GPT, stage: int, stages: int):
        super().__init__()
        per = LAYERS // stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.tok, self.pos = (gpt.tok, gpt.pos) if self.first else (None, None)
        self.blocks = nn.ModuleList(gpt.blocks[stage * per : (stage + 1) * per])
        self.ln, self.head = (gpt.ln, gpt.head) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x)).float() if self.last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def clip_grad_norm(params, max_norm: float) -> None:
    """``clip_grad_norm_`` over the whole model: the stages' squared norms summed."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.nn.utils.get_total_norm(grads) ** 2
    dist.all_reduce(sq)
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, sq.sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(args.seed)  # the same full model on every rank; each keeps its stage
    gpt = GPT(GPTConfig(vocab=VOCAB, block=SEQ, n_layer=LAYERS, n_head=2, n_embd=64, dropout=0.0))
    stages = dist.get_world_size()
    model = Stage(gpt, rank, stages).to(device)
    stage = PipelineStage(model, rank, stages, device)
    schedule = (ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B)(
        stage, MICRO, loss_fn=loss_fn
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 3))
    for it in range(args.iterations):
        x = tokens(it).to(device)
        if model.first:
            schedule.step(x[:, :-1])
        elif model.last:
            schedule.step(target=x[:, 1:])
        else:
            schedule.step()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    os.makedirs(args.out, exist_ok=True)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(state, os.path.join(args.out, f"rank{rank}.params.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
