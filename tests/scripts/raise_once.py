"""A trainer for the script-error tests. ``LETO_TEST_RAISE`` says what goes wrong:
``running`` (default): rank 1 raises once, in generation 0, after it began training (a
recovery follows); ``always``: it raises in every generation after it began (the job
stops the second time); ``startup``: each rank initializes its model from its own seed,
which ``leto.Run`` refuses at start-up (the job stops at once); ``unused``: a parameter
gets no gradient, which ``optimizer.step()`` refuses (torch would skip it; Leto will not
update it with a zero gradient instead) — in every generation, so the job stops after
one recovery; ``fatal``: rank 1 reports retained state beyond repair (a ``FatalFailure``)
at iteration 2 of every generation, as a persistent fault would — checkpoints every
iteration; ``exit``: rank 1 calls ``sys.exit(3)`` in iteration 1 (the script's own verdict:
the job stops with code 3, nothing retried). Every other trainer finishes at once."""

import os

import torch
import torch.distributed as dist

import leto
from leto.errors import FatalFailure

when = os.environ.get("LETO_TEST_RAISE", "running")
ctx = leto.init()
if when == "startup":
    torch.manual_seed(ctx.rank)  # the bug: different initial weights per rank
    model = torch.nn.Linear(8, 4)
    leto.Run(ctx, model, torch.optim.SGD(model.parameters(), lr=0.1))
if when == "unused":
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(8, 4), "idle": torch.nn.Linear(8, 4)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = leto.Run(ctx, model, opt)
    for _ in run.iterations(2):
        model["used"](torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
if when == "exit":
    import sys

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = leto.Run(ctx, model, opt)
    for t in run.iterations(4):
        if t == 1 and ctx.rank == 1:
            print("stopping: the data ran out", flush=True)
            sys.exit(3)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    raise SystemExit(0)
if when == "fatal":
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = leto.Run(ctx, model, opt)
    for t in run.iterations(4):
        if t == 2 and ctx.rank == 1:
            raise FatalFailure("group 0 param page 3 changed silently (a stuck bit)")
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    raise SystemExit(0)
ctx.resumed(0)
if ctx.rank == 1 and (when == "always" or ctx.generation == 0):
    raise ValueError("a batch of shape (3, 5) where (4, 5) was expected")
# Rank 0 waits here until the agent fences it (generation 0); later, no rank leaves
# while a peer still builds its gloo mesh.
dist.barrier()
ctx.heartbeat("done")
ctx.pool.close()
dist.destroy_process_group()
