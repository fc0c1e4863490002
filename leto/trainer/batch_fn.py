"""A script's batch function, retained: ``get_batch = run.batches(get_batch)``.

Runs in a trainer, inside ``leto.Run``. nanoGPT-style loops draw the *next* iteration's
first batch inside the current one (a prefetch before ``backward()``) into a local
variable, and draw the very first one before the loop. A promoted trainer runs that
pre-loop call again, from generators its start-up seeded afresh: it would train
iteration ``n`` on iteration 0's first batch. The wrapper records the global generators'
state (``leto.trainer.rng_state``) before each call, and the state before the last call
of each argument tuple made before the loop is kept with each commit (in the data
record, ``leto.trainer.data_state``). In a trainer that resumes at ``n``, a call made
before ``run.iterations()`` starts is run from the state the failed trainer had before
its last call with the same arguments up to ``n - 1``'s commit — it returns that batch
(the prefetch the loop variable held) — and ``run.iterations()`` then sets ``n - 1``'s
committed states as before, so the draws of ``n`` onwards are the failed trainer's too.

The function must be a function of its arguments and the global generators (nanoGPT's
``get_batch``: ``torch.randint`` offsets into a memory-mapped file); a loader with a
position of its own is retained through ``data=`` instead. Only the argument tuples
called before the loop are recorded (nanoGPT: ``('train',)``), each as one generator
state (about 20 KB pickled).
"""

from __future__ import annotations

from collections.abc import Callable

from leto.trainer.rng_state import GlobalRNG


class BatchFunctions:
    """The wrapped batch functions as one ``state_dict``/``load_state_dict`` object."""

    def __init__(self, rng: GlobalRNG):
        self.rng = rng
        self.fns: list[_Retained] = []
        self.started = False  # run.iterations() has begun
        self._pending: list[dict] | None = None  # a recovery's record, until the loop

    def wrap(self, fn: Callable) -> Callable:
        w = _Retained(self, len(self.fns), fn)
        self.fns.append(w)
        return w

    def state_dict(self) -> list[dict]:
        # Only what a promoted trainer's pre-loop calls need: the state before the
        # last call of each argument tuple the script also calls before its loop.
        return [{k: w.last[k] for k in w.before_loop if k in w.last} for w in self.fns]

    def load_state_dict(self, sd: list[dict]) -> None:
        self._pending = sd

    def start(self) -> None:
        """The loop begins: later calls draw from the generators as they stand."""
        self.started, self._pending = True, None

    def recorded(self, i: int, key: str) -> dict | None:
        """A recovery's generator state before the failed trainer's last call ``key`` of
        function ``i`` (None on a fresh start, or when it never made that call)."""
        if self.started or self._pending is None or i >= len(self._pending):
            return None
        return self._pending[i].get(key)


class _Retained:
    def __init__(self, owner: BatchFunctions, index: int, fn: Callable):
        self.owner, self.index, self.fn = owner, index, fn
        self.last: dict[str, dict] = {}  # argument tuple -> generator state before its last call
        self.before_loop: set[str] = set()  # argument tuples called before the loop
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__name__ = getattr(fn, "__name__", "batch function")

    def __call__(self, *args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        o = self.owner
        if not o.started:
            self.before_loop.add(key)
            state = o.recorded(self.index, key)
            if state is not None:
                # A promoted trainer's pre-loop call: the batch the failed trainer drew
                # last with these arguments (its prefetch), from the state it drew it in.
                o.rng.set_now(state)
                self.last[key] = state
                return self.fn(*args, **kwargs)
        self.last[key] = o.rng.state_dict()
        return self.fn(*args, **kwargs)
