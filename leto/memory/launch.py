"""Starting and stopping a state-manager process (used by the launcher and the tests).

Runs in the parent (launcher/agent or test). The state manager is a separate process
started with ``python -m leto.memory.state_manager``: it must outlive trainers, so it
is never a child of one. Readiness is the line READY on its stdout, awaited with a
timeout (at once, or later by ``wait_ready``); the job token travels in the environment,
not on the command line.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from leto.memory.config import ENV_POOL_TOKEN, SOCKET_NAME, PoolConfig
from leto.memory.errors import PoolTimeout


@dataclass
class StateManagerProcess:
    proc: subprocess.Popen
    socket_dir: Path
    token: str
    config: PoolConfig
    owns_dir: bool = False  # the socket directory was made for it: removed by stop()
    lifeline: int | None = None  # write end of its lifeline pipe (see start_state_manager)
    ready: bool = False  # it said READY (wait_ready)

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / SOCKET_NAME

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait for its READY line (it listens from then on); if none comes within
        ``timeout_s`` it is killed, its directory removed, and ``PoolTimeout`` raised."""
        if self.ready:
            return
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().strip() if ready else b""
        if line != b"READY":
            self.proc.kill()
            self.proc.wait(5)
            self._release()
            raise PoolTimeout(
                f"state manager did not report READY within {timeout_s} s (exit code "
                f"{self.proc.returncode}); see its stderr above"
            )
        self.ready = True

    def stop(self, timeout_s: float = 10.0) -> int:
        """Shut down cleanly (SHUTDOWN as admin), SIGKILL if it does not exit in time;
        one that never said READY is terminated at once."""
        if self.proc.poll() is None:
            if not (self.ready and self._ask_shutdown(timeout_s)):
                self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._release()
        return self.proc.returncode

    def _ask_shutdown(self, timeout_s: float) -> bool:
        from leto.memory.client import PoolClient

        try:
            with PoolClient.connect(
                self.socket_path, self.token, role="admin", timeout_s=timeout_s
            ) as c:
                c.shutdown()
        except Exception:
            return False
        return True

    def _release(self) -> None:
        """What the launcher holds of it: its stdout, its lifeline, its directory."""
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
        if self.owns_dir:
            # Only its socket lived there; left behind, every job added an empty
            # leto-pool-* directory to /tmp.
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def private_dir(prefix: str = "leto-pool-") -> Path:
    """A fresh directory only this user can enter (mode 0700)."""
    return Path(tempfile.mkdtemp(prefix=prefix))  # mkdtemp creates it 0700


def start_state_manager(
    config: PoolConfig,
    socket_dir: Path | None = None,
    token: str | None = None,
    timeout_s: float = 30.0,
    wait: bool = True,
) -> StateManagerProcess:
    """Start a state manager; with ``wait``, return once it listens (else the caller
    calls ``wait_ready``: ``leto run`` starts every local rank's, then their trainers,
    then waits — a trainer's connect waits for the socket meanwhile)."""
    owns_dir = socket_dir is None
    socket_dir = Path(socket_dir) if socket_dir else private_dir()
    token = token or secrets.token_hex(16)
    env = dict(os.environ, **{ENV_POOL_TOKEN: token})
    # The lifeline: only this process holds the write end (non-inheritable, so trainers
    # started later do not), and its death — even by SIGKILL — closes it: the manager
    # reads EOF and stops, instead of outliving a job killed outright.
    life_r, life_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "leto.memory.state_manager",
                "--socket-dir",
                str(socket_dir),
                "--config",
                json.dumps(config.as_dict()),
                "--lifeline-fd",
                str(life_r),
                *(["--owns-dir"] if owns_dir else []),
            ],
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # survives a signal sent to the trainer's process group
            pass_fds=(life_r,),
        )
    except BaseException:
        os.close(life_w)
        raise
    finally:
        os.close(life_r)
    sm = StateManagerProcess(proc, socket_dir, token, config, owns_dir=owns_dir, lifeline=life_w)
    if wait:
        sm.wait_ready(timeout_s)
    return sm
