"""The modules a trainer imports on its way to training: timed as they load, learned
from the active trainer, and imported ahead by a parked shadow.

Runs in trainers and shadows. torch and the script's own libraries import much lazily —
``torch._dynamo`` behind every ``torch.optim`` optimizer's first method call (1.05 s on
an idle core here, 3.65 s of a 3.87 s recovery on two busy ones: issue 37), a model
library's pieces as the model is built, Leto's checkpoint module as ``leto.Run`` makes
its checkpointer. A process that starts training pays for them in its first iteration;
a promoted shadow should not, since that is the recovery's critical path.

* ``ImportWatch``: a ``sys.meta_path`` finder that times every module imported while it
  is installed (find, create and execute, with the modules it imports in turn) and
  lists the outermost imports — the lazy-import events — in the order they began. An
  active trainer watches from ``leto.init()`` to the end of its first iteration and
  publishes what it imported (``publish``: the store key ``keys.imports``); a promoted
  trainer watches from its promotion to the end of its first iteration, and its
  recovery record lists what it still had to import (``promoted_imports``).
* ``warm_imports``: what a parked shadow imports before it parks — torch's lazy path
  exercised (a throwaway optimizer of each class Leto runs), Leto's own lazy modules on
  the promoted path, and whatever this rank's trainers published — with every RNG
  state restored afterwards. ``import_learned`` imports what was published later, while
  the shadow is parked.

Not covered: imports whose result depends on state set after ``leto.init()`` (an
environment variable the script sets later is not seen by the shadow's import), or that
start threads or processes (they run in the parked shadow too); a module that fails to
import ahead is reported and left to the trainer; a module the script imports by a name
that changes from run to run is never ahead. A trainer that never ends a first
iteration under ``leto.Run`` (no second heartbeat, no loop end) keeps its watch
installed: one call per later import, nothing else.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pickle
import random
import sys
import threading
import time

import torch

from leto.job import keys

# Leto's modules that a promoted trainer imports lazily, each with its reason. Every
# other lazy import on that path is torch's (exercised in ``_exercise_torch``) or the
# script's (learned from its active trainer).
LAZY_LETO = (
    # leto.Run makes its checkpointer right after its resume (Context.checkpointer), and
    # the checkpoint fallback restores through it: torch.distributed.checkpoint, 0.04-0.13 s
    # in a promoted trainer's first iteration on the 2-core CPU VM.
    "leto.trainer.checkpoint",
)


class ImportWatch:
    """A ``sys.meta_path`` finder (first in the list while installed) that times the
    modules imported in the meantime. Each import is timed from its finder's search to
    the end of its module's execution, including the imports it makes; the imports made
    while no other is in progress on the same thread are the outermost (``imports``).

    It finds nothing itself: the other finders find the spec, whose loader it wraps for
    the import's duration (the module executes with its own loader as ``__loader__``
    and ``__spec__.loader``). A module that is not found, or fails as it executes, is
    not listed. Cost: one extra call per module not yet in ``sys.modules``; nothing for
    those that are."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._local = threading.local()  # per thread: the stack of imports in progress
        self._lock = threading.Lock()
        self._records: list[dict] = []  # every import begun, in order
        self.installed = False

    def start(self) -> ImportWatch:
        if not self.installed:
            sys.meta_path.insert(0, self)
            self.installed = True
        return self

    def stop(self) -> list[dict]:
        """Uninstall; the outermost imports (``imports``)."""
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        self.installed = False
        return self.imports

    @property
    def imports(self) -> list[dict]:
        """``{"module", "s", "modules"}`` per outermost import that completed, in the
        order they began: ``s`` its time (seconds, the modules it imported included),
        ``modules`` how many modules it brought in (itself included)."""
        with self._lock:
            return [
                {"module": r["module"], "s": r["s"], "modules": r["modules"]}
                for r in self._records
                if r["depth"] == 0 and r["s"] is not None
            ]

    @property
    def modules(self) -> list[str]:
        """Every module imported while installed (outermost and nested), in order."""
        with self._lock:
            return [r["module"] for r in self._records if r["s"] is not None]

    # -- the finder protocol ----------------------------------------------------------

    def find_spec(self, name, path=None, target=None):
        t0 = self.clock()
        stack = self._stack()
        spec = None
        try:
            at = sys.meta_path.index(self)
        except ValueError:  # uninstalled by another thread meanwhile
            return None
        for finder in sys.meta_path[at + 1 :]:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not found, or a legacy loader: loaded untimed
        rec = {"module": name, "t0": t0, "s": None, "depth": len(stack), "modules": 1}
        with self._lock:
            self._records.append(rec)
        spec.loader = _TimedLoader(self, loader, rec)
        return spec

    def _stack(self) -> list[dict]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, rec: dict) -> None:
        self._stack().append(rec)

    def _leave(self, rec: dict, ok: bool) -> None:
        stack = self._stack()
        if stack and stack[-1] is rec:
            stack.pop()
        if ok:
            rec["s"] = self.clock() - rec["t0"]
            for outer in stack:  # the imports this one ran inside
                outer["modules"] += 1


