"""The node's zygote (``leto.launch.zygote``): a trainer forked from it behaves as the
same script started as ``python script.py``: its arguments, environment, working
directory and ``sys.path``; its log on stdout and stderr; a passed descriptor; its exit
code for ``sys.exit``, an uncaught exception (through ``sys.excepthook``) and SIGKILL;
non-daemon threads joined and ``atexit`` run before it exits; its own session. One
zygote for the module (its torch import is the slow part)."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest

from leto.launch.zygote import Zygote
from leto.proc import started_at

pytestmark = [pytest.mark.integ, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(60)
    yield z
    z.close()
    assert z.proc.returncode == 0


def _spawn(z: Zygote, tmp_path, body: str, *args: str, env=None, fds=None):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    log = tmp_path / "log.txt"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        p = z.spawn([str(script), *args], dict(os.environ, **(env or {})), fd, fds)
    finally:
        os.close(fd)
    return p, log


def test_a_forked_script_sees_what_python_script_py_would(zygote, tmp_path):
    r, w = os.pipe()
    body = """
        import os, sys
        print(sys.argv[1:], os.environ["LETO_T"], os.getcwd(), sys.path[0])
        print("session leader", os.getsid(0) == os.getpid())
        print("cmdline", open("/proc/self/cmdline", "rb").read().split(b"\\0")[1:4])
        print("environ", b"LETO_T=x" in open("/proc/self/environ", "rb").read().split(b"\\0"))
        os.write(int(os.environ["LETO_T_FD"]), b"through the pipe")
        print("to stderr", file=sys.stderr)
    """
    try:
        p, log = _spawn(zygote, tmp_path, body, "a", "--b=1", env={"LETO_T": "x"},
                        fds={"LETO_T_FD": w})  # fmt: skip
    finally:
        os.close(w)
    assert p.wait(30) == 0
    assert os.read(r, 100) == b"through the pipe"
    os.close(r)
    out = log.read_text()
    assert f"['a', '--b=1'] x {os.getcwd()} {tmp_path}" in out, out
    assert "session leader True" in out and "to stderr" in out, out
    # ps and pkill -f see the script, tools reading /proc/PID/environ the trainer's
    # environment, as for python script.py
    assert f"cmdline [b'{tmp_path / 'script.py'}', b'a', b'--b=1']" in out, out
    assert "environ True" in out, out


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("import sys; sys.exit(3)", 3),
        ("raise SystemExit('a reason')", 1),
        ("raise ValueError('boom')", 1),
        ("print('ok')", 0),
    ],
)
def test_exit_codes_are_the_interpreters(zygote, tmp_path, body, code):
    p, log = _spawn(zygote, tmp_path, body)
    assert p.wait(30) == code
    if "boom" in body:
        assert "ValueError: boom" in log.read_text()  # sys.excepthook's traceback
    if "reason" in body:
        assert "a reason" in log.read_text()


def test_the_zygote_says_when_it_was_ready_after_its_start(zygote, tmp_path):
    # (leto run's start-up line: the zygote ready, measured from a process's start)
    p, _ = _spawn(zygote, tmp_path, "pass")
    assert p.wait(30) == 0
    began = started_at(zygote.proc.pid)
    assert began is not None and zygote.ready_at is not None
    # Its torch import lies between (a tick of /proc's clock is 10 ms).
    assert began - 0.02 < zygote.ready_at <= time.time(), (began, zygote.ready_at)
    assert abs(started_at() - began) < 3600  # this process's start, same clock
    assert started_at(2**22 + 12345) is None  # no such process: not said


def test_a_killed_child_reports_the_signal_and_waits_time_out(zygote, tmp_path):
    p, _ = _spawn(zygote, tmp_path, "import time; time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.3)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGKILL)  # as the fence does
    assert p.wait(30) == -signal.SIGKILL


def test_threads_are_joined_and_atexit_runs_before_the_exit(zygote, tmp_path):
    body = """
        import atexit, threading, time
        atexit.register(lambda: print("atexit ran", flush=True))
        def late():
            time.sleep(0.3)
            print("thread done", flush=True)
        threading.Thread(target=late).start()
    """
    p, log = _spawn(zygote, tmp_path, body)
    assert p.wait(30) == 0
    assert log.read_text().splitlines() == ["thread done", "atexit ran"]


def test_a_forked_script_finds_torchs_lazy_imports_already_loaded(zygote, tmp_path):
    # What use_deterministic_algorithms and an optimizer's first call import (1.5-3 s of
    # a core each) is the zygote's, once; nothing of a device is initialized with it.
    body = """
        import sys, torch
        print([m for m in ("torch._dynamo", "torch._inductor.config") if m not in sys.modules])
        print("cuda initialized", torch.cuda.is_initialized())
    """
    p, log = _spawn(zygote, tmp_path, body)
    assert p.wait(30) == 0
    assert log.read_text().splitlines() == ["[]", "cuda initialized False"], log.read_text()


def test_a_zygote_closed_while_it_imports_is_killed_not_waited_for():
    z = Zygote(60)  # closed at once: still importing torch (seconds)
    t0 = time.monotonic()
    z.close()
    took = time.monotonic() - t0
    assert z.proc.returncode is not None and took < 1.0, f"close took {took:.2f} s"


def test_a_zygote_that_died_is_named_when_asked_to_fork(tmp_path):
    z = Zygote(60)
    z.proc.kill()
    z.proc.wait(10)
    deadline = time.monotonic() + 10
    while not z._lost and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="zygote .* is not running.*LETO_ZYGOTE=0"):
        _spawn(z, tmp_path, "print(1)")
    z.close()


def test_a_torchrun_script_left_unported_is_told_to_call_leto_init(zygote, tmp_path):
    body = """
        from torch.distributed import init_process_group
        init_process_group("gloo")
    """
    p, log = _spawn(zygote, tmp_path, body)
    assert p.wait(30) == 1
    out = log.read_text()
    assert "call leto.init() instead of torch.distributed.init_process_group()" in out, out
