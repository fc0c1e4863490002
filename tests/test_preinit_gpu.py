"""On a GPU: the allocation-path hook turns an OOM that a shadow causes into an
allocation that succeeds (paper §6), measured on real device memory.

A stand-in shadow (a child process with a CUDA context and one large allocation) takes
all but KEEP_FREE bytes of the device; the active process then asks for GROW bytes,
more than is free. Without the hook that raises torch.OutOfMemoryError; with it the hook
kills the shadow, waits until the device's free memory rose, and the same allocation
succeeds with no OOM counted. No ``set_per_process_memory_fraction`` cap here on purpose:
a cap counts this process's allocator only, so the shadow's memory could never be what
makes the allocation fail, and killing it could never help.

Each scenario runs in its own spawned process: a fresh CUDA context and a fresh copy of
the hook (the c10 registry cannot unregister a callback). Not covered here: the agent's
relaunch at a lower level and a HOF afterwards (that needs the runtime wiring).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import select
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30
KEEP_FREE = 4 * GiB  # left free by the shadow
GROW = 8 * GiB  # the active's new allocation: does not fit while the shadow lives
BASE = 2 * GiB  # what the active already holds
TIMEOUT_S = 240

SHADOW_SRC = r"""
import sys, time, torch
keep_free, park_s = int(sys.argv[1]), float(sys.argv[2])
torch.cuda.init()
free, _ = torch.cuda.mem_get_info()
x = torch.empty(free - keep_free, dtype=torch.uint8, device="cuda")
x.fill_(7)  # touch it: the memory is really the shadow's
torch.cuda.synchronize()
print("ready", x.numel(), flush=True)
time.sleep(park_s)  # parked; the hook (or the test) kills it
"""


def _start_shadow(timeout_s: float) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen(
        [sys.executable, "-c", SHADOW_SRC, str(KEEP_FREE), str(TIMEOUT_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    line = p.stdout.readline() if ready else ""
    if not line.startswith("ready"):
        p.kill()
        p.wait(timeout=30)
        raise TimeoutError(f"stand-in shadow not ready after {timeout_s}s (said {line!r})")
    return p, int(line.split()[1])


def _scenario(with_hook: bool, out: mp.Queue) -> None:
    import torch

    from leto.preinit.reclaim import install_cuda_hook

    res: dict = {}
    torch.cuda.set_device(0)
    base = torch.full((BASE,), 3, dtype=torch.uint8, device="cuda")
    hook = install_cuda_hook() if with_hook else None  # built before the shadow: ~seconds
    shadow, held = _start_shadow(120)
    try:
        res["free_before"] = torch.cuda.mem_get_info()[0]
        if hook is not None:
            hook.reset()
            hook.arm(
                shadow.pid,
                device=0,
                expected_release_bytes=held,
                reclaim_below_bytes=GROW + GiB,  # above the largest request (GROW)
            )
        try:
            x = torch.empty(GROW, dtype=torch.uint8, device="cuda")
            x.fill_(5)
            res["ok"] = bool((x[:: 1 << 20] == 5).all().item())
            res["base_intact"] = bool((base[:: 1 << 20] == 3).all().item())
        except torch.OutOfMemoryError as e:
            res["oom"] = str(e).splitlines()[0]
        res["num_ooms"] = torch.cuda.memory_stats().get("num_ooms", 0)
        if hook is not None:
            res["events"] = [{**ev.__dict__, "outcome": ev.outcome.value} for ev in hook.events()]
            res["stats"] = hook.stats().__dict__
        try:
            res["shadow_rc"] = shadow.wait(timeout=0.5 if hook is None else 10)
        except subprocess.TimeoutExpired:
            res["shadow_rc"] = None  # still alive
        res["held"] = held
    finally:
        if shadow.poll() is None:
            shadow.kill()
            shadow.wait(timeout=30)
        out.put(res)


def _run(with_hook: bool) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_scenario, args=(with_hook, q))
    p.start()
    try:
        return q.get(timeout=TIMEOUT_S)
    except queue.Empty:
        raise TimeoutError(f"scenario (hook={with_hook}) gave no result in {TIMEOUT_S}s") from None
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join(timeout=30)


def test_without_the_hook_the_shadow_causes_an_oom():
    r = _run(with_hook=False)
    assert "oom" in r, f"expected an OOM with {r['free_before'] / GiB:.1f} GiB free: {r}"
    assert r["num_ooms"] >= 1, r
    assert r["shadow_rc"] is None, "the shadow should have survived without the hook"


def test_with_the_hook_the_shadow_is_reclaimed_and_the_allocation_succeeds():
    r = _run(with_hook=True)
    assert "oom" not in r, f"OOM despite the hook: {r}"
    assert r["ok"] and r["base_intact"], r
    assert r["num_ooms"] == 0, f"the allocator counted an OOM: {r}"
    assert r["shadow_rc"] == -9, f"the shadow was not SIGKILLed: {r}"
    (ev,) = r["events"]
    assert ev["outcome"] == "released" and ev["killed"], ev
    assert ev["free_after_bytes"] - ev["free_before_bytes"] >= r["held"], ev
    assert ev["latency_s"] > 0, ev
    # The driver frees the memory while the process exits, before its pidfd turns
    # readable: "released" often comes first and the exit is never observed (None).
    exit_s = ev["exit_latency_s"]
    exit_txt = "not observed before" if exit_s is None else f"seen after {exit_s * 1e3:.1f} ms"
    print(
        f"reclamation: {r['held'] / GiB:.1f} GiB back in {ev['latency_s'] * 1e3:.1f} ms "
        f"(exit {exit_txt})"
    )
