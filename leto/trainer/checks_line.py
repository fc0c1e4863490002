"""The one console line that says, at a job's start, where every silent-corruption
check stands on this job: on or off, what it covers here, and why not where it is off.

Runs in the trainer (rank 0, once ``leto.Run`` has set the checks up); the line reaches
the console through the agent (``leto.trainer.run._notice``). What each check costs and
its false-alarm record are in docs/integrity.md, which the line names.

Not covered: checks a later event switches off (a settled disagreement says so itself).
"""

from __future__ import annotations

import torch


def describe(job, replay_every: int) -> str:
    """``job``: the trainer's ``RetainedJob``; ``replay_every``: ``--replay-every``."""
    parts = []
    if job.replica is not None:
        parts.append(f"replica check: on (every update, {job.world} replicas compared)")
    else:
        if job.world == 1:
            why = "one rank: no replica"
        elif not job.replicated or job.rank_local or job.up.state.shards is not None:
            why = "parameters sharded or rank-local: no replica"
        elif job.up.state.shard is not None:
            why = "ZeRO-1: each rank's optimizer state is its own"
        else:
            why = "--no-replica-check"
        parts.append(f"replica check: off ({why})")
    rc = job.up.recheck
    if rc is not None:
        how = "every chunk" if rc.every else f"one chunk of {rc.chunks} an update, in turn"
        parts.append(f"update recheck: on ({how})")
    else:
        parts.append(
            "update recheck: off"
            + (" (replicas check the update)" if job.replica is not None else "")
        )
    rp = job.replay
    if rp is None:
        why = "--replay-every 0" if replay_every <= 0 else "needs a replica of every parameter"
        parts.append(f"gradient replay: off ({why})")
    elif not torch.are_deterministic_algorithms_enabled():
        parts.append(
            "gradient replay: skipped (torch.use_deterministic_algorithms(True) is off: a "
            "recomputation need not be bit-exact)"
        )
    else:
        parts.append(f"gradient replay: every {rp.k} iterations")
    parts.append("loss guard: " + ("on" if job.guard is not None else "off"))
    mib = job.scrub.budget / 2**20
    parts.append(f"scrub: {mib:g} MiB an iteration" if mib > 0 else "scrub: off")
    # Not a check, but what the checks check: the update's code (the fused pass, or the
    # unfused steps and why — slower on a GPU, and said nowhere else on the console).
    parts.append(f"chunk updates: {job.up.update_path}")
    parts.append(f"undo copies: {job.up.undo_path}")
    parts.append(f"gradient parity: {job.up.grad_parity_path}")
    return "checks: " + "; ".join(parts) + " (docs/integrity.md)"
