"""A parked L3 shadow runs the script's set-up ahead of its promotion (issue 57 item 3).

Runs in a shadow trainer at L3. A promoted trainer runs the script again from
``leto.init()``'s return: its model, optimizer, scheduler and data set-up, then
``leto.Run`` binds the retained state. At L3 the shadow already has everything the script
needs there (the device, its process group with the other ranks' shadows), so once its
rank's active trainer has begun an iteration (the pool then holds the state that every
value the set-up computes is replaced by) ``leto.init()`` returns *before* the promotion
and the script's set-up runs while the shadow is still parked; the promotion is awaited
at the first point where running ahead could change something outside this process:

* ``leto.Run`` (or the loop's first heartbeat, for a script without it) — the goal;
* a file opened for writing, appending or creating, or removed, renamed, truncated,
  linked or made (``os.mkdir`` of a folder that exists goes ahead: it changes nothing) —
  the live trainer may own it (a log opened with ``"w"`` would be emptied);
* a network connection or listening socket, a subprocess, ``os.fork``;
* a ``torch.distributed`` collective or new group that some rank's shadow will not
  reach ahead. The shadows' process group is their own (the live trainers never see
  it), so a collective that every rank's shadow reaches runs ahead: Megatron-Core's
  set-up begins with ``initialize_model_parallel``'s dozens of ``new_group`` calls, and
  its DDP and distributed optimizer broadcast and gather while they are built. Each
  shadow counts its collectives; at its k-th it says so in the store and goes on once
  every rank's shadow has reached its k-th (``Ahead._agree``). Where one has stopped
  instead (at a file, at ``leto.Run``) or a promotion came, it waits for the promotion
  there and then makes the call, as the stopped one will once promoted: no shadow is
  ever left inside a collective its peers do not make.

Those are Python's audit events (``sys.addaudithook``) raised by any code but Leto's,
faultkit's and the verifiers' (a ``.pyc`` an import writes is ignored). The script's
output to ``sys.stdout``/``sys.stderr`` while running ahead is held and written at the
promotion, where a promoted trainer's set-up would have written it. The parameters are
built with ``leto.trainer.skip_init``'s mode where the active trainer found that safe
(uninitialized memory; as written otherwise), so running ahead holds one model's worth of
device memory: it runs only where free device memory (host memory on the CPU) exceeds
the pool's retained bytes by ``MARGIN_BYTES``, and every rank's shadow runs ahead or none
does (they agree in the store), so a collective the check cannot see meets its peers.

A script whose set-up raises while running ahead ends the shadow: its log has the
error, the job's later shadows park at ``leto.init()`` (``keys.RUN_AHEAD_OFF``), and it
exits as a recoverable failure (``EXIT_RECOVERABLE``), never a script error: parked, the
agent replaces it as any dead parked shadow; promoted meanwhile (a failure came while
it ran ahead), its rank is recovered again. ``LETO_RUN_AHEAD=0`` turns it off.

Not covered: C code's side effects (a library writing a file from C, CUDA IPC), output
written to the file descriptors directly, a script that ends without ``leto.Run`` or a
heartbeat, names a script bound from ``torch.distributed`` before ``leto.init()``.
"""

from __future__ import annotations

import io
import json
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from leto import rank_log
from leto.errors import EXIT_RECOVERABLE
from leto.job import keys
from leto.trainer import shape_warmup, staging

ENV_RUN_AHEAD = "LETO_RUN_AHEAD"
GiB = 1 << 30
MARGIN_BYTES = 2 * GiB  # beside the model the set-up builds: its buffers, the allocator's slack

# Collectives and groups (torch.distributed and distributed_c10d, where the script's
# ``dist.`` calls land).
COLLECTIVES = (
    "all_reduce all_gather all_gather_object all_gather_into_tensor all_to_all "
    "all_to_all_single barrier monitored_barrier broadcast broadcast_object_list gather "
    "gather_object reduce reduce_scatter reduce_scatter_tensor scatter scatter_object_list "
    "send recv isend irecv batch_isend_irecv new_group new_subgroups"
).split()
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGES = {
    "os.remove": "removes",
    "os.rename": "renames",
    "os.rmdir": "removes the folder",
    "os.truncate": "truncates",
    "os.link": "links",
    "os.symlink": "links",
    "os.chmod": "changes the mode of",
    "os.chown": "changes the owner of",
    "shutil.rmtree": "removes the tree",
    "os.mkdir": "makes the folder",
}
_PROCESSES = {
    "subprocess.Popen": "starts a subprocess",
    "os.system": "runs a shell command",
    "os.exec": "replaces the process",
    "os.posix_spawn": "starts a process",
    "os.spawn": "starts a process",
    "os.fork": "forks",
    "socket.connect": "opens a network connection",
    "socket.bind": "listens on a socket",
    "urllib.Request": "opens a URL",
}
_OURS = tuple(
    str(Path(__file__).resolve().parents[2] / d) for d in ("leto", "faultkit", "verifiers")
)
# Where the standard library and installed packages live: their frames act for their caller.
_LIBRARIES = tuple(
    sorted(
        {
            os.path.realpath(sysconfig.get_paths()[k])
            for k in ("stdlib", "platstdlib", "purelib", "platlib")
        }
    )
)
_state: dict = {"ahead": None, "hooked": False, "ran": False}


