"""The node's zygote: trainers and shadows forked from a process that imported torch once.

Runs as its own process, one per node, started by ``leto run`` before it imports the
agent (or by the agent). Importing torch takes 1-3 s of a core in every trainer and every shadow
(2.4 s on a 2-core CPU VM); a job of two ranks at L2 starts four such processes, and
four more after each recovery. The zygote imports torch once (with the parts of it a
script imports lazily: ``PRELOAD``) — while ``leto run`` imports its own and the state
managers start — and forks each trainer and shadow from there, so they begin with torch
in memory (shared copy-on-write), as torch elastic's workers never do. Nothing of CUDA
is initialized in the zygote (torch's import does not), so a forked child initializes
the device as a fresh process would; of Leto only this module (and ``leto.proc``) is
imported in it, so no module reads a trainer's environment before the trainer's own is
set.

Protocol: a ``SOCK_SEQPACKET`` socket pair, one JSON message per packet. The agent sends
``{"argv", "env", "cwd", "fd_env"}`` with file descriptors attached (the log first, then
e.g. a shadow's promotion pipe; ``fd_env`` names the environment variable that carries
each one's number in the child); the zygote forks and answers ``{"pid"}``, and reports
every child's exit as ``{"exit": pid, "code": returncode}`` (negative: killed by that
signal, as ``subprocess``). The child starts its own session (the fence kills its
process group), takes the environment, working directory, ``sys.argv`` and ``sys.path``
a fresh ``python script.py`` would have, runs the script as ``__main__`` and exits the
way the interpreter does (non-daemon threads joined, ``atexit`` run, an uncaught
exception through ``sys.excepthook``). The zygote exits when the agent's end closes
(also when the agent is SIGKILLed), at once: ``os._exit``, no interpreter teardown.

``LETO_ZYGOTE=0`` starts every trainer as its own interpreter instead (for diagnosis).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from leto.proc import alive

ENV_ZYGOTE = "LETO_ZYGOTE"
MAX_FDS = 8
PACKET = 1 << 20
CMDLINE_ROOM = 2048  # bytes of command line each child can show (_set_cmdline)
ENV_ROOM = 16384  # ... and of environment beyond the agent's  # a message: the environment is the largest part (a few KB)


def enabled() -> bool:
    return os.environ.get(ENV_ZYGOTE, "1") != "0"


# -- the zygote process ---------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's to handle
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select()
    preload()
    try:
        sock.send(b'{"ready": true}')
    except OSError:  # leto run stopped while this imported (refused, Ctrl-C)
        os._exit(0)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock)
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, PACKET, MAX_FDS)
            if not msg:
                # The agent is gone. No interpreter teardown: torch's finalizers and
                # module cleanup took 1.2 s of a core here, with the agent waiting in
                # Zygote.close at every job's end; the zygote holds nothing to flush.
                os._exit(0)
            req = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                _child(req, fds)  # never returns
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"pid": pid}).encode())


# What the zygote imports before it forks anyone: torch, and the parts of torch a
# training script's process imports lazily on its way to its first iteration.
# ``torch.use_deterministic_algorithms`` imports ``torch._inductor.config`` (and with it
# torch._dynamo, sympy and triton where installed) and every ``torch.optim`` optimizer's
# first method call imports ``torch._dynamo``: 1.5 s of a core on an idle 2-core VM, 2-3 s
# in each of a job's four trainers and shadows starting at once, paid once here instead.
# Neither reads a rank's environment or initializes a device as it imports.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.config")


def preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # a torch without one of them: the trainer imports it
            print(f"leto run's zygote: {name} not preloaded: {e}", file=sys.stderr)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        try:
            sock.send(json.dumps({"exit": pid, "code": code}).encode())
        except OSError:
            pass  # the agent is gone: nobody to tell


def _child(req: dict, fds: list[int]) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        log, extra = fds[0], fds[1:]
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        env = dict(req["env"])
        for name, i in req.get("fd_env", {}).items():
            env[name] = str(extra[i])
        os.environ.clear()
        os.environ.update(env)
        _set_cmdline([sys.executable, *req["argv"]], env)
        os.chdir(req["cwd"])
        script, *rest = req["argv"]
        module = rest[0] if script == "-m" else None  # leto run -m: python -m's way
        if module is not None:
            sys.argv = [module, *rest[1:]]  # argv[0] becomes the module's file
            sys.path[0] = os.getcwd()
        else:
            sys.argv = list(req["argv"])
            sys.path[0] = os.path.dirname(os.path.realpath(script))
        # stdout and stderr line-buffered, as on torchrun's terminal: the rank log (and
        # leto run's console, leto.launch.relay) has every complete line a SIGKILLed
        # trainer printed — block-buffered, its last few KiB died with it. Unbuffered
        # under PYTHONUNBUFFERED, as a fresh interpreter is.
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))

        def stream(fd: int, errors: str) -> io.TextIOWrapper:
            raw = io.FileIO(fd, "w", closefd=False)
            if unbuffered:
                return io.TextIOWrapper(raw, write_through=True, errors=errors)  # type: ignore[arg-type]
            return io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=True, errors=errors)

        sys.stdout = stream(1, "strict")
        sys.stderr = stream(2, "backslashreplace")
        if env.get("PYTHONFAULTHANDLER"):  # what a fresh interpreter would enable
            import faulthandler

            faulthandler.enable()
        import runpy

        _guard_rendezvous()
        try:
            if module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # as the interpreter: non-daemon threads first
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:
            pass
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                pass
        os._exit(code)


def _set_cmdline(argv: list[str], env: dict) -> None:
    """Show ``argv`` and ``env`` as this process's command line and environment in /proc
    (``ps``, ``pkill -f script.py``, tools that find a rank by its ``RANK`` or a shadow
    by ``LETO_ROLE``, as for a trainer started on its own): written over the zygote's own
    argument and environment strings, whose room the agent padded, as setproctitle does;
    cut to that room."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()  # from field 3 (the state) on
    # Fields 48-51: arg_start, arg_end, env_start, env_end.
    _overwrite(int(fields[45]), int(fields[46]), "\0".join(argv).encode())
    _overwrite(
        int(fields[47]), int(fields[48]), "\0".join(f"{k}={v}" for k, v in env.items()).encode()
    )


