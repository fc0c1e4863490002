"""A parked shadow's device footprint per preinitialization level, and how long the
allocation-path hook takes to reclaim it (paper §6, Fig. 7; issue 8's figures).

For each level a stand-in shadow is started in its own process and parks after:
L1 — torch imported (no GPU state); L2 — + the device step a real L2 shadow runs
(``leto.trainer.api.warm_device``: CUDA context, cuBLAS with leto.init's workspace
setting, Leto's codec and chunk-pass kernels, the lending allocator's workspaces);
L3 — also a single-rank NCCL process group with one all-reduce (its communicator
buffers). The footprint is the device's used memory while it is parked minus before (``cudaMemGetInfo`` seen from this process, whose own context
exists before the baseline). Then the hook is armed on it with a gate above the device's
capacity, a fresh allocation misses the cache, and the hook kills the shadow and waits
for the memory: the event's latency is the reclamation latency.

    python -m bench.preinit_footprint --repeats 3 --json-out out/preinit_footprint.json

The measured footprints feed ``policy.Footprints`` (``--json-out`` has them as
``footprints``). Not covered: multi-rank NCCL groups (their buffers grow with the
world size), the script's own warm-up (``leto.init(warmup=...)``: what it keeps is each
shadow's ``warmup_reserved_bytes`` in the recovery record) and the CPU (no device
memory).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

SHADOW_SRC = r"""
import os, sys, time
level = sys.argv[1]
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as leto.init sets it
import torch
if level in ("L2", "L3"):
    from leto.trainer.api import warm_device
    warm_device(torch.device("cuda", 0))
if level == "L3":
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%s" % sys.argv[2],
                            rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1 << 20, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(600)
"""
GiB = 1 << 30


def used_bytes() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def start_shadow(level: str, port: int, timeout_s: float) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", SHADOW_SRC, level, str(port)], stdout=subprocess.PIPE, text=True
    )
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    if not ready or not p.stdout.readline().startswith("ready"):
        p.kill()
        p.wait(timeout=30)
        raise TimeoutError(f"{level} shadow did not park within {timeout_s}s")
    return p


def measure(level: str, port: int, hook, timeout_s: float) -> dict:
    import torch

    torch.cuda.synchronize()
    base = used_bytes()
    t0 = time.monotonic()
    p = start_shadow(level, port, timeout_s)
    row = {"level": level, "park_s": time.monotonic() - t0}
    time.sleep(0.5)  # let the driver account the new context
    row["footprint_bytes"] = used_bytes() - base
    if row["footprint_bytes"] <= 0:
        row["reclaim"] = None  # nothing on the device to reclaim (L1)
        p.kill()
        p.wait(timeout=30)
        return row
    seen = len(hook.events())
    _, total = torch.cuda.mem_get_info()
    hook.arm(
        p.pid,
        device=0,
        expected_release_bytes=int(row["footprint_bytes"] * 0.9),
        reclaim_below_bytes=total + 1,  # any cache miss fires: we time the reclamation itself
    )
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a fresh segment: a miss
    del x
    torch.cuda.empty_cache()  # the next round misses again
    evs = hook.events(since=seen)
    if not evs:
        p.kill()
        p.wait(timeout=30)
        raise RuntimeError(f"the hook did not fire for the {level} shadow: {hook.stats()}")
    ev = evs[0]
    row["reclaim"] = {**ev.__dict__, "outcome": ev.outcome.value}
    row["shadow_rc"] = p.wait(timeout=30)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="measurements per level")
    ap.add_argument("--port", type=int, default=29611, help="TCP port of the L3 shadow's store")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="limit for a shadow to park")
    ap.add_argument("--json-out", default="", help="write the rows and footprints here")
    args = ap.parse_args()

    import torch

    from leto.preinit.reclaim import install_cuda_hook

    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")  # this process's context exists before every baseline
    hook = install_cuda_hook()
    rows = []
    for r in range(args.repeats):
        for level in ("L1", "L2", "L3"):
            rows.append(measure(level, args.port + r, hook, args.timeout_s))
            rec = rows[-1]["reclaim"]
            lat = f"{rec['latency_s'] * 1e3:8.1f} ms ({rec['outcome']})" if rec else "       -"
            print(
                f"{level}  footprint {rows[-1]['footprint_bytes'] / 2**20:8.1f} MiB  "
                f"park {rows[-1]['park_s']:5.2f} s  reclaim {lat}",
                flush=True,
            )
    fp = {
        f"{lv.lower()}_bytes": max(
            0, sorted(x["footprint_bytes"] for x in rows if x["level"] == lv)[args.repeats // 2]
        )
        for lv in ("L1", "L2", "L3")
    }
    fp["l2_bytes"] = max(fp["l2_bytes"], fp["l1_bytes"])
    fp["l3_bytes"] = max(fp["l3_bytes"], fp["l2_bytes"])
    out = {
        "machine": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "bench.preinit_footprint", *sys.argv[1:]]
        ),
        "footprints": fp,  # medians, made non-decreasing for policy.Footprints
        "rows": rows,
        "hook_stats": hook.stats().__dict__,
    }
    print(json.dumps(fp))
    if args.json_out:
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
