"""``leto run``'s configuration and the environment it gives trainers.

Runs in the agent (``RunConfig``) and in trainers (the ``ENV_*`` names). The
torchrun variables keep their names (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

ENV_ROLE = "LETO_ROLE"  # "active" or "shadow"
ENV_GENERATION = "LETO_GENERATION"  # the recovery generation this trainer serves
ENV_SHADOW_LEVEL = "LETO_SHADOW_LEVEL"  # L1, L2, L3
ENV_PROMOTE_FD = "LETO_PROMOTE_FD"  # a shadow's pipe: one JSON line promotes it
ENV_POOL_SOCKET = "LETO_POOL_SOCKET"  # this rank's state manager
ENV_DEVICE = "LETO_DEVICE"  # cpu or cuda
ENV_RANKS_PER_GPU = "LETO_RANKS_PER_GPU"  # >1: ranks share a GPU over gloo (testing)
ENV_FAULT_PLAN = "LETO_FAULT_PLAN"  # faultkit: JSON list of {generation, rank, at, mode}
ENV_TIMEOUT_S = "LETO_TIMEOUT_S"
ENV_CHECKPOINT_DIR = "LETO_CHECKPOINT_DIR"
ENV_CHECKPOINT_INTERVAL = "LETO_CHECKPOINT_INTERVAL"  # 0: Young's formula
# A checkpoint fallback that failed the same way before restores an older checkpoint:
# how many of the newest complete ones to pass over.
ENV_CHECKPOINT_SKIP = "LETO_CHECKPOINT_SKIP"
ENV_MTTF_S = "LETO_MTTF_S"
ENV_HOF_RATIO = "LETO_HOF_RATIO"
ENV_PG_ATTEMPT = "LETO_PG_ATTEMPT"  # checkpoint fallbacks so far (process-group namespace)
# A directory: a restarted or promoted trainer profiles (cProfile) its recovery, from
# promotion (or process start) to the end of the first iteration, into rank<r>.gen<g>.profile.txt.
ENV_PROFILE_RECOVERY = "LETO_PROFILE_RECOVERY"
# With it, a first-generation trainer's profiled iterations: "FIRST:COUNT" (iterations
# counted from 1 as they start; default "3:1"), traced for bench.update_breakdown.
ENV_PROFILE_WINDOW = "LETO_PROFILE_WINDOW"
# With LETO_PROFILE_RECOVERY: a fresh trainer (generation 0) profiled too, from leto.init()
# to the end of its first iteration (off by default: the benchmarks that profile
# recoveries time generation 0's iterations).
ENV_PROFILE_START = "LETO_PROFILE_START"
# Where a trainer writes its uncaught exception (type, message, traceback) before it
# dies; the agent puts it in the failure's record (as torch elastic's error files).
ENV_ERROR_FILE = "LETO_ERROR_FILE"
ENV_PREINIT = "LETO_PREINIT"  # --shadow-level auto: the trainer's guard configuration (JSON)
ENV_LOG_DIR = "LETO_LOG_DIR"  # leto run's --log-dir
# "0": parked L2/L3 shadows do not map the pool ahead of a promotion (leto.trainer.premap).
ENV_PREMAP = "LETO_PREMAP"
# Where a leto.Run writes its loss log and the verifiers' trace (default <log dir>/train).
ENV_TRAIN_DIR = "LETO_TRAIN_DIR"
# leto run --undo: where the update's undo copies come from (leto.update.rmu.UNDO_MODES).
ENV_UNDO = "LETO_UNDO"
# leto run --hang-timeout-s: a trainer that waits on purpose (a fault plan's ``when:
# parked``) gives up well before the agent would call it hung.
ENV_HANG_TIMEOUT_S = "LETO_HANG_TIMEOUT_S"
UNDO_MODES = ("chunk", "ahead")

LEVELS = ("off", "L1", "L2", "L3")


# Gradient replay's K (leto.integrity.replay): one micro-batch's forward and backward more
# every 200 iterations is at most 0.5 % of an iteration of one micro-batch.
REPLAY_EVERY_DEFAULT = 200


# leto run's shadows unless told otherwise: L3 — parked with the process group too, so a
# promotion defers nothing, and the script's set-up runs ahead while parked
# (leto.trainer.run_ahead). On the H200 at 1.1 B it recovered 0.29 s sooner than L2
# (docs/benchmarks.md, "Recovery as the user lives it"); L2 spares the shadows'
# communicator memory.
DEFAULT_SHADOW_LEVEL = "L3"

@dataclass(frozen=True)
class TrainerEnv:
    """Everything ``leto run`` tells a trainer (or shadow) through its environment, read
    once at start (``from_environ``): a missing required variable is one clear error,
    not a KeyError deep in a recovery."""

    role: str  # "active" or "shadow"
    rank: int
    world_size: int
    local_rank: int
    generation: int
    master_addr: str
    master_port: int
    pool_socket: str
    pool_token: str
    level: str = "off"
    device: str = "cpu"
    ranks_per_gpu: int = 1  # >1: local ranks r, r+1.. share GPU r // n, over gloo
    timeout_s: float = 120.0
    pg_attempt: str = "0.0"
    promote_fd: int | None = None  # a shadow's pipe
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 0  # 0: Young's formula
    checkpoint_skip: int = 0  # newest complete checkpoints to pass over when restoring
    mttf_s: float = 3600.0
    hof_ratio: float = 0.5
    preinit: str | None = None  # the guard's JSON configuration (--shadow-level auto)
    profile_recovery: str | None = None
    profile_window: str = "3:1"
    profile_start: bool = False
    error_file: str | None = None
    log_dir: str = "leto-run"
    train_dir: str = ""  # a Run's output; "" is <log_dir>/train
    premap: bool = True  # parked L2/L3 shadows map the pool ahead of a promotion
    undo: str = "chunk"  # leto run --undo
    hang_timeout_s: float = 60.0  # leto run --hang-timeout-s

    @classmethod
    def from_environ(cls, env=None) -> TrainerEnv:
        import os

        from leto.memory.config import ENV_POOL_TOKEN

        e = os.environ if env is None else env
        role = e.get(ENV_ROLE)
        if role not in ("active", "shadow"):
            raise ValueError(
                f"{ENV_ROLE} is {role!r}: this script must run under `leto run` "
                "(start it with: leto run --nproc-per-node N script.py)"
            )
        required = ("RANK", "WORLD_SIZE", "LOCAL_RANK", ENV_GENERATION, "MASTER_ADDR",
                    "MASTER_PORT", ENV_POOL_SOCKET, ENV_POOL_TOKEN)  # fmt: skip
        missing = [k for k in required if k not in e]
        if missing:
            raise ValueError(f"leto run's environment lacks {', '.join(missing)}")
        return cls(
            role=role,
            rank=int(e["RANK"]),
            world_size=int(e["WORLD_SIZE"]),
            local_rank=int(e["LOCAL_RANK"]),
            generation=int(e[ENV_GENERATION]),
            master_addr=e["MASTER_ADDR"],
            master_port=int(e["MASTER_PORT"]),
            pool_socket=e[ENV_POOL_SOCKET],
            pool_token=e[ENV_POOL_TOKEN],
            level=e.get(ENV_SHADOW_LEVEL, "off"),
            device=e.get(ENV_DEVICE, "cpu"),
            ranks_per_gpu=int(e.get(ENV_RANKS_PER_GPU, "1")),
            timeout_s=float(e.get(ENV_TIMEOUT_S, "120")),
            pg_attempt=e.get(ENV_PG_ATTEMPT, "0.0"),
            promote_fd=int(e[ENV_PROMOTE_FD]) if e.get(ENV_PROMOTE_FD) else None,
            checkpoint_dir=e.get(ENV_CHECKPOINT_DIR) or None,
            checkpoint_interval=int(e.get(ENV_CHECKPOINT_INTERVAL, "0")),
            checkpoint_skip=int(e.get(ENV_CHECKPOINT_SKIP, "0")),
            mttf_s=float(e.get(ENV_MTTF_S, "3600")),
            hof_ratio=float(e.get(ENV_HOF_RATIO, "0.5")),
            preinit=e.get(ENV_PREINIT) or None,
            profile_recovery=e.get(ENV_PROFILE_RECOVERY) or None,
            profile_window=e.get(ENV_PROFILE_WINDOW) or "3:1",
            profile_start=e.get(ENV_PROFILE_START, "0") == "1",
            error_file=e.get(ENV_ERROR_FILE) or None,
            premap=e.get(ENV_PREMAP, "1") != "0",
            log_dir=e.get(ENV_LOG_DIR, "leto-run"),
            train_dir=e.get(ENV_TRAIN_DIR, ""),
            undo=e.get(ENV_UNDO, "chunk"),
            hang_timeout_s=float(e.get(ENV_HANG_TIMEOUT_S, "60")),
        )


@dataclass(frozen=True)
class RunConfig:
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str = "cpu"  # cpu (gloo, memfd pool) or cuda (NCCL, VMM pool)
    # Testing on fewer GPUs than ranks: local ranks r, r+1.. share GPU r // n, each with
    # its own pool, parity and shadow; the process group is gloo (NCCL refuses two ranks
    # on one GPU). 1: one GPU a rank, NCCL.
    ranks_per_gpu: int = 1
    shadow_level: str = DEFAULT_SHADOW_LEVEL  # off: a failed rank restarts cold, like torchrun
    page_bytes: int = 0  # 0: the pool's default for the device
    data_pages: int = 1024
    # H1: `leto sim h1` on the measured H200 overheads picks 4 (ETTR 82.3 % vs 79.6 % at
    # 16): the parity arithmetic is most of what Leto adds to a steady iteration.
    tier1_pages: int = 4
    allow_fault_injection: bool = False
    poll_s: float = 0.02  # death detection latency bound (process exits: no store access)
    # Heartbeats are read from the store this often, not every poll: a hang is only
    # declared after hang_timeout_s (seconds), and every read is a store request.
    beat_poll_s: float = 0.25
    hang_timeout_s: float = 60.0  # a trainer whose heartbeat stalls this long is hung
    timeout_s: float = 120.0  # every wait on the store and on other processes
    log_dir: str = "leto-run"  # per-rank logs and the recovery records
    max_failures: int = 100
    log_level: str = "INFO"  # the agent's state transitions on stderr (logging)
    # The verifiers' per-iteration digest of every retained tensor (off: it hashes the
    # whole model state every iteration; faultkit and the tests turn it on).
    verify: bool = False
    # The scrub's background pass: data MiB checked against parity per iteration
    # (0: none; a full pass still precedes every checkpoint). leto.integrity.scrub. None:
    # 64 on CUDA (≈ 0.15 ms of codec time), 1 on the CPU, whose numpy codec is ~10^4x
    # slower.
    scrub_mib: float | None = None
    # Data-parallel replicas compare a digest of their retained state after every update
    # (leto.integrity.replica; a wrong computation on one rank is fatal to the iteration).
    replica_check: bool = True
    # A NaN or infinite recorded loss on any rank fails the iteration (leto.integrity.loss_guard).
    loss_guard: bool = True
    # Gradient replay every K iterations (leto.integrity.replay; 0: off).
    replay_every: int = REPLAY_EVERY_DEFAULT
    # A GPU the checks named twice as computing wrong is a hardware failure: the job
    # stops, and a restart leaves it out (leto.integrity.faulty).
    exclude_faulty: bool = False
    checkpoint_dir: str = ""  # empty: <log_dir>/checkpoints
    checkpoint_interval: int = 0  # iterations; 0: Young's formula with the FF-only MTTF
    # --no-checkpoints: no saves at all; a fatal failure restarts the job from its first
    # iteration (bit-exact, from the seed). For runs that only measure (benchmarks at
    # sizes whose checkpoints outgrow the disk), not for jobs that must not lose work.
    checkpointing: bool = True
    mttf_s: float = 3600.0  # expected time between failures of any class (for Young)
    hof_ratio: float = 0.5  # expected fraction of failures Leto recovers in place
    # "in-place" (Leto), or "checkpoint": every failure restarts all ranks cold from the
    # newest checkpoint on fresh pools — the torchrun + DCP baseline, for comparisons.
    recovery: str = "in-place"
    # --shadow-level auto (issue 8): the preinitialization controller's inputs. Device
    # memory the active trainer and its shadow share: 0 = the device's total (a GPU);
    # on the CPU a positive value makes an emulated device of that size.
    device_memory_bytes: int = 0
    preinit_footprints: str = ""  # JSON {l1_bytes, l2_bytes, l3_bytes}; "": the paper's
    preinit_margin_bytes: int = 2 << 30  # kept free above the active peak when choosing
    reclaim_below_bytes: int = 1 << 30  # the allocation hook's gate (device free memory)
    # The script's output on leto run's console (leto.launch.relay): "stdout" (as
    # torchrun), "stderr" (leto run --json: stdout carries the summary) or "off".
    console: str = "stdout"
    local_ranks_filter: tuple[int, ...] | None = None  # the local ranks shown (None: all)
    # Where the update's undo copies come from: "chunk" (each chunk copied just before
    # its update) or "ahead" (the whole retained state copied once an iteration beside
    # forward and backward; as much device memory again as the optimizer state and
    # parameters). leto.update.rmu.
    undo: str = "chunk"

    def __post_init__(self) -> None:
        if self.ranks_per_gpu < 1:
            raise ValueError(f"--ranks-per-gpu {self.ranks_per_gpu}: at least 1")
        if self.ranks_per_gpu > 1 and self.device != "cuda":
            raise ValueError(
                f"--ranks-per-gpu {self.ranks_per_gpu} shares GPUs: it needs --device cuda"
            )
        if self.shadow_level not in LEVELS and self.shadow_level != "auto":
            raise ValueError(f"--shadow-level {self.shadow_level!r}: use auto, off, L1, L2 or L3")
        if self.recovery not in ("in-place", "checkpoint"):
            raise ValueError(f"--recovery {self.recovery!r}: use in-place or checkpoint")
        if not self.checkpointing and self.recovery == "checkpoint":
            raise ValueError(
                "--recovery checkpoint restarts from checkpoints: drop --no-checkpoints"
            )
        if not self.checkpointing and self.checkpoint_dir:
            raise ValueError(
                f"--checkpoint-dir {self.checkpoint_dir!r} with --no-checkpoints: choose one"
            )
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"--log-level {self.log_level!r}: DEBUG, INFO, WARNING or ERROR")
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError("--nnodes and --nproc-per-node must be at least 1")
        if self.scrub_mib is None:
            object.__setattr__(self, "scrub_mib", 64.0 if self.device == "cuda" else 1.0)
        if not self.scrub_mib >= 0:
            raise ValueError(f"--scrub-mib-per-iteration {self.scrub_mib}: expected >= 0")
        if self.replay_every < 0:
            raise ValueError(f"--replay-every {self.replay_every}: expected >= 0 (0: off)")
        if self.device_memory_bytes < 0:
            raise ValueError(f"--device-memory-bytes {self.device_memory_bytes} is negative")
        if self.undo not in UNDO_MODES:
            raise ValueError(f"--undo {self.undo!r}: use {' or '.join(UNDO_MODES)}")
        if self.console not in ("stdout", "stderr", "off"):
            raise ValueError(f"console={self.console!r}: stdout, stderr or off")
        bad = [r for r in self.local_ranks_filter or () if not 0 <= r < self.nproc_per_node]
        if bad:
            raise ValueError(
                f"--local-ranks-filter {','.join(map(str, self.local_ranks_filter))}: local "
                f"ranks are 0..{self.nproc_per_node - 1} (--nproc-per-node "
                f"{self.nproc_per_node}); nothing started"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def checkpoints(self) -> str:
        """Where the trainers save; "" under --no-checkpoints."""
        import os

        if not self.checkpointing:
            return ""
        return os.path.abspath(self.checkpoint_dir or os.path.join(self.log_dir, "checkpoints"))

    def level(self) -> str:
        """``auto``: the highest level; the controller (``controlled``) then chooses."""
        return "L3" if self.shadow_level == "auto" else self.shadow_level

    @property
    def controlled(self) -> bool:
        """Whether the preinitialization controller chooses shadow levels: ``auto`` on a
        GPU, or on the CPU with an emulated device (``device_memory_bytes``)."""
        return self.shadow_level == "auto" and (
            self.device != "cpu" or self.device_memory_bytes > 0
        )
