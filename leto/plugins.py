"""The seam tools plug into: fault points, fault arming, page loss.

Runs in every Leto process (trainer, shadow, agent). Leto never imports its tools:
faultkit (fault injection) registers itself here when it is loaded, and Leto only calls
what is registered. Nothing registered costs one global lookup per fault point.

Plugins are modules named in ``LETO_PLUGINS`` (comma-separated), imported by
``load()`` at a process's start (``leto.init`` in a trainer, ``leto run`` in the agent);
``faultkit.job`` names ``faultkit.hooks`` for the jobs it starts, and ``leto run``
names it when given a fault plan. A plugin module registers at import with
``install_point_handler``, ``install_arm``, ``install_page_loss`` and
``install_iteration_observer`` (the verifiers, under ``leto run --verify``) and
``install_shadow_warmup`` (what a tool sets up once per process — e.g. the verifiers'
pinned staging buffers — done by a parked shadow instead of a promoted trainer).

The names of the points a trainer passes are here too (``POINTS``), so the updater and
the tools agree on them without importing each other.

Not covered: several plugins handling the same point (the last one installed wins).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

ENV_PLUGINS = "LETO_PLUGINS"
FAULT_PLUGIN = "faultkit.hooks"  # what leto run loads for a fault plan (by name only)
VERIFY_PLUGIN = "verifiers.plugin"  # what leto run --verify loads (by name only)

# Every named point, in the order an iteration reaches them. The updater's points fire
# once per gradient group (grad_parity), per protection group (update.load/store/tier2)
# or per chunk (the others), so "#N" picks a later one; the rest fire once.
POINTS = (
    "gather",  # ZeRO-1: all-gather of the updated shards (example job)
    "compute.forward",
    "compute.backward",
    "allreduce",
    "grad_parity",
    "sync",
    "update.load",
    "update.undo",
    "update.optimizer",
    "update.parity",
    "update.commit",
    "update.store",
    "update.tier2",
)
# Not a crash point (not in POINTS): where an update's new values are computed, per
# chunk, with the chunk's pages as ``dest`` — the seam of faultkit's silent-data-corruption
# mode (a wrong computation parity agrees with). Where parity has absorbed the values
# already (the fused chunk pass), ``dest`` is a ``Computed``: its ``absorb`` folds a
# change into that parity, as the pass would have had it computed the changed value.
SDC_POINT = "update.computed"


@dataclass(frozen=True)
class Computed:
    """``SDC_POINT``'s ``dest`` where parity absorbed the values as they were computed:
    the chunk's ``pages`` (group order), and ``absorb(old, new)``, which folds the change
    of the chunk's first ``len(old)`` pages (``old`` as they were, ``new`` as they are
    now) into the parity the pass accumulated."""

    pages: list
    absorb: Callable


# Also not a crash point: a rank's local gradient (a bucket of it, or the whole buffer)
# just before it is reduced — after backward, before the all-reduce — with the tensor as
# ``dest``: the seam of faultkit's ``sdc-grad``.
SDC_GRAD_POINT = "grad.computed"
# Outside an iteration: "resume" (key 0) fires once per start, in the middle of a
# recovery — after the pool's pages are rebuilt, before the ranks agree where to resume.
RESUME_POINT = "resume"
ONCE_PER_ITERATION = frozenset(
    {"gather", "compute.forward", "compute.backward", "allreduce", "sync"}
)

# Every name a fault plan's ``at`` may give: the points, the resume and the seams of
# silent corruption (checked before a job starts: a misspelt name never fires).
FAULT_POINTS = (*POINTS, RESUME_POINT, SDC_POINT, SDC_GRAD_POINT)

# The phases a fault plan or schedule names, and the point each strikes at (faultkit
# kills there; a schedule's failures name them).
PHASES = {
    "compute": "compute.backward",
    "allreduce": "allreduce",
    "grad-parity": "grad_parity",
    "sync": "sync",
    "update": "update.optimizer",
    "parity": "update.parity",
    "parity-copy": "update.store",
    "tier2": "update.tier2",
}

_retained: Callable | None = None  # () -> the trainer's state groups (GroupView list)
_model: Callable | None = None  # () -> the trainer's model (leto.Run's)
_observer_factory: Callable | None = None
_shadow_warmups: list[Callable] = []
_point_handler: Callable | None = None
_arm: Callable | None = None
_parked_wait: Callable | None = None
_page_loss: Callable | None = None
_loaded: set[str] = set()


def point(name: str, iteration: int, dest=None) -> None:
    """A named place in an iteration. ``dest``: the tensors a copy in progress here
    writes (a fault tool may garble them). Free when no plugin listens."""
    if _point_handler is not None:
        _point_handler(name, iteration, dest)


def install_iteration_observer(factory: Callable | None) -> None:
    """``factory(rank, out_dir) -> fn``; ``fn(iteration, loss, tensors)`` is called once
    per completed iteration with every retained tensor (verification: the verifiers'
    per-iteration digest). If ``fn`` has a ``final(state)`` method, it is called once
    when the loop is over, on every rank, with the final state: the full parameters
    and this rank's (shard of the) optimizer state (``RetainedTraining.final_state``).
    If it has ``restored(iteration)``, that is called when the rank's state is restored
    from a checkpoint ending at ``iteration`` (the checkpoint fallback)."""
    global _observer_factory
    _observer_factory = factory


def iteration_observer(rank: int, out_dir) -> Callable | None:
    """The registered observer for this rank, or None (verification off)."""
    return _observer_factory(rank, out_dir) if _observer_factory is not None else None


def install_shadow_warmup(fn: Callable) -> None:
    """``fn(device)``: set-up a tool would otherwise do in a trainer's first iteration
    (buffers, threads), run by an L2/L3 shadow while it parks, with the device runtime
    up — so a promotion does not pay it. Must be idempotent and cheap to call again."""
    if fn not in _shadow_warmups:
        _shadow_warmups.append(fn)


def warm_shadow(device) -> list[str]:
    """Run every installed shadow warm-up; returns the failures (``"fn: error"``), each
    of which costs only the head start (the tool sets up lazily as without it)."""
    failed = []
    for fn in _shadow_warmups:
        try:
            fn(device)
        except Exception as e:  # a tool's set-up: never worth losing the shadow over
            failed.append(f"{getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}")
    return failed


def expose_retained(fn: Callable | None) -> None:
    """The updater says where this trainer's retained state lives: ``fn()`` returns its
    state groups (``GroupView``: device pages, host tier 1 and 2). Fault tools read it
    to corrupt real retained bytes (faultkit's ``corrupt`` mode); Leto never calls it."""
    global _retained
    _retained = fn


def retained_groups() -> list:
    """The state groups the updater of this process exposed (empty before it exists)."""
    return _retained() if _retained is not None else []


def expose_model(fn: Callable | None) -> None:
    """``leto.Run`` says which model the trainer trains: ``fn()`` returns it. Fault tools
    hook its modules to make a wrong computation (faultkit's ``sdc-activation``); Leto
    never calls it."""
    global _model
    _model = fn


def exposed_model():
    """The model ``leto.Run`` exposed in this process, or None."""
    return _model() if _model is not None else None


def install_point_handler(fn: Callable | None) -> None:
    global _point_handler
    _point_handler = fn


def install_arm(fn: Callable | None) -> None:
    """``fn(spec, mode, when)``: arm a fault at ``NAME@ITERATION#N`` in this process
    (``when``: "now", or "parked" — see ``wait_parked``)."""
    global _arm
    _arm = fn


def install_parked_wait(fn: Callable | None) -> None:
    """``fn() -> bool``: block until every rank's shadow of the next generation has
    parked (False: it gave up at its time limit). Installed by the trainer's context."""
    global _parked_wait
    _parked_wait = fn


def wait_parked() -> bool | None:
    """What a fault armed with ``when="parked"`` does at its point before it strikes
    (None: no trainer context installed the wait)."""
    return _parked_wait() if _parked_wait is not None else None


def install_page_loss(fn: Callable | None) -> None:
    """``fn(client, pages_per_group, host_parity_pages, rng) -> {"device": n, "host": n}``:
    lose pages of a pool through a client with the faultkit role (agent side)."""
    global _page_loss
    _page_loss = fn


def load(names: str | None = None) -> list[str]:
    """Import the plugin modules named in ``names`` (default ``$LETO_PLUGINS``), once
    each; returns the names loaded now. An unknown module is an error naming it."""
    spec = names if names is not None else os.environ.get(ENV_PLUGINS, "")
    done = []
    for name in (n.strip() for n in spec.split(",")):
        if not name or name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(
                f"{ENV_PLUGINS} names {name!r}, which cannot be imported ({e}); nothing "
                "of it was registered"
            ) from e
        _loaded.add(name)
        done.append(name)
    return done


def arm(spec: str, mode: str, when: str = "now") -> None:
    """Arm a fault in this process through the loaded fault plugin."""
    if _arm is None:
        raise RuntimeError(
            f"a fault ({spec}, {mode}) was asked for but no fault plugin is loaded "
            f"(set {ENV_PLUGINS}={FAULT_PLUGIN})"
        )
    _arm(spec, mode, when)


def lose_pages(client, pages: int, host_parity_pages: int, rng) -> dict:
    """Lose pages of a pool through the loaded fault plugin."""
    if _page_loss is None:
        raise RuntimeError(
            f"a fault plan asks to lose pages but no fault plugin is loaded "
            f"(set {ENV_PLUGINS}={FAULT_PLUGIN})"
        )
    return _page_loss(client, pages, host_parity_pages, rng)
