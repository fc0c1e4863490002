"""PNG plots of a reference run and faulted runs, from their traces.

Runs in whatever process verifies (``python -m verifiers report``), after the runs.
Makes two figures, modelled on the paper's §8.4:

* ``loss.png`` (like Fig. 12): one rank's loss per iteration, reference and every run,
  injections as dotted vertical lines at their iteration, NaN losses as crosses on top;
* ``throughput.png`` (like Fig. 11): one panel per run, iterations per second over wall
  time (one step per record, ``1 / seconds since the previous record``), recovery
  shaded, recomputation hatched.

Recovery runs from an injection mark (or, without one, the ``since`` of the first
``recovered`` mark, else the last record before it) to the last ``recovered`` mark of any
rank. Recomputation runs from there until the rank records, for the first time after the
fault, an iteration beyond every iteration it had recorded before the fault: the re-run
iterations plus the interrupted one (zero when recovery itself finished it).

Uses matplotlib's ``Figure`` with the Agg canvas directly (never pyplot): no global
backend state, no display needed. Not covered: checkpoint notches, multi-rank
throughput (one rank is plotted; data-parallel ranks step together), ETTR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from leto.errors import InvalidInput
from verifiers.trace import EVENT_INJECTION, EVENT_RECOVERED, Run, Trace, read_run


@dataclass(frozen=True)
class RecoveryWindow:
    start_s: float  # wall time the fault hit (or recovery began)
    end_s: float | None  # wall time training resumed; None: it never did
    recompute_end_s: float | None  # wall time recomputation ended; None: nothing recomputed
    iteration: int  # the iteration of the injection (or of the recovered mark)
    recomputed: tuple[int, ...]  # iterations recorded during recomputation


def recovery_windows(run: Run, rank: int) -> list[RecoveryWindow]:
    """Recovery and recomputation intervals of ``run``, recomputation seen from ``rank``."""
    trace = _trace(run, rank)
    raw: list[list] = []  # [start, iteration, [ends]]
    for m in run.marks():
        cur = raw[-1] if raw else None
        if m.event == EVENT_INJECTION:
            # Several marks of one failure (victim and harness) open one window.
            if cur is None or cur[2]:
                raw.append([m.wall_time, m.iteration, []])
        elif m.event == EVENT_RECOVERED:
            since = m.info.get("since")
            new_failure = since is not None and cur is not None and cur[2] and since > max(cur[2])
            if cur is None or new_failure:
                start = since if since is not None else _last_record_before(run, m.wall_time)
                raw.append([start, m.iteration, []])
            raw[-1][2].append(m.wall_time)
    windows = []
    for start, iteration, ends in raw:
        end = max(ends) if ends else None
        before = [r.iteration for r in trace.history if r.wall_time <= start]
        max_before = max(before, default=-1)
        after = [r for r in trace.history if r.wall_time > start]
        done = next((r for r in after if r.iteration > max_before), None)
        recompute_end = None
        recomputed: tuple[int, ...] = ()
        if end is not None and done is not None and done.wall_time > end:
            recompute_end = done.wall_time
            recomputed = tuple(r.iteration for r in after if end < r.wall_time <= recompute_end)
        windows.append(RecoveryWindow(start, end, recompute_end, iteration, recomputed))
    return windows


def throughput_steps(
    trace: Trace, windows: list[RecoveryWindow]
) -> list[tuple[float, float, float]]:
    """(from_s, to_s, iterations per second) between consecutive records, in wall time.

    A step that spans a fault counts 0: the iteration in flight was lost.
    """
    recs = sorted(trace.history, key=lambda r: r.wall_time)
    steps = []
    for p, q in zip(recs, recs[1:], strict=False):
        dt = q.wall_time - p.wall_time
        spans_fault = any(p.wall_time <= w.start_s < q.wall_time for w in windows)
        rate = 0.0 if spans_fault or dt <= 0 else 1.0 / dt
        steps.append((p.wall_time, q.wall_time, rate))
    return steps


def _last_record_before(run: Run, t: float) -> float:
    times = [r.wall_time for tr in run.traces.values() for r in tr.history if r.wall_time <= t]
    return max(times, default=t)


def _trace(run: Run, rank: int) -> Trace:
    if rank not in run.traces:
        raise InvalidInput(
            f"{run.path} has no trace of rank {rank} (ranks {sorted(run.traces)}); pass --rank"
        )
    return run.traces[rank]


def _label(run: Run) -> str:
    return run.path.name or str(run.path)


def _origin(run: Run) -> float:
    times = [r.wall_time for t in run.traces.values() for r in t.history]
    times += [m.wall_time for m in run.marks()]
    return min(times, default=0.0)


def plot_loss(reference: Run, runs: list[Run], path: Path, rank: int = 0) -> Path:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for i, run in enumerate([reference, *runs]):
        recs = sorted(_trace(run, rank).records.values(), key=lambda r: r.iteration)
        xs = [r.iteration for r in recs]
        ys = [r.loss for r in recs]
        color = "black" if i == 0 else f"C{i - 1}"
        label = f"{_label(run)} (reference)" if i == 0 else _label(run)
        style = dict(linestyle="-", linewidth=2.0) if i == 0 else dict(linestyle="--", marker=".")
        ax.plot(xs, ys, color=color, label=label, **style)
        bad = [x for x, y in zip(xs, ys, strict=True) if not math.isfinite(y)]
        if bad:  # NaN/inf have no place on the axis: cross them at the top edge
            ax.plot(bad, [0.98] * len(bad), "x", color=color, transform=ax.get_xaxis_transform())
        injected = sorted({m.iteration for m in run.marks() if m.event == EVENT_INJECTION})
        for j, it in enumerate(injected):
            ax.axvline(
                it,
                color=color,
                linestyle=":",
                linewidth=1.0,
                label=f"injection ({_label(run)})" if j == 0 else None,
            )
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"training loss (rank {rank})")
    ax.set_title("Training loss: fault-free reference vs faulted runs")
    ax.legend(loc="best", fontsize="small")
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_throughput(reference: Run, runs: list[Run], path: Path, rank: int = 0) -> Path:
    all_runs = [reference, *runs]
    fig = Figure(figsize=(8, 2.2 * len(all_runs) + 0.6), layout="constrained")
    axes = fig.subplots(len(all_runs), 1, sharex=True, squeeze=False)[:, 0]
    for i, (ax, run) in enumerate(zip(axes, all_runs, strict=True)):
        t0 = _origin(run)
        windows = recovery_windows(run, rank)
        xs, ys = [], []
        for a, b, rate in throughput_steps(_trace(run, rank), windows):
            xs += [a - t0, b - t0]
            ys += [rate, rate]
        color = "black" if i == 0 else f"C{i - 1}"
        ax.plot(xs, ys, color=color, linewidth=1.2, label="iterations/s")
        last = max(xs, default=0.0)
        for j, w in enumerate(windows):
            end = w.end_s - t0 if w.end_s is not None else last
            ax.axvspan(
                w.start_s - t0,
                end,
                color="tab:red",
                alpha=0.25,
                label="recovery" if j == 0 else None,
            )
            if w.recompute_end_s is not None:
                ax.axvspan(
                    end,
                    w.recompute_end_s - t0,
                    facecolor="none",
                    edgecolor="tab:orange",
                    hatch="///",
                    label="recomputation" if j == 0 else None,
                )
        ax.set_ylabel("iter/s")
        ax.set_title(_label(run) + (" (reference)" if i == 0 else ""), fontsize="medium")
        ax.legend(loc="lower right", fontsize="x-small")
    axes[-1].set_xlabel(f"wall time since the run's first event (s), rank {rank}")
    fig.savefig(path, dpi=120)
    return Path(path)


def report(reference: Path, runs: list[Path], out_dir: Path, rank: int = 0) -> list[Path]:
    """Write ``loss.png`` and ``throughput.png`` into ``out_dir``; returns their paths."""
    ref = read_run(Path(reference))
    got = [read_run(Path(r)) for r in runs]
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidInput(
            f"cannot create output directory {out_dir}: {e}; nothing was plotted"
        ) from e
    return [
        plot_loss(ref, got, out_dir / "loss.png", rank),
        plot_throughput(ref, got, out_dir / "throughput.png", rank),
    ]
