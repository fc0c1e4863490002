"""Where Leto's per-iteration cost goes on the user path: the GPU time of each piece Leto
adds, per iteration, from a torch.profiler trace of the port under ``leto run``.

Runs ``leto run`` (its default flags, plus any ``--leto-flags``) on the nanoGPT-style port
of ``bench.user_path`` (same presets and ``--script-args``) with the trainer's profiler on
for ``--window FIRST:COUNT`` iterations (``LETO_PROFILE_WINDOW``; rank 0's trace). Every
kernel, copy and memset in the trace is attributed to the innermost ``leto.<name>`` range
(``leto.ranges``) open on the thread that launched it; what no range launched is the
script's own work (forward, backward, its reductions) and shows as ``(script)``. Reported
per iteration: GPU milliseconds and launches of each range, the host milliseconds spent
inside each range, the union of GPU-busy time and the trace's span. Then, for the cost
of the update itself, torch's fused AdamW stepping the same parameters (two groups, as
the script) — measured in this process, labelled as such: it is the update a torchrun
user runs instead of Leto's chunk pass.

    python -m bench.update_breakdown --preset h200-1b --window 4:3 \\
        --script-args=--deterministic --json out/breakdown.json

What the figures are not: the profiler slows the traced iterations (their wall times are
reported but are not the user path's; ``bench.user_path`` measures that), GPU times of
work on different streams overlap (the sum of the ranges can exceed the busy time), and
a range's host time includes the waits inside it.

Not covered: the other ranks (rank 0 only), the state manager's and shadows' processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from bench import user_path as up

SCRIPT = "(script)"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def attribute(trace: dict) -> dict:
    """Per range name, GPU microseconds and launches (by kind), and host microseconds
    inside the range; plus the GPU-busy union and the trace's span, all in µs.

    A GPU event belongs to the innermost ``leto.*`` range open on its launching thread
    when it was launched (matched by the trace's correlation ids); ranges nest within a
    thread, so one sweep in time order with a stack finds it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    per_thread: dict[tuple, list] = defaultdict(list)  # (pid, tid) -> sweep items
    host_us: dict[str, float] = defaultdict(float)
    gpu = []
    for e in events:
        cat, name = e.get("cat", ""), e.get("name", "")
        where = (e.get("pid"), e.get("tid"))
        if cat == "user_annotation" and name.startswith("leto."):
            label = name[len("leto.") :]
            # (time, order, ...): at one instant a range opens before a launch in it and
            # closes after it.
            per_thread[where].append((e["ts"], 0, "open", label))
            per_thread[where].append((e["ts"] + e.get("dur", 0.0), 2, "close", label))
            host_us[label] += e.get("dur", 0.0)
        elif cat in LAUNCH_CATS and "correlation" in e.get("args", {}):
            per_thread[where].append((e["ts"], 1, "launch", e["args"]["correlation"]))
        elif cat in GPU_CATS:
            gpu.append(e)
    owner: dict[int, str] = {}
    for items in per_thread.values():
        items.sort(key=lambda x: (x[0], x[1]))
        stack: list[str] = []
        for _, _, kind, what in items:
            if kind == "open":
                stack.append(what)
            elif kind == "close":
                if what in stack:  # (a range cut by the trace's edge is dropped)
                    del stack[len(stack) - 1 - stack[::-1].index(what)]
            else:
                owner[what] = stack[-1] if stack else SCRIPT
    ranges: dict[str, dict] = defaultdict(lambda: {"gpu_us": 0.0, "launches": 0, "by_kind": {}})
    for e in gpu:
        label = owner.get(e.get("args", {}).get("correlation"), SCRIPT)
        r = ranges[label]
        r["gpu_us"] += e.get("dur", 0.0)
        r["launches"] += 1
        kind = e.get("cat")
        r["by_kind"][kind] = r["by_kind"].get(kind, 0.0) + e.get("dur", 0.0)
    for label, us in host_us.items():
        ranges[label]["host_us"] = us
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in gpu)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    starts = [e["ts"] for e in events]
    ends = [e["ts"] + e.get("dur", 0.0) for e in events]
    labelled = [(e["ts"], e["ts"] + e.get("dur", 0.0),
                 owner.get(e.get("args", {}).get("correlation"), SCRIPT)) for e in gpu]  # fmt: skip
    return {
        "ranges": dict(ranges),
        "gpu_busy_us": busy,
        "span_us": (max(ends) - min(starts)) if events else 0.0,
        "idle": idle_gaps(labelled),
        "overlap_us": overlaps(labelled),
    }


