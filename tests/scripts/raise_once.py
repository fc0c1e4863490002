"""A trainer for the script-error tests. ``LETO_TEST_RAISE`` says when rank 1 raises:
``running`` (default): once, in generation 0, after it began training (a recovery
follows); ``startup``: in generation 0 before it began training (the job stops at
once); ``always``: in every generation after it began (the job stops the second time).
Every other trainer finishes at once."""

import os

import torch.distributed as dist

import leto

when = os.environ.get("LETO_TEST_RAISE", "running")
ctx = leto.init()


def fail():
    raise ValueError("a batch of shape (3, 5) where (4, 5) was expected")


if when == "startup" and ctx.generation == 0 and ctx.rank == 1:
    fail()
ctx.resumed(0)
if ctx.rank == 1 and (when == "always" or ctx.generation == 0) and when != "startup":
    fail()
if ctx.generation == 0 or when == "always":
    dist.barrier()  # rank 0 waits here until the agent fences it
ctx.heartbeat("done")
ctx.pool.close()
dist.destroy_process_group()
