"""A trainer for the process tests: it starts a child (``sleep``, as a data loader or a
compile worker would be), records the child's pid, and in generation 0 reaches the
point the fault plan kills at (rank 1) or waits to be fenced (rank 0)."""

import os
import subprocess
import sys
import time

import torch.distributed as dist

import leto
from leto.plugins import point

out = sys.argv[1]
ctx = leto.init()
child = subprocess.Popen(["sleep", "300"])
# Written whole, then renamed: the tests poll for these files and must not read one
# half-written (an empty file was read once).
name = f"child-g{ctx.generation}-r{ctx.rank}"
with open(os.path.join(out, f".partial-{name}"), "w") as f:
    f.write(str(child.pid))
os.replace(os.path.join(out, f".partial-{name}"), os.path.join(out, name))
if ctx.generation == 0:
    if ctx.rank == 1:
        time.sleep(1.0)  # both children recorded first
        point("compute.forward", 0)  # the plan SIGKILLs rank 1 here
    time.sleep(300)  # rank 0: fenced by the agent
if os.environ.get("LETO_TEST_HOLD"):
    time.sleep(300)  # the SIGTERM test stops leto run here
ctx.resumed(1)
# Gloo builds its mesh at init without a barrier: a rank that left at once could close
# its side while a peer still handshakes (the peer then fails, a second failure).
dist.barrier()
ctx.heartbeat("done")
ctx.pool.close()
dist.destroy_process_group()
