"""A model with persistent buffers, for the buffer tests: a BatchNorm layer (running
statistics forward writes) and a constant persistent mask (llm.c's causal mask kind),
trained under torchrun + DDP (default broadcast_buffers) or, with ``--leto``, its port
under ``leto run``. Each iteration evaluates first (``eval()``, no grad: a forward that
does not synchronize, so DDP broadcasts no buffers before the next), then two
micro-batches, the first under ``no_sync()``. At the end every rank saves its model's
state dict (parameters and buffers) to ``<out>/rank<r>.final.pt``.

    torchrun --nproc-per-node 2 buffers_job.py --out ref
    leto run --nproc-per-node 2 buffers_job.py --leto --out run
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4))[-1])  # constant, persistent

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.mask


def batch(rank: int, it: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * it + 10 * rank + micro)
    return torch.randn(6, 8, generator=g) * (1 + rank)  # ranks see different statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leto", action="store_true")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    if args.leto:
        import leto

        ctx = leto.init()
        rank = ctx.rank
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    if args.leto:
        run = leto.Run(ctx, net, opt)
        model, loop = run.model, run.iterations(args.iterations)
    else:
        model, loop = torch.nn.parallel.DistributedDataParallel(net), range(args.iterations)
    for it in loop:
        model.eval()
        with torch.no_grad():
            model(batch(rank, it, 9))
        model.train()
        total = torch.zeros(())
        for micro in range(2):
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = model(batch(rank, it, micro)).square().mean() / 2
                loss.backward()
            total += loss.detach()
        if args.leto:
            run.record_loss(total)
        opt.step()
        opt.zero_grad(set_to_none=True)
    os.makedirs(args.out, exist_ok=True)
    torch.save(net.state_dict(), os.path.join(args.out, f"rank{rank}.final.pt"))
    if not args.leto:
        # As a torchrun script ends: a gloo group left to the interpreter's exit has
        # aborted the process (SIGABRT) after its outputs were written.
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