def running() -> bool:
    """Whether this process ran the script's set-up ahead: it must not unwind through
    the script's code when its agent lets it go (its ``finally`` blocks and ``atexit``
    handlers would write what the live trainer owns)."""
    return _state["ran"]


def wanted(level: str) -> bool:
    return level == "L3" and os.environ.get(ENV_RUN_AHEAD, "1") != "0"


def room(device: torch.device, retained_bytes: int | None) -> tuple[bool, str]:
    """Whether this rank can hold the set-up's model beside the live trainer, and why
    (``retained_bytes`` None: the pool was not premapped, its size is not known here)."""
    if retained_bytes is None:
        return (
            False,
            "the pool was not premapped (LETO_PREMAP=0): the room the set-up needs is not known",
        )
    need = retained_bytes + MARGIN_BYTES
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        where = "device"
    else:
        free = staging.available_bytes() or 0  # (unknown: no room)
        where = "host"
    if free < need:
        return False, (
            f"{where} free memory {free / GiB:.1f} GiB is below the {need / GiB:.1f} GiB the "
            f"set-up's model and a margin need"
        )
    return True, f"{where} free memory {free / GiB:.1f} GiB"


class Gate:
    """When a parked shadow may run ahead: its trainer has finished an iteration since
    the shadow parked, the job has not turned running ahead off, it has room, and every
    rank's shadow agreed. Checked every 0.2 s of the park (a few store reads), never
    blocking it."""

    def __init__(
        self, store, generation: int, attempt: str, rank: int, world: int, device, retained_bytes
    ):
        self.store, self.generation, self.rank, self.world = store, generation, rank, world
        self.key = keys.run_ahead(generation, attempt)  # (restarted L3 shadows count anew)
        self.device, self.retained_bytes = device, retained_bytes
        self.said: str | None = None  # why it does not run ahead (said once)
        self.offered = False
        self.first_pace: bytes | None = None  # the trainer's pace when first seen
        self.paced = False  # it has moved since

    def open(self) -> bool:
        """Two store reads a call until the trainer's pace moved, then two or three (every
        parked shadow of the job polls: few reads, and none once decided)."""
        if self.said is not None:
            return False
        s = self.store
        if not self.paced:
            # Its trainer began an iteration (the pool holds the state), and has finished
            # one (its pace says so, or moved since): the device memory the trainer holds
            # is its peak (its allocator keeps it), and what is free now is free for the
            # set-up.
            pace = keys.pace(self.generation - 1, self.rank)
            if not s.check([pace]):
                return False
            now = s.get(pace)
            if self.first_pace is None:
                self.first_pace = now
            if now == self.first_pace and json.loads(now).get("done", 0) < 1:
                return False
            self.paced = True
        if s.check([keys.RUN_AHEAD_OFF]):
            self._no(f"turned off for this job: {s.get(keys.RUN_AHEAD_OFF).decode()}")
            return False
        if not self.offered:
            ok, why = room(self.device, self.retained_bytes())
            if not ok:
                self._no(why)
                s.set(keys.RUN_AHEAD_OFF, f"rank {self.rank}: {why}")
                return False
            self.offered = True
            s.add(self.key, 1)
        return int(s.add(self.key, 0)) >= self.world

    def _no(self, why: str) -> None:
        self.said = why
        rank_log.say(self.rank, f"shadow: parks at leto.init() ({why})")
        self.store.set(keys.ahead_settled(self.generation, self.rank), f"parks: {why}")


