"""Discrete-event simulation of a training job replaying a failure schedule.

Owns the event loop that runs a modelled job (iteration time, checkpoint policy,
per-system recovery costs from ``leto.sim.model.System``) through a
``leto.sim.schedule.Schedule`` and measures what the analytic model only assumes:
ETTR as the paper measures it (``T_ref(i) / T_eval(i)`` at the last completed iteration
``i``, §8.1), the per-failure breakdown into detection, initialisation and
recomputation, failures that land during a recovery, and wasted GPU-hours.

The job, iteration by iteration:

* iteration k takes ``(1 + ω) T_iter``, plus ``T_ckpt = p T_iter`` when ``k`` is a
  multiple of the checkpoint interval I (the iteration that commits the checkpoint);
* the checkpoint of iteration k becomes usable once iteration k + 1 completes (its
  transfer overlaps the next iteration, Appendix C.3), so a rollback loses between 1 and
  I completed iterations plus the elapsed part of the one in flight;
* a failure stops the job for ``T_det + T_init`` (class-dependent); a rollback restarts
  from the last usable checkpoint, Leto's in-place HOF recovery from the last completed
  iteration; recomputation is the time from resuming until the job regains the progress
  it had when the failure struck (the paper's ``R = t_{i+1} - t_j - t_remain``).

Failures during a recovery. One landing in detection or initialisation restarts the
recovery from its own arrival (``restarted``); the recovery takes the slower path if
any failure in it is one that needs the checkpoint path (FF dominates HOF). One landing
while the job recomputes (``during_recompute``) is an ordinary failure at the job's
current progress, and the job must then regain the older, higher progress. Each
record's times are what was actually spent before the next failure cut it short, so
records sum to the total recovery time.

Runs in any process; cost is O(failures), not O(iterations): progress between events is
computed in closed form. Not covered: failures of the spare pool itself, hang detection
timeouts (``T_det`` is a constant), stragglers, and time-varying iteration times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leto.errors import InvalidInput
from leto.sim.model import LETO, System
from leto.sim.schedule import Schedule


@dataclass(frozen=True)
class FailureRecord:
    """What one failure cost; times in seconds."""

    at_s: float
    kind: str
    rank: int
    detection_s: float
    init_s: float
    recompute_s: float
    lost_iterations: int  # completed iterations rolled back by this failure
    lost_inflight_s: float  # elapsed part of the iteration in flight, discarded
    restarted: bool  # landed in another failure's detection or initialisation
    during_recompute: bool  # landed while the job regained an earlier failure's progress
    recovered: bool  # the job regained its pre-failure progress before the next failure

    @property
    def recovery_s(self) -> float:
        return self.detection_s + self.init_s + self.recompute_s


@dataclass(frozen=True)
class SimResult:
    system: str
    interval: int
    duration_s: float
    iterations: int  # index of the last completed iteration
    last_iteration_end_s: float
    ettr: float
    failures: tuple[FailureRecord, ...]
    wasted_gpu_hours: float  # (duration - iterations * T_iter) * GPUs: every non-productive second
    recovery_gpu_hours: float  # detection + init + recompute, * GPUs

    @property
    def recovery_restarts(self) -> int:
        return sum(r.restarted for r in self.failures)

    @property
    def during_recompute(self) -> int:
        return sum(r.during_recompute for r in self.failures)

    def mean_recovery_s(self, kind: str | None = None) -> float:
        rs = [r.recovery_s for r in self.failures if kind is None or r.kind == kind]
        return sum(rs) / len(rs) if rs else math.nan


class _Timeline:
    """Iteration durations of the modelled job and closed-form progress over time."""

    def __init__(self, base_s: float, ckpt_s: float, interval: int) -> None:
        self.base_s, self.ckpt_s, self.interval = base_s, ckpt_s, interval

    def between(self, c0: int, c1: int) -> float:
        """Seconds to run iterations c0+1 .. c1."""
        n_ckpt = c1 // self.interval - c0 // self.interval
        return (c1 - c0) * self.base_s + n_ckpt * self.ckpt_s

    def duration(self, k: int) -> float:
        return self.between(k - 1, k)

    def advance(self, c: int, e: float, dt: float) -> tuple[int, float, float | None]:
        """Run ``dt`` seconds from ``e`` seconds into iteration ``c + 1``. Returns the new
        completed count, the time into the next iteration, and the offset within ``dt`` of
        the last completion (None if none completed)."""
        first = self.duration(c + 1) - e
        if dt < first:
            return c, e + dt, None
        c += 1
        left = dt - first
        avg = self.base_s + self.ckpt_s / self.interval
        n = int(left // avg)
        while n > 0 and self.between(c, c + n) > left:
            n -= 1
        while self.between(c, c + n + 1) <= left:
            n += 1
        used = self.between(c, c + n)
        return c + n, left - used, first + used


def simulate(
    schedule: Schedule, system: System, t_iter_s: float, ckpt_p: float, interval: int, gpus: int = 1
) -> SimResult:
    """Replay ``schedule`` on a job of ``t_iter_s`` seconds per iteration that checkpoints
    every ``interval`` iterations at a cost of ``ckpt_p * t_iter_s`` (Leto: for FFs)."""
    if not (math.isfinite(t_iter_s) and t_iter_s > 0):
        raise InvalidInput(f"t_iter_s={t_iter_s!r}: expected a finite time > 0 s")
    if not (isinstance(interval, int) and interval >= 1):
        raise InvalidInput(f"interval={interval!r}: expected an integer >= 1")
    omega = system.omega if system.kind == LETO else 0.0
    tl = _Timeline((1.0 + omega) * t_iter_s, ckpt_p * t_iter_s, interval)
    end = schedule.duration_s

    t = 0.0  # wall clock: the job is running from t, or down until `down_until`
    c, e = 0, 0.0  # completed iterations, seconds into the one in flight
    usable = 0  # last usable checkpoint (iteration 0 is the initial state)
    last_c, last_t = 0, 0.0
    down_until: float | None = None
    ckpt_path = False  # the open recovery takes the checkpoint path
    target: tuple[int, float] | None = None  # progress to regain
    resumed_at = 0.0
    open_rec: dict | None = None  # the latest failure's record, still being timed
    records: list[FailureRecord] = []

    def close(**kw) -> None:
        nonlocal open_rec
        records.append(FailureRecord(**(open_rec | kw)))
        open_rec = None

    def cut_in_init(at_s: float) -> None:
        spent = at_s - open_rec["at_s"]
        det = min(spent, open_rec["detection_s"])
        close(detection_s=det, init_s=max(spent - det, 0.0), recompute_s=0.0, recovered=False)

    def resume() -> None:
        nonlocal t, down_until, resumed_at
        t, down_until, resumed_at = down_until, None, down_until

    def run_until(t_stop: float) -> None:
        """Run from ``t`` to ``t_stop`` (called once per span, right after resuming when a
        recovery is open); close the recovery if the job regains its target in time."""
        nonlocal t, c, e, usable, last_c, last_t, target
        if target is not None:
            done_at = t + tl.between(c, target[0]) + target[1]
            if done_at <= t_stop:
                if open_rec is not None:
                    close(recompute_s=done_at - resumed_at, recovered=True)
                target = None
        c2, e2, last = tl.advance(c, e, t_stop - t)
        if last is not None:
            last_c, last_t = c2, t + last
        c, e, t = c2, e2, t_stop
        if c >= 1:
            usable = max(usable, interval * ((c - 1) // interval))

    for f in schedule.failures:
        restarted = down_until is not None and f.at_s < down_until
        during_recompute = False
        if restarted:
            cut_in_init(f.at_s)
        else:
            if down_until is not None:
                resume()
            run_until(f.at_s)
            if open_rec is not None:
                close(recompute_s=f.at_s - resumed_at, recovered=False)
                during_recompute = True
            ckpt_path = False
        if target is None or (c, e) > target:
            target = (c, e)
        lost_iterations, lost_inflight = 0, e
        if system.rolls_back(f.kind):
            lost_iterations, c = c - usable, usable
            ckpt_path = True
        e = 0.0
        init = system.t_init_s if ckpt_path else system.init_s(f.kind)
        down_until = f.at_s + system.t_det_s + init
        open_rec = {
            "at_s": f.at_s,
            "kind": f.kind,
            "rank": f.rank,
            "detection_s": system.t_det_s,
            "init_s": init,
            "lost_iterations": lost_iterations,
            "lost_inflight_s": lost_inflight,
            "restarted": restarted,
            "during_recompute": during_recompute,
        }

    # Run out the clock.
    if down_until is not None and down_until >= end:
        cut_in_init(end)
    else:
        if down_until is not None:
            resume()
        run_until(end)
        if open_rec is not None:
            close(recompute_s=end - resumed_at, recovered=False)

    ettr = last_c * t_iter_s / last_t if last_t > 0 else 0.0
    recovery_s = sum(r.recovery_s for r in records)
    return SimResult(
        system=system.name,
        interval=interval,
        duration_s=end,
        iterations=last_c,
        last_iteration_end_s=last_t,
        ettr=ettr,
        failures=tuple(records),
        wasted_gpu_hours=max(end - c * t_iter_s, 0.0) * gpus / 3600.0,
        recovery_gpu_hours=recovery_s * gpus / 3600.0,
    )
