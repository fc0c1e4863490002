"""A trainer that only beats (every 0.1 s for ``seconds``): the agent's monitoring load
on the store with nothing else going on (bench/store_load.py)."""

import sys
import time

import torch.distributed as dist

import leto

seconds = float(sys.argv[1])
ctx = leto.init()
t0, i = time.monotonic(), 0
while time.monotonic() - t0 < seconds:
    ctx.heartbeat(i)
    i += 1
    time.sleep(0.1)
ctx.heartbeat("done")
ctx.pool.close()
dist.destroy_process_group()
