"""A Leto script that draws from the global generators inside its loop, as many scripts
do: its batches from ``torch.randn``, a dropout mask every forward, and a coin from
Python's ``random`` — run by tests/test_rng_state_integ.py, killed mid-run, and compared
with its fault-free run."""

import argparse
import contextlib
import random

import torch

import leto

ACCUM = 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    ctx = leto.init()
    torch.manual_seed(0)  # the same weights on every rank; then each rank its own draws
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = leto.Run(ctx, model, optimizer, out=args.out)
    model = run.model
    torch.manual_seed(100 + ctx.rank)
    random.seed(100 + ctx.rank)
    for _ in run.iterations(args.iterations):
        total = torch.zeros(())
        for micro in range(ACCUM):
            x = torch.randn(8, 16)  # the batch: global torch generator
            scale = random.choice([0.5, 1.0, 2.0])  # Python's generator
            with model.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
                loss = (model(x) * scale).square().mean() / ACCUM  # dropout: its mask
                loss.backward()
            total += loss.detach()
        run.record_loss(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
