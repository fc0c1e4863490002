"""A Leto script that reads its data as users do: torchdata's ``StatefulDataLoader`` over
a token dataset, shuffled with a seeded generator per rank, two worker processes, epoch
after epoch — handed to Leto with ``leto.Run(..., data=loader)``, so a recovery resumes
it at the exact next batch with no change to how the script builds or iterates it
(``tests/test_data_state_integ.py`` kills it in compute, in the all-reduce and in the
update, and compares every iteration with a fault-free run).

    leto run --nproc-per-node 2 examples/porting/loader_leto.py --out out

Every rank writes ``<out>/rank{r}.params.pt`` (name -> parameter) and, per iteration,
the sample indices it trained on to ``<out>/rank{r}.samples.jsonl``.
"""

import argparse
import contextlib
import json
import os

import torch
from nanogpt_model import GPT, GPTConfig
from torchdata.stateful_dataloader import StatefulDataLoader

import leto

VOCAB, SEQ, SAMPLES, BATCH, ACCUM = 64, 16, 20, 4, 2


def epochs(loader):
    """Batch after batch, a new epoch (a new shuffle) after the last."""
    while True:
        yield from loader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6, help="optimizer steps")
    ap.add_argument("--out", default="out", help="folder for params and samples")
    ap.add_argument("--workers", type=int, default=2, help="loader worker processes")
    ap.add_argument("--seed", type=int, default=0, help="the shuffles' seed (faultkit's --seed)")
    args = ap.parse_args()
    ctx = leto.init()
    rank = ctx.rank
    torch.manual_seed(0)  # the same weights and the same dataset on every rank
    model = GPT(GPTConfig(VOCAB, SEQ, n_layer=1, n_head=2, n_embd=32))
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1))
    dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES), tokens)
    loader = StatefulDataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=args.workers,
        generator=torch.Generator().manual_seed(1000 + 100 * args.seed + rank),  # each rank its own order
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = leto.Run(ctx, model, optimizer, data=loader)  # its position retained per iteration
    model = run.model
    batches = epochs(loader)  # iterated after leto.Run: a recovery has loaded its position
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"rank{rank}.samples.jsonl"), "a")
    for it in run.iterations(args.iterations):
        seen, total = [], torch.zeros(())
        for micro in range(ACCUM):
            index, x = next(batches)
            seen += index.tolist()
            with model.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
                loss = model(x[:, :-1], x[:, 1:]) / ACCUM
                loss.backward()
            total += loss.detach()
        # Before the step: an iteration whose update a failure interrupted is finished
        # by the recovery, and the script goes on after its step (nothing after it runs).
        log.write(json.dumps({"iteration": it, "samples": seen}) + "\n")
        log.flush()
        run.record_loss(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    torch.save(state, os.path.join(args.out, f"rank{rank}.params.pt"))


if __name__ == "__main__":
    main()