def _overwrite(start: int, end: int, payload: bytes) -> None:
    import ctypes

    room = end - start
    if room > 1:
        ctypes.memmove(start, payload[: room - 1].ljust(room, b"\0"), room)


def _guard_rendezvous() -> None:
    """A torchrun script run under ``leto run`` unchanged calls
    ``init_process_group()`` from the environment, and its rank 0 then tries to serve a
    store on the port the agent's store holds: "address already in use", on a free port.
    Say what to change instead. ``leto.init()`` passes its own store, so it is let by."""
    import torch.distributed as dist

    from leto.errors import InvalidInput

    plain = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if kwargs.get("store") is None:
            raise InvalidInput(
                "under leto run, call leto.init() instead of "
                "torch.distributed.init_process_group(): Leto's agent owns the job's "
                "rendezvous (leto.init() returns the rank, world and device, and sets up "
                "the same process group); nothing was started (docs/porting.md)"
            )
        return plain(*args, **kwargs)

    dist.init_process_group = init_process_group


def _exit_code(c) -> int:
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    print(c, file=sys.stderr)
    return 1


def main() -> None:
    serve(socket.socket(fileno=int(sys.argv[1])))


# -- the agent's side -----------------------------------------------------------------


class Zygote:
    """The agent's handle: ``spawn()`` returns a ``subprocess.Popen``-like process."""

    def __init__(self, timeout_s: float = 120.0):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock, self.timeout_s = ours, timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from leto.launch.zygote import main; main()",
             str(theirs.fileno()), " " * CMDLINE_ROOM],
            pass_fds=(theirs.fileno(),),
            env=dict(os.environ, LETO_ZYGOTE_ROOM=" " * ENV_ROOM),
        )  # fmt: skip
        theirs.close()
        self._lock = threading.Lock()  # one spawn at a time: its answer is the next pid
        self._cv = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._lost = False
        self._ready = threading.Event()
        self.ready_at: float | None = None  # wall clock: torch imported, forks served
        threading.Thread(target=self._read, name="leto-zygote", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(PACKET)
            except OSError:
                msg = b""
            with self._cv:
                if not msg:
                    self._lost = True
                    self._ready.set()
                    self._cv.notify_all()
                    return
                m = json.loads(msg)
                if "ready" in m:
                    self.ready_at = time.time()
                    self._ready.set()
                elif "exit" in m:
                    self._exits[m["exit"]] = m["code"]
                else:
                    self._pids.append(m["pid"])
                self._cv.notify_all()

    def spawn(
        self, argv: list[str], env: dict, log_fd: int, pass_fds: dict[str, int] | None = None
    ) -> ForkedProcess:
        """Fork ``python argv...`` from the zygote with ``env``, stdout and stderr on
        ``log_fd`` and each of ``pass_fds`` (environment variable -> descriptor) open in
        the child, its number in that variable."""
        extra = list((pass_fds or {}).items())
        req = {
            "argv": argv, "env": env, "cwd": os.getcwd(),
            "fd_env": {name: i for i, (name, _) in enumerate(extra)},
        }  # fmt: skip
        with self._lock:
            if not self._ready.wait(self.timeout_s) or self._lost:
                raise RuntimeError(
                    f"leto run's zygote (pid {self.proc.pid}) is not running (exit code "
                    f"{self.proc.poll()}): set {ENV_ZYGOTE}=0 to start trainers without it"
                )
            socket.send_fds(
                self.sock, [json.dumps(req).encode()], [log_fd, *(fd for _, fd in extra)]
            )
            deadline = time.monotonic() + self.timeout_s
            with self._cv:
                while not self._pids and not self._lost:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(
                            f"leto run's zygote did not fork within {self.timeout_s} s"
                        )
                    self._cv.wait(left)
                if not self._pids:
                    raise RuntimeError("leto run's zygote exited while forking a trainer")
                return ForkedProcess(self, self._pids.pop(0))

    def close(self) -> None:
        """End the zygote (its children run on: each is fenced or ends by itself). One
        still importing has forked no one and is killed, not waited for (a ``leto run``
        refused after it started: a busy port, a fault plan its pools refuse)."""
        if not self._ready.is_set():
            self.proc.kill()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class ForkedProcess:
    """What the agent uses of ``subprocess.Popen``: ``pid``, ``poll()``, ``wait()``,
    ``returncode``, for a process the zygote forked (the zygote reaps it and reports its
    exit code)."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            z = self.zygote
            with z._cv:
                if self.pid in z._exits:
                    self.returncode = z._exits.pop(self.pid)
                elif z._lost and not alive(self.pid):
                    self.returncode = 255  # its zygote is gone: the code is unknown
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        z = self.zygote
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            with z._cv:
                if self.pid not in z._exits:
                    z._cv.wait(0.5 if left is None else min(left, 0.5))
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
