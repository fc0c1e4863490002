"""Where a trainer's time goes from its start (or its promotion) to the end of its first
iteration, and how fast its generation was training: the figures behind recovery as the
paper measures it (§8: initialization I, then recomputation R until the interrupted
iteration has completed again).

Runs in a trainer. ``StageClock.mark(name)`` closes the stage that ends there; on a GPU
it first waits for the device, so each stage holds its own kernels (only until the first
iteration is over: a steady iteration is never synchronized by it). Stages, in order:

* ``init`` — promotion (a shadow) or process start to ``leto.init()``'s return;
* ``script set-up`` — the script's code between ``leto.init()`` and ``leto.Run`` (its
  model, optimizer, scheduler and data);
* ``bind``, ``resume``, ``Run's end`` — ``leto.Run``: the parameters made views of the
  pool, the retained state recovered, then the checkpointer's set-up;
* ``script to loop`` — the script's code between ``leto.Run`` and its loop;
* ``loop start`` — the first ``next()`` of ``run.iterations()`` before the body
  (heartbeat, the scrub's slice, the iteration's set-up);
* ``forward/backward``, ``update``, ``after step`` — the first iteration, its body
  until ``optimizer.step()``, the update, and the script's code after it.

``Pace`` is written with every heartbeat: when the iteration in progress began, the
generation's steady iteration time and how many iterations the process has finished
(``done``), so that a later generation can tell how much of the interrupted iteration a
fault-free run still had ahead (the agent's ``leto.launch.recovery.regained``), and a
parked L3 shadow when its trainer's memory has peaked (``leto.trainer.run_ahead``).

Not covered: time before ``leto.init()`` in a fresh process (the interpreter, the
script's imports: the rank log's first line says when the process started); other ranks'
stages (each reports its own; the agent takes the slowest).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from leto import rank_log

STAGES = (
    "init",
    "script set-up",
    "bind",
    "resume",
    "Run's end",
    "script to loop",
    "loop start",
    "forward/backward",
    "update",
    "after step",
)


class StageClock:
    """Stage times of one process's way to the end of its first iteration."""

    def __init__(self, rank: int, device: torch.device, started_at: float):
        self.rank, self.device = rank, device
        self.started_at = started_at
        self._last = started_at
        self.stages: dict[str, float] = {}
        self.at: dict[str, float] = {}  # wall time each stage ended
        self.open = True

    def mark(self, name: str) -> None:
        """Close stage ``name`` now (after the device's queued work, on a GPU)."""
        if not self.open:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.time()
        self.stages[name] = self.stages.get(name, 0.0) + now - self._last
        self.at[name] = now
        self._last = now

    def close(self) -> dict:
        """The first iteration is over: the stages in the rank log, and the figures a
        recovery record takes (``loop_at``: the loop body began; ``first_iteration_s``:
        the body to the end of the iteration)."""
        self.open = False
        said = ", ".join(f"{k} {v:.3f} s" for k, v in self.stages.items())
        total = self._last - self.started_at
        rank_log.say(self.rank, f"to the end of the first iteration {total:.3f} s: {said}")
        out = {"stages": dict(self.stages), "first_iteration_end": self._last}
        if "loop start" in self.at:
            out["loop_at"] = self.at["loop start"]
            out["first_iteration_s"] = self._last - self.at["loop start"]
        return out


class Pace:
    """This generation's progress, for the next one's recovery figures: the iteration in
    progress, when it began (wall time) and the median of the recent iteration times."""

    KEEP = 16  # iteration times the median is taken over (the most recent)

    def __init__(self):
        self._began: tuple[int, float] | None = None
        self._times: list[float] = []
        self.done = 0  # iterations this process finished (each began and another since)

    def began(self, iteration: int) -> str:
        """Iteration ``iteration`` begins now; returns the JSON to store for it."""
        now = time.time()
        if self._began is not None and iteration != self._began[0]:
            self.done += 1
        if self._began is not None and iteration == self._began[0] + 1:
            self._times = [*self._times[-(self.KEEP - 1) :], now - self._began[1]]
        self._began = (iteration, now)
        # The first iteration of a process is no steady one (warm-up, lazy set-up).
        steady = statistics.median(self._times[1:]) if len(self._times) > 1 else None
        return json.dumps(
            {"iteration": iteration, "began_at": now, "steady_s": steady, "done": self.done}
        )
