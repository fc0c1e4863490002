"""The allocation-path hook: reclaim the shadow's device memory before an allocation of
the active trainer fails (paper §6), so no OOM is raised.

Runs in the active trainer. ``reclaim.cpp`` is the hook: a ``c10::FreeMemoryCallback``
that PyTorch's caching allocator runs on every cache miss, before it asks the driver for
a new segment. When a shadow is armed and device free memory is below
``reclaim_below_bytes``, it SIGKILLs the shadow (through a pidfd: a recycled PID is never
hit), waits until device free memory really rose — by ``expected_release_bytes``, or the
process is gone and free memory rose and then stopped changing for ``settle_s`` — or
``timeout_s`` passed, records an event, and returns; the allocator's segment allocation that follows
then finds the memory. The hook disarms itself after one reclamation.

Three implementations, one API (``arm``, ``disarm``, ``events``, ``stats``, ``reset``):

* ``install_cuda_hook()`` → ``NativeReclaimer`` over the CUDA build (probe:
  ``cudaMemGetInfo`` on the armed device). GPU only; imported and built lazily.
* ``NativeReclaimer.cpu_build(probe)`` — the same C++ without torch/CUDA; the test calls
  ``on_cache_miss()`` where the allocator would, ``probe()`` returns free bytes.
* ``Reclaimer(probe)`` — the slow, obviously-correct Python twin of the C++ logic, so
  CI exercises the decisions on the CPU (``EmulatedDevice`` plays the GPU: processes hold
  bytes until they exit).

Wiring (in the active trainer, once per shadow launched)::

    hook = install_cuda_hook()                       # once per process (~seconds)
    hook.arm(shadow_pid, device=local_rank,
             expected_release_bytes=footprint_of_its_level,
             reclaim_below_bytes=policy_cfg.reclaim_below_bytes)
    ...                                              # train; the hook may fire
    for ev in hook.events(since=seen): ...           # at an iteration boundary: report

Not covered / caveats: the callback does not see the request's size, so a single
allocation larger than ``reclaim_below_bytes`` that meets a device with more free memory
than the gate but less than the request still OOMs (set the gate above the largest
allocation). ``set_per_process_memory_fraction`` caps are not helped (the cap counts
this process only). A shadow must be a single process. The hook runs under the allocator
mutex: other threads' allocations on that device wait up to ``timeout_s``.
"""

from __future__ import annotations

import ctypes
import enum
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leto.errors import InvalidInput
from leto.native import build_shared, compiler

SOURCE = Path(__file__).with_name("reclaim.cpp")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SETTLE_S = 0.05
DEFAULT_POLL_S = 0.001


class Outcome(str, enum.Enum):
    RELEASED = "released"  # device free memory rose by expected_release_bytes
    EXITED = "exited"  # the process is gone; free memory rose, then settled short of the estimate
    TIMEOUT = "timeout"  # neither within timeout_s: the allocation may still fail
    KILL_FAILED = "kill_failed"  # the signal could not be sent (permissions)


_OUTCOME_CODES = {
    1: Outcome.RELEASED,
    2: Outcome.EXITED,
    3: Outcome.TIMEOUT,
    4: Outcome.KILL_FAILED,
}


@dataclass(frozen=True)
class ReclaimEvent:
    wall_time_s: float  # time.time() at the cache miss that fired it
    latency_s: float  # kill sent → wait over
    exit_latency_s: float | None  # kill sent → exit observed (0: had already exited)
    free_before_bytes: int
    free_after_bytes: int
    pid: int
    outcome: Outcome
    killed: bool  # False: the shadow had already exited, no signal was sent

    @property
    def released_bytes(self) -> int:
        return self.free_after_bytes - self.free_before_bytes


@dataclass(frozen=True)
class ReclaimStats:
    calls: int  # cache misses seen while armed
    pressure_checks: int  # of which probed device free memory
    reclaims: int  # events recorded
    events_dropped: int  # beyond the native ring (256)
    armed: bool


class _Armable:
    """pidfd bookkeeping shared by both implementations: the pidfd is opened here, lent
    to the hook while armed, and closed only after the hook has let go of it."""

    _pidfd: int | None = None

    def _open(self, pid: int, expected_release_bytes: int, timeout_s, settle_s, poll_s) -> int:
        if expected_release_bytes <= 0:
            raise InvalidInput(
                f"expected_release_bytes must be positive (got {expected_release_bytes}); "
                "a shadow without device memory (L1) needs no hook: do not arm"
            )
        if not (timeout_s > 0 and settle_s >= 0 and 0 < poll_s < 1):
            raise InvalidInput(
                f"need timeout_s > 0, settle_s >= 0, 0 < poll_s < 1 "
                f"(got {timeout_s}, {settle_s}, {poll_s})"
            )
        try:
            return os.pidfd_open(pid)
        except ProcessLookupError:
            raise InvalidInput(f"shadow pid {pid} does not exist: nothing to arm") from None

    def _swap_fd(self, fd: int | None) -> None:
        old, self._pidfd = self._pidfd, fd
        if old is not None:
            os.close(old)