class Ahead:
    """The script's set-up running ahead; ``reach(what)`` awaits the promotion."""

    def __init__(
        self, rank: int, promote: Callable[[], None], store=None, device=None, promoting=None,
        world: int = 1, key: str | None = None, settled_key: str | None = None,
    ):  # fmt: skip
        self.rank, self.world = rank, world
        self.settled_key = settled_key  # said once it waits for its promotion (or failed)
        # Where the shadows agree on collectives (``key``: the Gate's; None: a collective
        # always waits for the promotion).
        self.key = key
        self.collectives = 0  # made ahead (each agreed by every rank's shadow)
        self.promoting = promoting or (lambda: False)  # the promotion came: no warm-up
        self.store = store  # where a failure turns running ahead off for the job
        self.device = device  # where the script's model is warmed up (None: not)
        self.warmup: dict = {}  # leto.trainer.shape_warmup's timings
        self._promote = promote
        self._lock = threading.Lock()
        self.t0 = time.time()
        self.stopped_at: str | None = None  # what the set-up reached first
        self.promoted = False
        self._saved: dict = {}
        self._held = (_Held(sys.stdout), _Held(sys.stderr))
        self._streams = None  # the script's own (``start``)

    def start(self) -> None:
        _state["ahead"] = self
        _state["ran"] = True
        if not _state["hooked"]:
            sys.addaudithook(_hook)
            _state["hooked"] = True
        for mod in (dist, dist.distributed_c10d):
            for name in COLLECTIVES:
                fn = getattr(mod, name, None)
                if fn is not None:
                    self._saved[(mod, name)] = fn
                    setattr(mod, name, _waits_for_promotion(self, name, fn))
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = self._held
        previous = sys.excepthook

        def hook(kind, value, tb):  # the set-up failed while running ahead
            if _state["ahead"] is not self:
                previous(kind, value, tb)
                return
            self.failed(f"the set-up raised {kind.__name__}: {value}")
            previous(kind, value, tb)  # its traceback in the log, its error file
            # Not the script's error as its trainers run it (running ahead raised it): a
            # failure to recover from, never a script error that stops the job — this
            # shadow may have been promoted meanwhile (the promotion waits in its pipe).
            sys.stderr.flush()
            os._exit(EXIT_RECOVERABLE)

        self._excepthook = previous
        sys.excepthook = hook

    def reach(self, what: str) -> None:
        """The set-up reached ``what``: wait for the promotion here (once; later calls
        and other threads return when it is done). The held output is written after it."""
        with self._lock:
            if self.promoted:
                return
            self.stopped_at = what
            if self.store is not None and self.key is not None:
                # Its peers' shadows must not wait for it at a collective it will make only
                # once promoted.
                self.store.set(self._stopped_key, f"rank {self.rank}: {what}")
            self._settled(f"ran ahead: {what}")
            self.ran_s = time.time() - self.t0
            if self.device is not None:
                # The script's model, once at its trainer's shapes, before waiting (the
                # audit and the collectives stop it where it would act outside).
                self.warmup = shape_warmup.warm(
                    self.store, self.rank, self.device, sys._getframe(1), self.promoting
                )
            self._unhook()
            try:
                self._promote()  # parks, then promotes (leto.trainer.api)
            except Exception as e:
                # Not the script's error, but ending this shadow all the same: the job's
                # next shadows must not meet it again.
                self.failed(f"its promotion raised {type(e).__name__}: {e}")
                raise
            finally:
                self._release()
            self.promoted = True

    @property
    def _stopped_key(self) -> str:
        return f"{self.key}/stopped"

    def collective(self, name: str, fn, args, kwargs):
        """The script's ``torch.distributed.<name>`` while running ahead: made now when every
        rank's shadow reaches it (``_agree``), else after the promotion."""
        shape_warmup.refuse(f"calls torch.distributed.{name}")  # (inside the warm-up)
        if not self.promoted and self._agree():
            return fn(*args, **kwargs)
        self.reach(f"calls torch.distributed.{name}")
        return fn(*args, **kwargs)

    POLL_S = 0.002  # between store reads while peers are on their way (up to 16x that)
    # How long it waits for its peers' shadows at a collective before it stops there
    # instead (stopping is always safe: the others then stop too, none being inside it).
    AGREE_TIMEOUT_S = 300.0

    def _agree(self) -> bool:
        """Whether every rank's shadow reached this collective (its k-th) ahead: polled
        until they have, or one stopped before it, or this shadow's promotion came. The
        count is read before the stop, and only reaches the world size once every shadow
        has counted itself there, so one shadow seeing it full means each will: none goes
        in alone. (A shadow that counted itself and then stops makes the call after its
        promotion, as the others do.)"""
        if self.store is None or self.key is None:
            return False
        k = self.collectives
        self.collectives += 1
        here = f"{self.key}/collective/{k}"
        s = self.store
        s.add(here, 1)
        poll = self.POLL_S
        deadline = time.monotonic() + self.AGREE_TIMEOUT_S
        while True:
            if int(s.add(here, 0)) >= self.world:
                return True
            # (one key a check: a store's check of several is true only if all are set)
            stopped = s.check([self._stopped_key]) or s.check([keys.RUN_AHEAD_OFF])
            if stopped or self.promoting():
                return int(s.add(here, 0)) >= self.world
            if time.monotonic() > deadline:
                rank_log.say(self.rank, f"shadow: waited {self.AGREE_TIMEOUT_S:g} s for the other "
                             f"ranks' shadows at collective {k}; waits for its promotion "
                             "there")  # fmt: skip
                return False
            time.sleep(poll)
            poll = min(poll * 2, 16 * self.POLL_S)

    def _settled(self, how: str) -> None:
        if self.store is not None and self.settled_key is not None:
            self.store.set(self.settled_key, how)

    def failed(self, why: str) -> None:
        self._unhook()
        self._release()
        if self.store is not None:
            self.store.set(keys.RUN_AHEAD_OFF, f"rank {self.rank}: {why}")
            self._settled(f"failed: {why}")
        rank_log.say(
            self.rank,
            f"shadow: running the script's set-up ahead failed ({why}); this job's next "
            f"shadows park at leto.init() ({ENV_RUN_AHEAD}=0 turns it off)",
        )

    def _unhook(self) -> None:
        if _state["ahead"] is not self:
            return
        _state["ahead"] = None
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        sys.excepthook = self._excepthook

    def _release(self) -> None:
        if self._streams is None:  # (never started)
            return
        if sys.stdout is self._held[0]:
            sys.stdout, sys.stderr = self._streams
        for held, stream in zip(self._held, self._streams, strict=True):
            held.release(stream)


