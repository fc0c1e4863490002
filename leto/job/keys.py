"""Every key of the job's TCPStore, in one place: who writes it, who reads it.

Runs in every process of a job (agents, trainers, shadows). The store is the only
channel between nodes; a key's name is its contract, so it is built here and nowhere
else. Counters are written with ``add`` (a missing key reads as 0).

Not covered: keys torch.distributed writes itself under ``pg_prefix`` (its rendezvous).
"""

from __future__ import annotations

# Job-wide counters (agents).
AGENTS = "leto/agents"  # agents that joined
DONE = "leto/done"  # nodes whose trainers all finished
COLLECTED = "leto/collected"  # agents that read the recovery records (node 0 then stops)
# Trainers that committed an iteration without run.record_loss under --verify (agents
# say so once on the console at the end).
NO_LOSS = "leto/no_loss"
# Lines a trainer has for the console (a check switched off, with its evidence file):
# a trainer takes a number from NOTICES_TAKEN, sets notice(n), then counts NOTICES up;
# node 0's agent logs each once.
NOTICES_TAKEN = "leto/notices_taken"
CHECKS_SAID = "leto/checks_said"  # the checks' line was sent (rank 0, once a job)
NOTICES = "leto/notices"


def notice(n: int) -> str:
    """The text of the n-th console line a trainer sent (see NOTICES)."""
    return f"leto/notice/{n}"


def failures(gen: int) -> str:
    """Counter: failures seen in generation ``gen`` (any node's agent)."""
    return f"leto/gen{gen}/failures"


def fatal(gen: int) -> str:
    """Counter: fatal failures (FF) in ``gen`` — the checkpoint fallback follows."""
    return f"leto/gen{gen}/fatal"


def failure(gen: int, rank: int) -> str:
    """JSON: how ``rank`` failed in ``gen`` (exit code or hang, its error file)."""
    return f"leto/gen{gen}/failure/rank{rank}"


def fenced(gen: int) -> str:
    """Counter: nodes that fenced their trainers after ``gen``'s failure."""
    return f"leto/gen{gen}/fenced"


def reshadow(gen: int) -> str:
    """Counter/records: L3 shadow restarts of generation ``gen``."""
    return f"leto/gen{gen}/reshadow"


def beat(gen: int, rank: int) -> str:
    """The trainer's heartbeat: its iteration, or "done" (written by the trainer)."""
    return f"leto/gen{gen}/rank{rank}/beat"


def warming(gen: int) -> str:
    """Counter: trainers of ``gen`` in the first iteration of their process (compiling,
    warming up; the agent's hang timeout waits for them)."""
    return f"leto/gen{gen}/warming"


# The job's agreed checkpoint interval in iterations (Young's, once a first save was
# timed): trainers joining later keep to it (leto.trainer.checkpoint).
CHECKPOINT_INTERVAL = "leto/checkpoint_interval"


def staging(rank: int) -> str:
    """JSON: a trainer's checkpoint staging layout ({name: [shape, dtype, pinned]}), for
    its rank's next shadows to make ahead (``leto.trainer.staging``)."""
    return f"leto/rank{rank}/staging"


def shape_warmup(rank: int) -> str:
    """JSON: a trainer's first forward call (its arguments' shapes, the autocast state)
    and its first iteration's peak, or why not — for its rank's run-ahead shadows to warm
    up at those shapes (``leto.trainer.shape_warmup``)."""
    return f"leto/rank{rank}/shape_warmup"


def scheduler_increment(rank: int) -> str:
    """The increment a script gives Megatron's LR scheduler each iteration (its samples),
    published at its first step: what a recovery replays a step with, when the loop record
    predates that first step (``leto.trainer.megatron.Scheduler``)."""
    return f"leto/rank{rank}/scheduler_increment"


def skip_init(rank: int) -> str:
    """"safe", or why not: whether a promoted trainer of ``rank`` may skip the model's
    initialization (``leto.trainer.skip_init``; written by the active trainer)."""
    return f"leto/rank{rank}/skip_init"


# Why parked shadows no longer run the script's set-up ahead in this job (a shadow's
# set-up failed there, or a rank had no room: ``leto.trainer.run_ahead``).
RUN_AHEAD_OFF = "leto/run_ahead_off"


def run_ahead(gen: int, attempt: str) -> str:
    """Counter: shadows of ``gen`` (process-group attempt ``attempt``) ready to run the
    script's set-up ahead; they do once it reaches the world size."""
    return f"leto/gen{gen}/run_ahead/{attempt}"


def ahead_settled(gen: int, rank: int) -> str:
    """Set by ``gen``'s L3 shadow of ``rank`` once it has run the script's set-up ahead to
    where it waits for its promotion, or found it will not (the reason): a fault plan's
    ``when: parked`` waits for it too (``leto.trainer.run_ahead``)."""
    return f"leto/gen{gen}/rank{rank}/ahead_settled"


def pace(gen: int, rank: int) -> str:
    """JSON: the iteration a trainer of ``gen`` has in progress, when it began, its
    steady iteration time and how many it has finished
    (``leto.trainer.first_iteration.Pace``; written every beat)."""
    return f"leto/gen{gen}/rank{rank}/pace"


def resumed(gen: int, rank: int) -> str:
    """JSON: a promoted or restarted trainer's recovery timings (written by it)."""
    return f"leto/gen{gen}/rank{rank}/resumed"


def imports(rank: int) -> str:
    """JSON: the modules ``rank``'s trainers imported after ``leto.init()`` began, by the
    end of their first iteration (written by them; its next shadows import them ahead:
    ``leto.trainer.imports``). Job-wide: a script imports the same at every generation."""
    return f"leto/rank{rank}/imports"


def parked(gen: int, rank: int) -> str:
    """JSON: a shadow has parked (its pid and level)."""
    return f"leto/gen{gen}/rank{rank}/parked"


def shadows_wanted(gen: int) -> str:
    """Set by a trainer of ``gen`` that waits for its successors' shadows to park (a
    fault plan's ``when: parked``): the agent starts them now, not after the held-back
    start's second iteration (which the waiting trainer would never reach)."""
    return f"leto/gen{gen}/shadows_wanted"


def memory(gen: int, rank: int) -> str:
    """JSON: the trainer's latest device-memory report (preinitialization)."""
    return f"leto/gen{gen}/rank{rank}/memory"


def reclaims(gen: int, rank: int) -> str:
    """Counter/records: reclamations of the rank's shadow by its allocation hook."""
    return f"leto/gen{gen}/rank{rank}/reclaims"


def level(gen: int, rank: int) -> str:
    """A rank's proposed shadow level for ``gen`` (preinitialization controller)."""
    return f"leto/gen{gen}/level/rank{rank}"


def levels(gen: int) -> str:
    """The job-wide shadow level agreed for ``gen``."""
    return f"leto/gen{gen}/levels"


def pg_prefix(gen: int, attempt: str) -> str:
    """Where generation ``gen``'s trainers form their process group (``attempt``:
    "<checkpoint fallbacks>.<L3 shadow restarts>")."""
    return f"leto/gen{gen}/pg{attempt}/"
