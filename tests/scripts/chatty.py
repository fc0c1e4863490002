"""A script that prints as users' scripts do, for the console tests: a line on stdout at
its start and in every iteration before its backward (``it <t> rank <r>``), one on
stderr in every iteration (``note <t>``), and a last stdout line with no newline
(``bye``). A small MLP with AdamW on every rank, 6 iterations."""

import sys

import torch

import leto

ctx = leto.init()
print(f"start rank {ctx.rank}")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
run = leto.Run(ctx, model, opt)
model = run.model
for t in run.iterations(6):
    print(f"it {t} rank {ctx.rank}")
    print(f"note {t}", file=sys.stderr)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t * 10 + ctx.rank))
    loss = model(x).square().mean()
    loss.backward()
    run.record_loss(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
print("bye", end="")
