"""The active trainer's side of the preinitialization controller (paper §6).

Runs in the active trainer under ``leto run --shadow-level auto``; ``Context.heartbeat``
calls ``Guard.beat`` once per iteration, before the beat itself:

* it arms the allocation-path hook (``reclaim.py``) for the parked shadow of the next
  generation as soon as that shadow says it parked (``parked_key``; a shadow writes
  its pid and level there), with its level's footprint as the memory to wait for;
* it reports to its agent, through the job store, every reclamation the hook made
  (``reclaims_key``) and then its device memory (``memory_key``). The agent reads them
  when the beat moves, so when it finds a shadow dead it knows whether the hook
  reclaimed it (relaunch lower) or it crashed (replace at the same level).

On a GPU the hook is ``reclaim.cpp`` in PyTorch's caching allocator and memory is
``cudaMemGetInfo``. On the CPU (``--device cpu --device-memory-bytes N``) the device is
**emulated**: the trainer's memory is the growth of its anonymous RSS since it started,
a shadow holds its level's footprint until it exits (``EmulatedDevice``), and the hook
is the Python twin, run at each iteration boundary because a CPU allocation has no
cache-miss callback. Reports say which ran (``"emulated": true``).

Not covered: the window between a shadow's launch and its first report, in which the
hook is not yet armed for it (the controller launched it with ``margin_bytes`` of
headroom for that reason).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from leto.errors import InvalidInput
from leto.job import keys
from leto.job.config import ENV_PREINIT  # the agent sets it: GuardConfig JSON
from leto.preinit.policy import Footprints
from leto.proc import alive


def parked_key(generation: int, rank: int) -> str:
    """A shadow of ``generation`` writes {"pid", "level"} here once it has parked."""
    return keys.parked(generation, rank)


def memory_key(generation: int, rank: int) -> str:
    return keys.memory(generation, rank)


def reclaims_key(generation: int, rank: int) -> str:
    """Counter of reclamations the trainer of ``generation`` reported; event k (from 1)
    is at ``reclaims_key(...) + f"/{k}"``."""
    return keys.reclaims(generation, rank)


@dataclass(frozen=True)
class GuardConfig:
    footprints: Footprints
    reclaim_below_bytes: int
    capacity_bytes: int  # the emulated device's size on CPU (on a GPU: informational)
    emulated: bool

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "footprints": asdict(self.footprints)})

    @classmethod
    def from_json(cls, text: str) -> GuardConfig:
        try:
            d = json.loads(text)
            return cls(
                Footprints.from_dict(d["footprints"]),
                int(d["reclaim_below_bytes"]),
                int(d["capacity_bytes"]),
                bool(d["emulated"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidInput(f"{ENV_PREINIT} is not a valid guard configuration: {e}") from e


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no RssAnon line")


class Guard:
    def __init__(self, store, rank: int, generation: int, device: torch.device, cfg: GuardConfig):
        from leto.preinit import reclaim

        self.store, self.rank, self.generation = store, rank, generation
        self.device, self.cfg = device, cfg
        self._pid: int | None = None  # the shadow the hook was armed for
        self._level: str | None = None
        self._reported = 0
        if device.type == "cuda" and not cfg.emulated:
            self.hook = reclaim.install_cuda_hook()
            self.emu = None
        else:
            self.emu = reclaim.EmulatedDevice(cfg.capacity_bytes)
            self.hook = reclaim.Reclaimer(self.emu.free_bytes)
            self._rss0 = _rss_anon()

    @property
    def armed_for(self) -> tuple[int, str] | None:
        """(pid, level) of the shadow the hook is armed for; None when not armed."""
        if self._pid is None or not self.hook.stats().armed:
            return None
        return self._pid, self._level

    def _emulate_active(self) -> None:
        # The emulated device's active memory: this trainer's anonymous RSS growth.
        self.emu.active_bytes = max(0, _rss_anon() - self._rss0)

    def _arm(self) -> None:
        key = parked_key(self.generation + 1, self.rank)
        if not self.store.check([key]):
            return
        parked = json.loads(self.store.get(key))
        pid, level = int(parked["pid"]), parked["level"]
        if pid == self._pid:
            return  # armed already, or reclaimed (the hook disarms itself after one)
        self._pid, self._level = pid, level
        nbytes = self.cfg.footprints.of(level)
        if nbytes <= 0:
            self.hook.disarm()  # L1 holds no device memory: nothing to reclaim
            return
        try:
            if self.emu is not None:
                self.emu.hold(pid, nbytes)
            self.hook.arm(
                pid,
                expected_release_bytes=nbytes,
                reclaim_below_bytes=self.cfg.reclaim_below_bytes,
                device=self.device.index or 0,
            )
        except (InvalidInput, ProcessLookupError):
            self.hook.disarm()  # that shadow is gone already: its agent replaces it

    def memory(self) -> dict:
        """This trainer's device memory now: ``active_bytes`` excludes the armed
        shadow's footprint while it lives."""
        if self.emu is not None:
            self._emulate_active()
            free, total = self.emu.free_bytes(), self.cfg.capacity_bytes
        else:
            free, total = torch.cuda.mem_get_info(self.device)
        shadow = 0
        if self._pid is not None and alive(self._pid):
            shadow = self.cfg.footprints.of(self._level)
        return {
            "t": time.time(),
            "active_bytes": max(0, total - free - shadow),
            "free_bytes": free,
            "total_bytes": total,
            "shadow_level": self._level if shadow else None,
            "emulated": self.emu is not None,
        }

    def beat(self) -> None:
        self._arm()
        if self.emu is not None:
            self._emulate_active()
            self.hook.on_cache_miss()  # the emulated allocation path (see the docstring)
        self.store.set(memory_key(self.generation, self.rank), json.dumps(self.memory()))
        for ev in self.hook.events(self._reported):
            self._reported += 1
            d = {**asdict(ev), "outcome": ev.outcome.value}
            key = reclaims_key(self.generation, self.rank)
            self.store.set(f"{key}/{self._reported}", json.dumps(d))
            self.store.add(key, 1)

    def free_bytes(self) -> int:
        """Device free memory as the hook sees it (the emulated device's on CPU), with
        the parked shadow, if any, already accounted."""
        self._arm()
        if self.emu is not None:
            self._emulate_active()
            return self.emu.free_bytes()
        return torch.cuda.mem_get_info(self.device)[0]
