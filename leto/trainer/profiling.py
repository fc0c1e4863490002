"""Where a recovery and the first iteration after it spend their time
(``LETO_PROFILE_RECOVERY=DIR``, ``bench.recovery_speed --profile-recovery``).

Runs in a trainer. Two profiles per process, written under DIR:

* ``rank<r>.gen<g>.profile.txt`` — cProfile from promotion (or a cold restart, or, with
  ``LETO_PROFILE_START=1``, a fresh start's ``leto.init()``) until the end of the
  trainer's first iteration (the stages of ``leto.trainer.first_iteration``);
* ``rank<r>.gen<g>.iteration.txt`` — one whole iteration (beat to beat: compute,
  update, the verifiers' record), by cProfile and by torch.profiler with CUDA activity
  (the CUDA runtime calls — allocations, module loads, synchronizations — and kernels):
  a recovered trainer's first iteration in its process, or, in a first-generation
  trainer, its third (a steady one, to compare with) — or the iterations
  ``LETO_PROFILE_WINDOW=FIRST:COUNT`` names;
* ``rank<r>.gen<g>.trace.json`` — the same window's torch.profiler trace (Chrome
  format), Leto's work in named ranges (``leto.ranges``): ``bench.update_breakdown``
  attributes every kernel and copy to the range that launched it.

Not covered: other ranks' time in the collectives they wait in (each rank profiles only
itself); the profilers' own overhead is in the figures.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

import torch


def _window(text: str) -> tuple[int, int]:
    """``"FIRST:COUNT"`` -> the beats that open and close the window."""
    try:
        first, count = (int(v) for v in text.split(":"))
    except ValueError:
        first = count = 0
    if first < 1 or count < 1:
        raise ValueError(
            f"LETO_PROFILE_WINDOW={text!r}: expected FIRST:COUNT, both at least 1 (e.g. 3:1)"
        )
    return first, first + count


def _stats(p: cProfile.Profile, n_cumulative: int = 60, n_own: int = 40) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(p, stream=buf)
    stats.sort_stats("cumulative").print_stats(n_cumulative)
    stats.sort_stats("tottime").print_stats(n_own)
    return buf.getvalue()


class Profiles:
    def __init__(
        self, folder: str, rank: int, generation: int, device: torch.device, window: str = "3:1"
    ):
        self.dir = Path(folder)
        self.stem = f"rank{rank}.gen{generation}"
        self.device = device
        # Beats (iteration starts) of this process between which iterations are profiled.
        self.window = (1, 2) if generation > 0 else _window(window)
        self.beats = 0
        self.recovery: cProfile.Profile | None = None
        self.iteration: tuple[cProfile.Profile, object] | None = None

    def start_recovery(self) -> None:
        self.recovery = cProfile.Profile()
        self.recovery.enable()

    def recovery_done(self) -> None:
        if self.recovery is None:
            return
        self.recovery.disable()
        self._write("profile", _stats(self.recovery))
        self.recovery = None

    def beat(self) -> int:
        """Called as each iteration starts. Returns +1 when the profiled iteration
        starts, -1 when it has ended and its profile is written, else 0: the caller
        holds the agent's hang detection to the general timeout in between (a profiled
        iteration is slower; at 5 B parameters on the H200 a profiled job's trainers kept
        failing, cause unknown — docs/benchmarks.md)."""
        self.beats += 1
        if self.beats == self.window[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            tp = torch.profiler.profile(activities=activities)
            tp.start()
            # A recovered trainer's recovery profile runs to the end of its first
            # iteration (one cProfile at a time): its own file holds that iteration's.
            cp = None
            if self.recovery is None:
                cp = cProfile.Profile()
                cp.enable()
            self.iteration = (cp, tp)
            return 1
        if self.beats == self.window[1]:
            return self.loop_ended()
        return 0

    def loop_ended(self) -> int:
        """The loop is over: a window open over its last iteration closes here, before
        the end-of-training scrub and the final state's copy (not an iteration's work).
        Returns -1 when it closed one, else 0."""
        if self.iteration is None:
            return 0
        cp, tp = self.iteration
        if cp is not None:
            cp.disable()
        tp.stop()
        table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
        if self.device.type == "cuda":
            by_gpu = tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
            table += "\n" + by_gpu
        self._write("iteration", table + ("\n" + _stats(cp, 50, 40) if cp is not None else ""))
        tp.export_chrome_trace(str(self.dir / f"{self.stem}.trace.json"))
        self.iteration = None
        return -1

    def _write(self, what: str, text: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"{self.stem}.{what}.txt").write_text(text)
