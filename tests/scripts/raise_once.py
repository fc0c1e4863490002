"""A trainer for the error-file test: rank 1 of generation 0 raises; every other
trainer finishes at once."""

import torch.distributed as dist

import leto

ctx = leto.init()
if ctx.generation == 0 and ctx.rank == 1:
    raise ValueError("a batch of shape (3, 5) where (4, 5) was expected")
if ctx.generation == 0:
    dist.barrier()  # rank 0 waits here until the agent fences it
ctx.resumed(0)
ctx.heartbeat("done")
ctx.pool.close()
dist.destroy_process_group()
