"""A user's own loop for the tests: a small MLP with AdamW (two groups) and LambdaLR.
With ``LETO_TEST_CKPT`` it loads the model, optimizer and scheduler states and the
iteration from that torch.save file before ``leto.Run`` (the script's own resume, as
nanoGPT does it) and continues there; with ``LETO_TEST_COMPILE`` the model is
``torch.compile``d (backend aot_eager: dynamo and AOTAutograd, no C++ compiler). Each
iteration evaluates first (``eval()``, no grad) and counts itself in ``run.state`` (the
script's small state, retained with the loop). At the end it saves the parameters, the
optimizer's state_dict() and that count to ``<argv[1]>/rank0.final.pt``."""

import os
import sys

import torch

import leto

ITERS = 5


def build(compiled: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    if compiled:
        model = torch.compile(model, backend="aot_eager")
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.ndim == 2]},
         {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2, fused=True,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    return model, opt, sched


def batch(t: int):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(4, 16, generator=g)


def evaluate(model) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(model(batch(-1)).square().mean())
    model.train()
    return loss


def one(model, opt, sched, t):
    evaluate(model)  # at the top of the iteration, as nanoGPT does
    model(batch(t)).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    sched.step()
    opt.zero_grad()


if __name__ == "__main__":
    ctx = leto.init()
    model, opt, sched = build(bool(os.environ.get("LETO_TEST_COMPILE")))
    start = 0
    if os.environ.get("LETO_TEST_CKPT"):
        ck = torch.load(os.environ["LETO_TEST_CKPT"])
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        # LETO_TEST_FORGET_START: the trap of resuming the state but not the loop.
        start = 0 if os.environ.get("LETO_TEST_FORGET_START") else ck["iteration"]
    run = leto.Run(ctx, model, opt, sched, start_iteration=start)
    for t in run.iterations(ITERS):
        run.state["iterations"] = run.state.get("iterations", 0) + 1
        one(model, opt, sched, t)
    torch.save(
        {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
         "optimizer": opt.state_dict(), "iterations": run.state["iterations"]},
        os.path.join(sys.argv[1], "rank0.final.pt"),
    )  # fmt: skip