class _TimedLoader:
    """The real loader, timed (``ImportWatch``); restored on the module before it runs."""

    def __init__(self, watch: ImportWatch, loader, rec: dict):
        self._watch, self._loader, self._rec = watch, loader, rec

    def __getattr__(self, name):  # anything else the import system asks of the loader
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # The module runs with its own loader, as if unwatched.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._watch._enter(self._rec)
        ok = False
        try:
            self._loader.exec_module(module)
            ok = True
        finally:
            self._watch._leave(self._rec, ok)


# -- learned from the trainers -----------------------------------------------------------


def publish(store, rank: int, imports: list[dict]) -> None:
    """Add the outermost modules a trainer of ``rank`` imported after ``leto.init()`` began
    (its first iteration included) to the rank's published list, for the next shadows."""
    names = [r["module"] for r in imports if r["module"] != "__main__"]
    if not names:
        return  # (a promoted trainer whose shadow imported everything ahead: no request)
    known = learned(store, rank)
    if new := [n for n in names if n not in known]:
        store.set(keys.imports(rank), json.dumps(known + new))


def learned(store, rank: int) -> list[str]:
    """The modules this rank's trainers published (empty: none yet)."""
    key = keys.imports(rank)
    if not store.check([key]):
        return []
    return json.loads(store.get(key))


# -- imported ahead in a shadow ------------------------------------------------------------


@contextlib.contextmanager
def _rng_kept(device: torch.device):
    """Every RNG a training script draws from is as before, whatever ran inside: torch's
    CPU generator (and ``device``'s, once CUDA is initialized), Python's and numpy's
    global ones (an import may draw, e.g. to build a constant)."""
    np = sys.modules.get("numpy")
    py = random.getstate()
    nps = np.random.get_state() if np is not None else None
    cuda = device.type == "cuda" and torch.cuda.is_initialized()
    devices = [device] if cuda else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            if nps is not None:
                np.random.set_state(nps)


def _exercise_torch() -> None:
    """torch's own lazy path, by the calls a script's first iteration makes: an
    optimizer's first method call imports ``torch._dynamo`` (``torch._disable_dynamo``),
    whichever optimizer it is — a throwaway one of each class Leto runs, so a lazy
    import torch adds behind any of them comes along."""
    classes = [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD]
    if hasattr(torch.optim, "Muon"):
        classes.append(torch.optim.Muon)
    for cls in classes:
        p = torch.zeros(2, 2, requires_grad=True)
        opt = cls([p], lr=0.1)
        opt.zero_grad(set_to_none=True)
        opt.state_dict()
    # What the script's LR scheduler and loss scaling construct.
    torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([p], lr=0.1), lambda t: 1.0)
    torch.amp.GradScaler("cpu", enabled=False)
    # A recovery unpickles the data record (leto.Run's data=: a StatefulDataLoader's
    # state holds its generator's tensor): a tensor's unpickling imports
    # torch.utils.serialization.
    pickle.loads(pickle.dumps(torch.zeros(1)))


def import_all(names) -> tuple[list[str], list[str]]:
    """Import each of ``names`` not yet loaded; (those it imported, failures as
    "name: error")."""
    done, failed = [], []
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as e:  # the trainer will meet (and report) it; not fatal here
            failed.append(f"{name}: {type(e).__name__}: {e}")
    return done, failed


def _report(rank: int, learned_now: list[str], failed: list[str]) -> None:
    if learned_now:
        print(
            f"rank {rank}: shadow: imported ahead what its trainers imported: "
            f"{', '.join(learned_now)}",
            file=sys.stderr,
            flush=True,
        )
    if failed:
        print(f"rank {rank}: shadow: not imported ahead: {failed}", file=sys.stderr, flush=True)


def warm_imports(store, rank: int, device: torch.device) -> dict:
    """A shadow's imports before it parks (RNG states restored); its timings: the time
    (``imports_warmup_s``), the modules this rank's trainers published that it imported
    (``imports_learned``: -1 when none was published yet, see ``import_learned``)."""
    t0 = time.time()
    failed = []
    with _rng_kept(device):
        try:
            _exercise_torch()
        except Exception as e:  # a torch without one of them: only the head start lost
            failed.append(f"torch.optim: {type(e).__name__}: {e}")
        failed += import_all(LAZY_LETO)[1]
        names = learned(store, rank)
        done, bad = import_all(names)
        failed += bad
    out = {"imports_warmup_s": time.time() - t0, "imports_learned": len(done) if names else -1}
    _report(rank, done, failed)
    if failed:
        out["imports_warmup_failed"] = failed
    return out


def import_learned(store, rank: int, device: torch.device, timings: dict) -> bool:
    """While parked: import what this rank's trainers published since (once; True when
    done, or nothing left to wait for). Adds its time to ``timings``."""
    if timings.get("imports_learned", -1) >= 0:
        return True
    names = learned(store, rank)
    if not names:
        return False
    t0 = time.time()
    with _rng_kept(device):
        done, failed = import_all(names)
    timings["imports_learned"] = len(done)
    timings["imports_learned_s"] = time.time() - t0
    _report(rank, done, failed)
    if failed:
        timings.setdefault("imports_warmup_failed", []).extend(failed)
    return True
