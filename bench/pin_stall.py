"""In-process benchmark of one component (not the product's path): how much making
pinned host buffers in the background slows a training thread's GPU steps.

A checkpoint's staging buffers (12 bytes a parameter: 13 GB at 1.1 B) are page-locked
host memory. This times a main thread's steps (bf16 matrix multiplies, then a device
synchronize, as a script that logs its loss does) while ``--gib`` of buffers of
``--chunk-mib`` each are made, by each ``--how``:

* ``torch-pinned`` — ``torch.empty(..., pin_memory=True)`` on a thread (what the
  checkpoint stager did);
* ``register`` — ``torch.empty`` on a thread, then ``cudaHostRegister`` of each buffer;
* ``process`` — ``torch.empty(..., pin_memory=True)`` in another process (as a parked
  shadow would), this process not touching them;
* ``none`` — no buffers (the steps alone).

Prints, per way, the steps' median and maximum time while the buffers were made and the
time making them took; ``--json`` writes it.

    python -m bench.pin_stall --gib 13 --how none,torch-pinned,register,process
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time

import torch


def _make(how: str, n: int, numel: int, out: list) -> None:
    bufs = []
    for _ in range(n):
        if how == "register":
            t = torch.empty(numel, dtype=torch.uint8)
            t.fill_(0)  # touched, as a stage's copy would
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister: {rc}")
        else:
            t = torch.empty(numel, dtype=torch.uint8, pin_memory=True)
        bufs.append(t)
    out.append(bufs)


def _child(n: int, numel: int, ready, done) -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ready.set()
    got: list = []
    _make("torch-pinned", n, numel, got)
    done.set()
    time.sleep(1.0)


def one(how: str, gib: float, chunk_mib: int, device: torch.device) -> dict:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    numel = chunk_mib << 20
    n = max(1, int(gib * 1024 / chunk_mib))
    for _ in range(3):
        (a @ a).sum().item()
    torch.cuda.synchronize(device)
    got: list = []
    done = threading.Event()
    proc = None
    t0 = time.perf_counter()
    if how in ("torch-pinned", "register"):

        def work():
            _make(how, n, numel, got)
            done.set()

        threading.Thread(target=work, daemon=True).start()
    elif how == "process":
        ctx = mp.get_context("spawn")
        ready, pdone = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_child, args=(n, numel, ready, pdone))
        proc.start()
        ready.wait(120)
        t0 = time.perf_counter()
        done = pdone
    steps = []
    while True:
        s = time.perf_counter()
        for _ in range(4):
            b = a @ a
        b.sum().item()
        torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - s)
        if how == "none" and len(steps) >= 200:
            break
        if how != "none" and done.is_set():
            break
        if time.perf_counter() - t0 > 120:
            break
    made_s = time.perf_counter() - t0
    if proc is not None:
        proc.join(30)
    got.clear()
    return {
        "how": how,
        "gib": gib,
        "chunk_mib": chunk_mib,
        "made_s": made_s,
        "steps": len(steps),
        "median_step_ms": 1e3 * statistics.median(steps),
        "max_step_ms": 1e3 * max(steps),
        "sum_steps_s": sum(steps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=13.0, help="host buffers to make, GiB")
    ap.add_argument("--chunk-mib", type=int, default=64, help="one buffer's size, MiB")
    ap.add_argument("--how", default="none,torch-pinned,register,process", help="ways, comma")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    device = torch.device("cuda", 0)
    rows = []
    for how in args.how.split(","):
        r = one(how, args.gib, args.chunk_mib, device)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"{'way':<14}{'made s':>8}{'steps':>7}{'median ms':>11}{'max ms':>9}")
    for r in rows:
        print(f"{r['how']:<14}{r['made_s']:>8.2f}{r['steps']:>7}{r['median_step_ms']:>11.1f}"
              f"{r['max_step_ms']:>9.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