def _waits_for_promotion(ahead: Ahead, name: str, fn):
    def call(*args, **kwargs):
        return ahead.collective(name, fn, args, kwargs)

    call.__wrapped__ = fn
    return call


class _Held(io.TextIOBase):
    """The script's output while running ahead, written out at the promotion."""

    def __init__(self, stream):
        self._stream = stream
        self._parts: list[str] = []

    def write(self, s: str) -> int:
        self._parts.append(s)
        return len(s)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")

    @property
    def buffer(self):
        # Bytes written past the text layer (rare in a set-up) are not held.
        return self._stream.buffer

    def release(self, stream) -> None:
        parts, self._parts = self._parts, []
        if parts:
            stream.write("".join(parts))
            stream.flush()


def _hook(event: str, args: tuple) -> None:
    ahead = _state["ahead"]
    if ahead is None:
        return
    what = _side_effect(event, args)
    if what is None:
        return
    shape_warmup.refuse(what)  # inside the warm-up (Leto's frames on the stack): stop there
    if _ours():
        return
    ahead.reach(what)


def _side_effect(event: str, args: tuple) -> str | None:
    """What the event would change outside this process, or None."""
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        if isinstance(mode, str):
            writes = any(c in mode for c in "wax+")
        else:
            writes = isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
        if not writes or not isinstance(path, (str, bytes, os.PathLike)):
            return None
        p = os.fsdecode(path)
        if "__pycache__" in p or p == os.devnull:
            return None
        return f"opens {p} for writing"
    if event in _CHANGES:
        path = args[0] if args else None
        if event == "os.mkdir":
            try:
                if os.path.isdir(os.fsdecode(path)):
                    return None  # (makedirs(exist_ok=True) of a folder that is there)
            except (TypeError, ValueError):
                pass
        return f"{_CHANGES[event]} {os.fsdecode(path) if path is not None else ''}".strip()
    if event in _PROCESSES:
        return _PROCESSES[event]
    return None


def _ours() -> bool:
    """Whether the event is Leto's, faultkit's or the verifiers' doing (a rank log line,
    the park's own requests), not the script's: the innermost frame that is neither the
    standard library's nor an installed package's (torch's ``save``, say, works for
    whoever called it) decides. Leto's own frames are below the script's in every
    trainer (its launcher runs the script), so *any* of ours on the stack is not the
    test."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith("<"):
            path = os.path.realpath(name)
            if path.startswith(_OURS):
                return True
            if not path.startswith(_LIBRARIES):
                return False  # the script's own code (or a module beside it)
        f = f.f_back
    return False
