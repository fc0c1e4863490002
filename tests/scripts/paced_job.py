"""A small script whose iterations take a user-like time (a sleep stands in for the
compute), so a parked L3 shadow sees its trainer go from one iteration to the next and
runs the set-up ahead (leto.trainer.run_ahead) before the next fault: a global draw
before the model, a print in the set-up (held until the promotion), a log opened with
"a" only after ``leto.Run``, and dropout (a warm-up at the script's shapes must leave the
generators as they were) — run by tests/test_run_ahead_integ.py under faultkit
certify."""

import argparse
import time

import torch

import leto


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=0.25, help="each iteration's sleep")
    ap.add_argument(
        "--fails-ahead",
        action="store_true",
        help="the set-up raises where it runs ahead of a promotion (a stand-in for a set-up "
        "that needs what only a promoted trainer has)",
    )
    args = ap.parse_args()
    ctx = leto.init()
    if args.fails_ahead and ctx.pool is None:  # (running ahead: no pool attached yet)
        raise RuntimeError("the tokenizer's cache is not readable here")
    torch.manual_seed(0)
    shuffle = torch.randperm(64)  # a draw before the model: skipping its init stays safe
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 8)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 4))
    print(f"rank {ctx.rank}: set-up done, generation {ctx.generation}", flush=True)
    run = leto.Run(ctx, model, optimizer, scheduler)
    model = run.model
    with open(f"paced{ctx.rank}.log", "a") as log:
        for t in run.iterations(args.iterations):
            g = torch.Generator().manual_seed(1000 * t + ctx.rank)
            x = torch.randn(16, 32, generator=g)[shuffle[:16] % 16]
            loss = model(x).square().mean()
            loss.backward()
            run.record_loss(loss)
            time.sleep(args.seconds)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            log.write(f"iteration {t}\n")


if __name__ == "__main__":
    main()
