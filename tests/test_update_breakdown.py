"""``bench.update_breakdown``'s attribution: every GPU event to the innermost ``leto.*``
range open on the thread that launched it, the rest to the script."""

from __future__ import annotations

from bench.update_breakdown import SCRIPT, attribute


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def test_gpu_events_go_to_the_innermost_range_that_launched_them():
    trace = {"traceEvents": [
        _x("user_annotation", "leto.update", 0, 100),
        _x("user_annotation", "leto.chunk pass", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 1, correlation=1),  # in chunk pass
        _x("cuda_runtime", "cudaMemcpyAsync", 50, 1, correlation=2),  # in update only
        _x("cuda_driver", "cuLaunchKernel", 150, 1, correlation=3),  # outside: the script's
        _x("cuda_runtime", "cudaLaunchKernel", 30, 1, tid=2, correlation=4),  # other thread
        _x("kernel", "adamw", 200, 40, correlation=1),
        _x("gpu_memcpy", "Memcpy DtoH", 240, 10, correlation=2),
        _x("kernel", "gemm", 250, 100, correlation=3),
        _x("kernel", "other", 260, 5, correlation=4),  # overlaps the gemm
    ]}  # fmt: skip
    b = attribute(trace)
    r = b["ranges"]
    assert r["chunk pass"]["gpu_us"] == 40 and r["chunk pass"]["launches"] == 1
    assert r["update"]["gpu_us"] == 10 and r["update"]["by_kind"] == {"gpu_memcpy": 10}
    assert r[SCRIPT]["gpu_us"] == 105 and r[SCRIPT]["launches"] == 2
    assert r["update"]["host_us"] == 100 and r["chunk pass"]["host_us"] == 20
    assert b["gpu_busy_us"] == 150  # 200..350, the overlapping kernel counted once
    assert b["span_us"] == 350


def test_a_range_closing_at_a_launch_instant_still_owns_it():
    trace = {"traceEvents": [
        _x("user_annotation", "leto.undo copy", 0, 10),
        _x("cuda_runtime", "cudaMemcpyAsync", 10, 0, correlation=9),
        _x("gpu_memcpy", "Memcpy DtoD", 20, 3, correlation=9),
    ]}  # fmt: skip
    assert attribute(trace)["ranges"]["undo copy"]["gpu_us"] == 3


def test_idle_gaps_are_named_by_the_ranges_around_them_and_overlap_by_range():
    trace = {"traceEvents": [
        _x("user_annotation", "leto.undo ahead", 0, 5),
        _x("cuda_runtime", "cudaMemcpyAsync", 1, 1, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 1, correlation=2),  # the script's
        _x("user_annotation", "leto.chunk pass", 20, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 21, 1, correlation=3),
        _x("gpu_memcpy", "Memcpy DtoD", 100, 300, correlation=1),
        _x("kernel", "gemm", 200, 400, correlation=2),  # 200..400 beside the copy
        _x("kernel", "chunk_pass", 850, 50, correlation=3),  # 250 µs idle before it
        _x("kernel", "chunk_pass", 920, 50, correlation=3),  # 20 µs: under the threshold
    ]}  # fmt: skip
    b = attribute(trace)
    assert b["idle"] == {f"{SCRIPT} -> chunk pass": {"us": 250.0, "gaps": 1}}
    assert b["overlap_us"]["undo ahead"] == 200.0
    assert b["overlap_us"][SCRIPT] == 200.0 and b["overlap_us"]["chunk pass"] == 0.0