def idle_gaps(events: list[tuple[float, float, str]], min_us: float = 100.0) -> dict:
    """Where the GPU sat idle: per (range that ran last, range that ran next), the µs of
    gaps of at least ``min_us`` between them and their number — a gap the host left
    (launches not yet queued, or the host waiting for the device) rather than GPU work."""
    out: dict[str, dict] = {}
    end, last = float("-inf"), None
    for a, b, label in sorted(events):
        if last is not None and a - end >= min_us:
            g = out.setdefault(f"{last} -> {label}", {"us": 0.0, "gaps": 0})
            g["us"] += a - end
            g["gaps"] += 1
        if b > end:
            end, last = b, label
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlaps(events: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per range, the µs its GPU work ran at the same time as other ranges' work (on
    another stream or engine): what running beside the rest bought it."""
    out = {}
    for label in {e[2] for e in events}:
        mine = _union([(a, b) for a, b, lab in events if lab == label])
        rest = _union([(a, b) for a, b, lab in events if lab != label])
        i = j = 0
        both = 0.0
        while i < len(mine) and j < len(rest):
            lo, hi = max(mine[i][0], rest[j][0]), min(mine[i][1], rest[j][1])
            both += max(0.0, hi - lo)
            if mine[i][1] < rest[j][1]:
                i += 1
            else:
                j += 1
        out[label] = both
    return out


def fused_adamw_ms(shape: dict, steps: int = 5, warmup: int = 2) -> dict:
    """torch's fused AdamW stepping the script's parameters (its two groups: weight decay
    on 2-D tensors), random gradients, on this process's GPU: CUDA-event milliseconds per
    step, the median of ``steps`` after ``warmup``. (In this process: the update a
    torchrun user runs, not Leto's user path.)"""
    import torch

    model = up.load_model_module()
    cfg = model.GPTConfig(shape["vocab"], shape["seq"], shape["n_layer"], shape["n_head"],
                          shape["n_embd"])  # fmt: skip
    with torch.device("cuda"):
        gpt = model.GPT(cfg)
    params = list(gpt.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-4, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip
    times = []
    for k in range(warmup + steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        b.synchronize()
        if k >= warmup:
            times.append(a.elapsed_time(b))
    n = sum(p.numel() for p in params)
    del opt, gpt, params
    torch.cuda.empty_cache()
    return {"median_ms": statistics.median(times), "step_ms": times, "parameters": n}


def _row(label: str, r: dict, n: int) -> str:
    return (f"{label:<24} {r.get('gpu_us', 0.0) / n / 1e3:>9.2f} {r.get('launches', 0) / n:>9.0f} "
            f"{r.get('host_us', 0.0) / n / 1e3:>9.2f}")  # fmt: skip


def print_table(res: dict) -> None:
    b, n = res["breakdown"], res["window_iterations"]
    print(f"\nper iteration, mean of {n} profiled iteration(s) (rank 0, leto run "
          f"{' '.join(res['leto_flags']) or 'defaults'}):")  # fmt: skip
    print(f"{'range':<24} {'GPU ms':>9} {'launches':>9} {'host ms':>9}")
    rows = sorted(b["ranges"].items(), key=lambda kv: -kv[1].get("gpu_us", 0.0))
    for label, r in rows:
        print(_row(label, r, n))
    leto_gpu = sum(r.get("gpu_us", 0.0) for k, r in b["ranges"].items() if k != SCRIPT)
    print(f"{'Leto, all ranges':<24} {leto_gpu / n / 1e3:>9.2f}")
    print(f"GPU busy {b['gpu_busy_us'] / n / 1e3:.2f} ms of a {b['span_us'] / n / 1e3:.2f} ms "
          f"traced span per iteration; profiled iterations' wall (inflated by the profiler): "
          f"{', '.join(f'{t * 1e3:.1f}' for t in res['window_wall_s'])} ms")  # fmt: skip
    gaps = sorted(b.get("idle", {}).items(), key=lambda kv: -kv[1]["us"])
    if gaps:
        print("GPU idle (gaps of 0.1 ms or more; ms an iteration, gaps) between the range "
              "that ran last and the next: " + "; ".join(
                  f"{k} {g['us'] / n / 1e3:.2f} ({g['gaps'] / n:.0f})" for k, g in gaps[:8]))  # fmt: skip
    both = {k: us for k, us in b.get("overlap_us", {}).items() if us / n >= 100.0}
    if both:
        print("GPU work beside other ranges' work (ms an iteration): " + "; ".join(
            f"{k} {us / n / 1e3:.2f}" for k, us in sorted(both.items(), key=lambda kv: -kv[1])))  # fmt: skip
    if res.get("fused_adamw"):
        a = res["fused_adamw"]
        print(f"torch fused AdamW, same {a['parameters'] / 1e6:.1f} M parameters (in this "
              f"process, not the user path): {a['median_ms']:.2f} ms a step")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(up.PRESETS), default="h200-1b",
                    help="device, ranks, model and batch (bench.user_path's)")  # fmt: skip
    ap.add_argument("--window", default="4:3",
                    help="FIRST:COUNT: the iterations traced (counted from 1)")  # fmt: skip
    ap.add_argument("--iterations", type=int, help="iterations (default: FIRST+COUNT)")
    ap.add_argument("--script-args", default="",
                    help="more flags for the script, one string (bench.user_path's)")  # fmt: skip
    ap.add_argument("--leto-flags", default="",
                    help="leto run flags, one string (default: none, its defaults)")  # fmt: skip
    ap.add_argument("--no-adamw", action="store_true",
                    help="skip the fused AdamW reference (it needs a GPU)")  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=500.0, help="the job's time limit")
    ap.add_argument("--work-dir", help="the run's folder (default: a new temporary folder)")
    ap.add_argument("--json", dest="json_path", help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        first, count = (int(v) for v in args.window.split(":"))
    except ValueError:
        ap.error(f"--window {args.window!r}: expected FIRST:COUNT, e.g. 4:3")
    if first < 1 or count < 1:
        ap.error(f"--window {args.window!r}: FIRST and COUNT must be at least 1")
    preset = up.PRESETS[args.preset]
    iterations = args.iterations or first + count
    if iterations < first + count - 1:
        ap.error(f"--iterations {iterations} ends before the window {args.window} does")
    shape, passthrough = up.split_script_args(args.script_args, {**up.SHAPE, **preset["shape"]})
    script_args = [*up.shape_flags(shape), "--iterations", str(iterations), *passthrough]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="leto-breakdown-")).absolute()
    prof = work / "profile"
    launch = up.Launch(up.LETO, up.LETO, tuple(shlex.split(args.leto_flags)))
    print(f"leto run, {iterations} iterations, tracing {args.window}; in {work}", flush=True)
    run = up.run_one(launch, work / "leto", preset["nproc_per_node"], preset["device"],
                     script_args, args.timeout_s,
                     extra_env={"LETO_PROFILE_RECOVERY": str(prof),
                                "LETO_PROFILE_WINDOW": args.window})  # fmt: skip
    up._prune(work)
    if "error" in run:
        print(run["error"], file=sys.stderr)
        return 1
    trace_file = prof / "rank0.gen0.trace.json"
    if not trace_file.exists():
        print(f"no trace at {trace_file}: the window was never reached", file=sys.stderr)
        return 1
    walls = [r["wall_s"] for r in run["records"][first - 1 : first - 1 + count]]
    res = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m bench.update_breakdown "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": up._machine(preset["device"]),
        "preset": args.preset,
        "shape": shape,
        "script_args": script_args,
        "leto_flags": list(launch.leto_flags),
        "window": args.window,
        "window_iterations": count,
        "window_wall_s": walls,
        "breakdown": attribute(json.loads(trace_file.read_text())),
        "fused_adamw": None,
    }
    if preset["device"] == "cuda" and not args.no_adamw:
        res["fused_adamw"] = fused_adamw_ms(shape)
    print_table(res)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
