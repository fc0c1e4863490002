"""A Leto script whose rank 1 records a NaN loss once — in iteration ``--nan-at`` of the
job's first generation only, as a transient fault in the loss's computation would —
run by tests/test_loss_guard_integ.py and compared with the same script's fault-free
run (``--nan-at -1``)."""

import argparse
import os

import torch

import leto


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--nan-at", type=int, default=-1)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    ctx = leto.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = leto.Run(ctx, model, optimizer, out=args.out)
    model = run.model
    first_generation = os.environ.get("LETO_GENERATION") == "0"
    for it in run.iterations(args.iterations):
        g = torch.Generator().manual_seed(1000 * it + ctx.rank)
        x = torch.randn(8, 16, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        if it == args.nan_at and ctx.rank == 1 and first_generation:
            run.record_loss(float("nan"))  # the wrong value; the gradients are right
        else:
            run.record_loss(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