def _exited(pidfd: int) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


class Reclaimer(_Armable):
    """Python twin of reclaim.cpp (same gate, kill, wait, record). ``probe()`` returns
    device free bytes; raising means "unknown" (the gate stays shut)."""

    def __init__(self, probe: Callable[[], int]):
        self.probe = probe
        self._lock = threading.Lock()
        self._armed = False
        self._cfg: dict = {}
        self._events: list[ReclaimEvent] = []
        self._calls = self._checks = 0

    def arm(
        self,
        pid: int,
        *,
        expected_release_bytes: int,
        reclaim_below_bytes: int,
        device: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        settle_s: float = DEFAULT_SETTLE_S,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        fd = self._open(pid, expected_release_bytes, timeout_s, settle_s, poll_s)
        with self._lock:
            self._cfg = dict(
                pid=pid,
                expected=expected_release_bytes,
                below=reclaim_below_bytes,
                timeout_s=timeout_s,
                settle_s=settle_s,
                poll_s=poll_s,
            )
            self._armed = True
            self._swap_fd(fd)

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            self._swap_fd(None)

    def reset(self) -> None:
        with self._lock:
            self._armed = False
            self._swap_fd(None)
            self._events.clear()
            self._calls = self._checks = 0

    def _free(self) -> int | None:
        try:
            return int(self.probe())
        except Exception:
            return None

    def on_cache_miss(self) -> bool:
        if not self._armed:
            return False
        with self._lock:
            if not self._armed:
                return False
            self._calls += 1
            self._checks += 1
            c, fd = self._cfg, self._pidfd
            before = self._free()
            if before is None or before >= c["below"]:
                return False
            wall = time.time()
            t0 = time.monotonic()
            gone = _exited(fd)
            self._armed = False
            killed, exit_s = False, (0.0 if gone else None)
            if not gone:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed = True
                except ProcessLookupError:
                    killed = False
                except PermissionError:
                    self._events.append(
                        ReclaimEvent(
                            wall,
                            time.monotonic() - t0,
                            None,
                            before,
                            before,
                            c["pid"],
                            Outcome.KILL_FAILED,
                            False,
                        )
                    )
                    return False
            last, quiet_since = before, t0
            while True:
                now = time.monotonic()
                if not gone and _exited(fd):
                    gone, exit_s = True, now - t0
                    quiet_since = max(quiet_since, now)
                f = self._free()
                if f is not None and f != last:
                    last, quiet_since = f, now
                if last - before >= c["expected"]:
                    outcome = Outcome.RELEASED
                    break
                if gone and last > before and now - quiet_since >= c["settle_s"]:
                    outcome = Outcome.EXITED
                    break
                if now - t0 >= c["timeout_s"]:
                    outcome = Outcome.TIMEOUT
                    break
                time.sleep(c["poll_s"])
            self._events.append(
                ReclaimEvent(
                    wall, time.monotonic() - t0, exit_s, before, last, c["pid"], outcome, killed
                )
            )
            return last > before

    def events(self, since: int = 0) -> list[ReclaimEvent]:
        with self._lock:
            return list(self._events[since:])

    def stats(self) -> ReclaimStats:
        with self._lock:
            return ReclaimStats(self._calls, self._checks, len(self._events), 0, self._armed)


# -- the native hook ---------------------------------------------------------------


class _Event(ctypes.Structure):
    _fields_ = [
        ("wall_ns", ctypes.c_int64),
        ("latency_ns", ctypes.c_int64),
        ("exit_ns", ctypes.c_int64),
        ("free_before", ctypes.c_uint64),
        ("free_after", ctypes.c_uint64),
        ("pid", ctypes.c_int32),
        ("outcome", ctypes.c_int32),
        ("killed", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


class _Stats(ctypes.Structure):
    _fields_ = [
        ("calls", ctypes.c_uint64),
        ("pressure_checks", ctypes.c_uint64),
        ("reclaims", ctypes.c_uint64),
        ("events_dropped", ctypes.c_uint64),
        ("armed", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


_PROBE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    u64, i64, c_int = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
    lib.leto_reclaim_arm.argtypes = [c_int, c_int, c_int, u64, u64, i64, i64, i64]
    lib.leto_reclaim_arm.restype = c_int
    lib.leto_reclaim_disarm.argtypes = []
    lib.leto_reclaim_disarm.restype = None
    lib.leto_reclaim_reset.argtypes = []
    lib.leto_reclaim_reset.restype = None
    lib.leto_reclaim_set_probe.argtypes = [_PROBE]
    lib.leto_reclaim_set_probe.restype = None
    lib.leto_reclaim_get_stats.argtypes = [ctypes.POINTER(_Stats)]
    lib.leto_reclaim_get_stats.restype = None
    lib.leto_reclaim_event_count.argtypes = []
    lib.leto_reclaim_event_count.restype = c_int
    lib.leto_reclaim_get_event.argtypes = [c_int, ctypes.POINTER(_Event)]
    lib.leto_reclaim_get_event.restype = c_int
    lib.leto_reclaim_on_cache_miss.argtypes = []
    lib.leto_reclaim_on_cache_miss.restype = c_int
    return lib


class NativeReclaimer(_Armable):
    """The C++ hook's state (one per process: the library's globals)."""

    def __init__(self, lib: ctypes.CDLL, cuda: bool):
        self._lib, self.cuda = lib, cuda
        self._probe_ref = None  # keeps a ctypes callback alive while the library holds it

    @classmethod
    def cpu_build(cls, probe: Callable[[], int]) -> NativeReclaimer:
        """The hook's C++ built without torch/CUDA, state reset, ``probe`` injected."""
        r = cls(_load(cuda=False), cuda=False)
        r.reset()
        r.set_probe(probe)
        return r

    def set_probe(self, probe: Callable[[], int] | None) -> None:
        """Replace the free-memory probe (None: cudaMemGetInfo in the CUDA build)."""

        def call(out):
            try:
                out[0] = int(probe())
                return 0
            except Exception:  # an exception cannot cross into C: "unknown" shuts the gate
                return -1

        ref = _PROBE(call) if probe is not None else ctypes.cast(None, _PROBE)
        self._lib.leto_reclaim_set_probe(ref)
        self._probe_ref = ref

    def arm(
        self,
        pid: int,
        *,
        expected_release_bytes: int,
        reclaim_below_bytes: int,
        device: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        settle_s: float = DEFAULT_SETTLE_S,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        fd = self._open(pid, expected_release_bytes, timeout_s, settle_s, poll_s)
        self._lib.leto_reclaim_disarm()  # the old pidfd is no longer in use after this
        rc = self._lib.leto_reclaim_arm(
            device,
            fd,
            pid,
            reclaim_below_bytes,
            expected_release_bytes,
            int(timeout_s * 1e9),
            int(settle_s * 1e9),
            int(poll_s * 1e9),
        )
        self._swap_fd(fd)
        if rc != 0:
            raise InvalidInput(f"the native hook rejected arm(pid={pid}, ...): rc {rc}")

    def disarm(self) -> None:
        self._lib.leto_reclaim_disarm()
        self._swap_fd(None)

    def reset(self) -> None:
        self._lib.leto_reclaim_reset()
        self._swap_fd(None)

    def on_cache_miss(self) -> bool:
        """What the allocator calls (CPU build: tests call it; ctypes drops the GIL)."""
        return bool(self._lib.leto_reclaim_on_cache_miss())

    def events(self, since: int = 0) -> list[ReclaimEvent]:
        out = []
        for i in range(since, self._lib.leto_reclaim_event_count()):
            e = _Event()
            if self._lib.leto_reclaim_get_event(i, ctypes.byref(e)) != 0:
                break
            out.append(
                ReclaimEvent(
                    wall_time_s=e.wall_ns / 1e9,
                    latency_s=e.latency_ns / 1e9,
                    exit_latency_s=None if e.exit_ns < 0 else e.exit_ns / 1e9,
                    free_before_bytes=e.free_before,
                    free_after_bytes=e.free_after,
                    pid=e.pid,
                    outcome=_OUTCOME_CODES[e.outcome],
                    killed=bool(e.killed),
                )
            )
        return out

    def stats(self) -> ReclaimStats:
        s = _Stats()
        self._lib.leto_reclaim_get_stats(ctypes.byref(s))
        return ReclaimStats(s.calls, s.pressure_checks, s.reclaims, s.events_dropped, bool(s.armed))


# -- building ----------------------------------------------------------------------

_LIBS: dict[bool, ctypes.CDLL] = {}
_LIBS_LOCK = threading.Lock()


def cuda_include_dir() -> Path | None:
    """A directory holding a complete set of CUDA runtime headers: the pip CUDA runtime
    that torch uses first (its version matches torch's), then the toolkit. Seen on the
    H200: pip's ``nvidia/cu13/include`` has cuda_runtime.h but not crt/host_config.h,
    so a directory counts only with both."""
    cands: list[Path] = []
    for sp in sys.path:
        nv = Path(sp) / "nvidia"
        if nv.is_dir():
            cands += sorted(nv.glob("*/include"))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(Path(os.environ[env]) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    cands += sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)
    need = ("cuda_runtime_api.h", "crt/host_config.h")
    return next((c for c in cands if all((c / n).is_file() for n in need)), None)


def compile_flags(cuda: bool) -> list[str]:
    """Compiler flags for one build flavour (without output and link options)."""
    flags = ["-O2", "-std=c++17", "-fPIC", "-Wall"]
    if not cuda:
        return flags
    import torch

    inc = cuda_include_dir()
    if inc is None:
        raise InvalidInput(
            "the CUDA reclamation hook needs the CUDA runtime headers (cuda_runtime_api.h) "
            "to compile against torch's c10 headers; install the CUDA toolkit or set CUDA_HOME"
        )
    torch_dir = Path(torch.__file__).parent
    return flags + [
        "-DLETO_RECLAIM_CUDA",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{torch_dir / 'include'}",
        f"-I{inc}",
    ]


def _link_flags(cuda: bool) -> list[str]:
    if not cuda:
        return []
    import torch

    lib = Path(torch.__file__).parent / "lib"
    # No -lcudart: cudaMemGetInfo must resolve to the runtime torch already loaded (a
    # dependency of libc10_cuda), never to a second copy from the toolkit.
    return [f"-L{lib}", "-lc10_cuda", "-lc10", f"-Wl,-rpath,{lib}"]


def build_library(cuda: bool) -> Path:
    """Compile reclaim.cpp once per (source, flags, torch version) (``leto.native``)."""
    depends = b""
    if cuda:
        import torch

        depends = torch.__version__.encode()
    cxx = compiler("CXX", ("c++", "g++"), "building the reclamation hook")
    return build_shared(
        SOURCE,
        f"reclaim-{'cuda' if cuda else 'cpu'}",
        cxx,
        compile_flags(cuda),
        _link_flags(cuda),
        depends_on=depends,
    )


def _load(cuda: bool) -> ctypes.CDLL:
    # One build per flavour per process: the c10 registry exits the process when a second
    # library registers the same callback name.
    with _LIBS_LOCK:
        if cuda not in _LIBS:
            _LIBS[cuda] = _declare(ctypes.CDLL(str(build_library(cuda))))
            if not cuda:
                _LIBS[cuda].leto_reclaim_reset()
        return _LIBS[cuda]


def install_cuda_hook() -> NativeReclaimer:
    """Build (cached) and load the CUDA hook: from now on every cache miss of this
    process's caching allocator passes through it (one atomic load while disarmed)."""
    import torch

    if not torch.cuda.is_available():
        raise InvalidInput("install_cuda_hook() needs a CUDA device; on the CPU use Reclaimer")
    return NativeReclaimer(_load(cuda=True), cuda=True)


# -- CPU emulation of a device's memory ----------------------------------------------


class EmulatedDevice:
    """A GPU's memory for CPU tests: ``active_bytes`` of the trainer plus bytes held by
    processes until they exit (and ``release_delay_s`` after the exit is first seen, like
    a driver tearing a context down). ``free_bytes`` is the probe."""

    def __init__(self, capacity_bytes: int, release_delay_s: float = 0.0):
        self.capacity_bytes = capacity_bytes
        self.release_delay_s = release_delay_s
        self.active_bytes = 0
        self._held: dict[int, list] = {}  # pid -> [pidfd, bytes, exit first seen or None]
        self._lock = threading.Lock()

    def hold(self, pid: int, nbytes: int) -> None:
        with self._lock:
            self._held[pid] = [os.pidfd_open(pid), nbytes, None]

    def free_bytes(self) -> int:
        now = time.monotonic()
        used = self.active_bytes
        with self._lock:
            for h in self._held.values():
                if h[2] is None and _exited(h[0]):
                    h[2] = now
                if h[2] is None or now - h[2] < self.release_delay_s:
                    used += h[1]
        return self.capacity_bytes - used

    def close(self) -> None:
        with self._lock:
            for h in self._held.values():
                os.close(h[0])
            self._held.clear()
