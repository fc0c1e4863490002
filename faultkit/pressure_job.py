"""The example job under device-memory pressure: the preinitialization demo and its tests.

    leto run ... faultkit/pressure_job.py --demand-at 3 --demand-beyond-free-mib 200 \\
        --demand-chunk-mib 64 [the example's flags]

Runs in a trainer process, in place of ``examples/train_gpt.py``, which it runs
unchanged: at iteration ``--demand-at`` (once this rank's shadow has parked) the job's
device memory grows past what is free by ``--demand-beyond-free-mib``, in allocations of
``--demand-chunk-mib`` (each a cache miss the allocation hook sees), held to the end.
Without the preinitialization controller this OOMs; with it the shadow is reclaimed
first. Training math is unchanged, so the run compares bit for bit with the plain
example's. The pressure comes in through ``leto.Run.iterations`` (wrapped here), so
the example itself carries no demo flags.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import torch

import leto
from leto.proc import alive

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def grow_demand(ctx, at: int, beyond_free_mib: float, chunk_mib: float) -> list[torch.Tensor]:
    """Grow this rank's device memory past what is free while its shadow is parked.
    Outside ``run.compute()``: the updater's lent buffers stay out."""
    parked = ctx.wait_shadow_parked(timeout_s=120)
    free = ctx.device_free_bytes()
    target = free + int(beyond_free_mib * 2**20)
    chunk = max(1, int(chunk_mib * 2**20))
    print(
        f"rank {ctx.rank}: demand {target / 2**30:.2f} GiB with {free / 2**30:.2f} GiB free "
        f"(shadow parked: {parked})",
        flush=True,
    )
    held, total = [], 0
    while total < target:
        n = min(chunk, target - total)
        held.append(torch.empty(n, dtype=torch.uint8, device=ctx.device).fill_(1))
        total += n
    # The beat reports a reclamation (on the emulated CPU device it is also where the
    # allocation path runs); the report is what makes the agent relaunch the shadow.
    ctx.heartbeat(at)
    if parked is not None and not alive(parked["pid"]):
        # Reclaimed. The demo goes on once the relaunched (lower-level) shadow has parked,
        # so a later fault meets a parked shadow, not one still starting: that would time
        # the shadow's start-up, not its recovery. Bounded below the hang timeout.
        again = ctx.wait_shadow_parked(timeout_s=30, other_than=parked["pid"])
        print(f"rank {ctx.rank}: shadow relaunched and parked: {again}", flush=True)
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--demand-at", type=int, required=True, help="iteration of the growth")
    ap.add_argument("--demand-beyond-free-mib", type=float, default=512.0)
    ap.add_argument("--demand-chunk-mib", type=float, default=256.0)
    args, rest = ap.parse_known_args()
    iterations, held = leto.Run.iterations, []

    def under_pressure(run, total):
        for t in iterations(run, total):
            if t == args.demand_at and not held:
                held.append(
                    grow_demand(run.ctx, t, args.demand_beyond_free_mib, args.demand_chunk_mib)
                )
            yield t

    leto.Run.iterations = under_pressure
    sys.argv = [str(EXAMPLE), *rest]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
