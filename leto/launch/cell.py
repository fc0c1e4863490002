"""One rank's cell: its state manager, its active trainer and its parked shadow.

Runs in the agent. The state manager lives as long as the job (it holds the rank's
retained state across trainer deaths); trainers come and go: an active trainer is
fenced (SIGKILL, waited for) before its successor may touch the pool, and a shadow is
promoted by one JSON line on its pipe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from leto.integrity.loss_guard import ENV_LOSS_GUARD
from leto.integrity.replay import ENV_REPLAY_EVERY
from leto.integrity.replica import ENV_REPLICA_CHECK
from leto.integrity.scrub import ENV_SCRUB_MIB
from leto.job.config import (
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_INTERVAL,
    ENV_CHECKPOINT_SKIP,
    ENV_DEVICE,
    ENV_ERROR_FILE,
    ENV_GENERATION,
    ENV_HANG_TIMEOUT_S,
    ENV_HOF_RATIO,
    ENV_LOG_DIR,
    ENV_MTTF_S,
    ENV_PG_ATTEMPT,
    ENV_POOL_SOCKET,
    ENV_PROMOTE_FD,
    ENV_RANKS_PER_GPU,
    ENV_ROLE,
    ENV_SHADOW_LEVEL,
    ENV_TIMEOUT_S,
    ENV_UNDO,
    RunConfig,
)
from leto.memory.config import ENV_POOL_TOKEN, PoolConfig
from leto.memory.launch import start_state_manager


class Cell:
    def __init__(
        self, cfg: RunConfig, local_rank: int, rank: int, command: list[str], pool: PoolConfig
    ):
        self.cfg, self.local_rank, self.rank, self.command = cfg, local_rank, rank, command
        self.zygote = None  # the node's (leto.launch.zygote), set by the agent
        self.pool = pool
        # Not waited for here: the agent starts every local rank's, then their first
        # trainers (whose connect waits for the socket), then waits for each to listen.
        self.sm = start_state_manager(pool, wait=False)
        self.active: subprocess.Popen | None = None
        self.active_generation = -1
        self.active_role = "active"
        self.shadow: subprocess.Popen | None = None
        self.shadow_generation = -1
        self._shadow_pipe: int | None = None
        # Process-group namespace of the trainers it starts: "<fallbacks>.<L3 restarts>"
        # (leto.job.store.pg_store); a restarted group never meets a dropped one.
        self.fallbacks = 0
        self.pg_attempt = "0.0"
        self.checkpoint_skip = 0  # set by a checkpoint fallback (Recovery.fallback)
        self.extra_env: dict[str, str] = {}  # e.g. the preinitialization guard's config
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def _env(self, role: str, generation: int, level: str) -> dict:
        cfg = self.cfg
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(self.rank),
                "WORLD_SIZE": str(cfg.world_size),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
                "GROUP_RANK": str(cfg.node_rank),
                "MASTER_ADDR": cfg.master_addr,
                "MASTER_PORT": str(cfg.master_port),
                ENV_ROLE: role,
                ENV_GENERATION: str(generation),
                ENV_SHADOW_LEVEL: level,
                ENV_POOL_SOCKET: str(self.sm.socket_path),
                ENV_POOL_TOKEN: self.sm.token,
                ENV_DEVICE: cfg.device,
                ENV_RANKS_PER_GPU: str(cfg.ranks_per_gpu),
                ENV_TIMEOUT_S: str(cfg.timeout_s),
                ENV_CHECKPOINT_DIR: cfg.checkpoints(),
                ENV_CHECKPOINT_INTERVAL: str(cfg.checkpoint_interval),
                ENV_CHECKPOINT_SKIP: str(self.checkpoint_skip),
                ENV_MTTF_S: str(cfg.mttf_s),
                ENV_HOF_RATIO: str(cfg.hof_ratio),
                ENV_PG_ATTEMPT: str(self.pg_attempt),
                ENV_ERROR_FILE: str(self.error_file(generation, role)),
                ENV_LOG_DIR: os.path.abspath(cfg.log_dir),
                ENV_SCRUB_MIB: str(cfg.scrub_mib),
                ENV_REPLICA_CHECK: "1" if cfg.replica_check else "0",
                ENV_LOSS_GUARD: "1" if cfg.loss_guard else "0",
                ENV_REPLAY_EVERY: str(cfg.replay_every),
                ENV_UNDO: cfg.undo,
                ENV_HANG_TIMEOUT_S: str(cfg.hang_timeout_s),
            }
        )
        env.update(self.extra_env)
        for k in ("LETO_FAULT_AT", "LETO_FAULT_MODE", "LETO_FAULT_WHEN"):
            env.pop(k, None)
        return env

    def error_file(self, generation: int, role: str) -> Path:
        return self.log_dir / f"rank{self.rank}.gen{generation}.{role}.error.json"

    def _fresh_error_file(self, generation: int, role: str) -> None:
        """A trainer started under a name an earlier one of this rank had (a dead parked
        shadow replaced in its generation) must not inherit that one's error file: the
        agent would report its exception as the new trainer's failure, and judge a kill
        before training began a script error. The old file is kept beside, numbered."""
        path = self.error_file(generation, role)
        if not path.exists():
            return
        k = 1
        while (
            old := path.with_name(path.name.replace(".error.json", f".error.{k}.json"))
        ).exists():
            k += 1
        path.rename(old)

    def active_error(self) -> dict | None:
        """The active trainer's error file (its uncaught exception), if it wrote one."""
        role = "active" if self.active_role == "active" else "shadow"
        path = self.error_file(self.active_generation, role)
        try:
            return {**json.loads(path.read_text()), "file": str(path)}
        except (OSError, ValueError):
            return None

    def _log(self, generation: int, role: str):
        return open(self.log_dir / f"rank{self.rank}.gen{generation}.{role}.log", "ab")

    def start_active(self, generation: int, fault: dict | None = None) -> None:
        """A cold start (the first generation, or shadows off)."""
        self._fresh_error_file(generation, "active")
        env = self._env("active", generation, "off")
        if fault:
            env["LETO_FAULT_AT"], env["LETO_FAULT_MODE"] = fault["at"], fault.get("mode", "kill")
            if self._waits(fault):
                env["LETO_FAULT_WHEN"] = "parked"
        with self._log(generation, "active") as log:
            # Its own session and process group (as torch elastic starts workers): the
            # fence kills the group, so nothing the trainer started outlives it.
            if self.zygote is not None:  # forked with torch imported (leto.launch.zygote)
                self.active = self.zygote.spawn(self.command, env, log.fileno())
            else:
                self.active = subprocess.Popen(
                    [sys.executable, *self.command],
                    env=_flushed(env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        self.active_generation = generation
        self.active_role = "active"

    def start_shadow(self, generation: int, level: str) -> None:
        self._fresh_error_file(generation, "shadow")
        r, w = os.pipe()
        env = self._env("shadow", generation, level)
        env[ENV_PROMOTE_FD] = str(r)
        try:
            with self._log(generation, "shadow") as log:
                if self.zygote is not None:
                    self.shadow = self.zygote.spawn(
                        self.command, env, log.fileno(), {ENV_PROMOTE_FD: r}
                    )
                else:
                    self.shadow = subprocess.Popen(
                        [sys.executable, *self.command],
                        env=_flushed(env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        pass_fds=(r,),
                        start_new_session=True,
                    )
        finally:
            os.close(r)
        self._shadow_pipe = w
        self.shadow_generation = generation

    def _waits(self, fault: dict) -> bool:
        """A fault plan entry's ``when: parked`` — with shadows off none ever parks."""
        return fault.get("when") == "parked" and self.cfg.shadow_level != "off"

    def promote(self, fault: dict | None = None) -> None:
        """The parked shadow becomes the active trainer (after ``fence``)."""
        if self.shadow is None or self.shadow.poll() is not None:
            raise RuntimeError(f"rank {self.rank} has no live shadow to promote")
        msg = {"generation": self.shadow_generation}
        if fault:
            msg.update(fault_at=fault["at"], fault_mode=fault.get("mode", "kill"))
            if self._waits(fault):
                msg["fault_when"] = "parked"
        os.write(self._shadow_pipe, (json.dumps(msg) + "\n").encode())
        os.close(self._shadow_pipe)
        self._shadow_pipe = None
        self.active, self.active_generation = self.shadow, self.shadow_generation
        self.active_role = "shadow"  # a promoted shadow keeps its files' names
        self.shadow = None

    def fence(self) -> None:
        """Kill the active trainer and wait until it is gone: two trainers must never
        write one pool."""
        p = self.active
        if p is not None:
            # The whole group, even when the trainer itself is already dead: its
            # children (data loaders, compile workers) must not touch the pool either.
            kill_group(p)
            p.wait(timeout=self.cfg.timeout_s)

    def drop_shadow(self) -> None:
        """Kill the shadow, parked or still initializing: it holds no state worth waiting
        for, on a recovery path or at the job's end (letting a parked one exit on EOF
        cost ~0.6 s per rank of interpreter teardown at every job's end). The pipe is
        closed first; a shadow whose agent died exits on that EOF by itself."""
        if self._shadow_pipe is not None:
            os.close(self._shadow_pipe)
            self._shadow_pipe = None
        if self.shadow is not None:
            kill_group(self.shadow)
            self.shadow.wait(timeout=self.cfg.timeout_s)
            self.shadow = None

    def reset_pool(self) -> None:
        """After a fatal failure: a fresh state manager (new pool, new token)."""
        self.sm.stop()
        self.sm = start_state_manager(self.pool)

    def stop(self) -> None:
        self.fence()
        self.drop_shadow()
        self.sm.stop()


def stop_group(p: subprocess.Popen) -> None:
    """SIGSTOP the process group ``p`` leads: frozen, it runs no more of its code (a
    collective failing on a peer's death, its error file) until it is killed; a group
    already gone is not an error."""
    try:
        os.killpg(p.pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the process group ``p`` leads (``start_new_session``); a group already
    gone is not an error."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _flushed(env: dict) -> dict:
    """A fresh interpreter's stdout on a file is block-buffered: what a SIGKILLed trainer
    printed last would never reach its log (and leto run's console). Python has no
    line-buffered mode for it but -u, so unbuffered (the zygote's forks are
    line-buffered: leto.launch.zygote)."""
    return {**env, "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED") or "1"}
