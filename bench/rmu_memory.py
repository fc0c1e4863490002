"""Peak device memory of one training iteration: plain PyTorch, Leto without lending,
and Leto with the updater's buffers lent to forward activations.

Each variant runs in a fresh process (the caching allocator never gives memory back,
so variants in one process would hide each other's peaks). A variant's peak is the
device-wide memory in use after its iterations (``cudaMemGetInfo``; the caching
allocator keeps every segment it ever reserved, so this is the peak it needed) minus
the memory in use when the process started (its own CUDA context). It therefore counts
the pool's pages and the state manager's own CUDA context, which a user pays for too.

    python -m bench.rmu_memory --n-layer 20 --n-embd 2048 --n-head 16 --batch 8 --seq 1024

Not covered: the CPU (no device memory to measure); backward temporaries are not lent
(see leto.memory.lending).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from rich.console import Console
from rich.table import Table

from bench import rmu_overhead as ro
from leto.update.optim import AdamWConfig
from leto.update.schedule import WarmupCosine

VARIANTS = ("plain", "leto-no-lending", "leto")
GiB = 1 << 30


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def child(args) -> dict:
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda")
    torch.cuda.init()
    torch.empty(1, device=device)  # the context exists before the baseline
    base = used_bytes()
    out: dict = {}

    def after(up):
        torch.cuda.synchronize()
        out["peak_bytes"] = used_bytes() - base
        out["torch_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        if up is not None:
            allocs = up.client.status()["allocations"]
            out["pool_device_bytes"] = sum(a["pages"] * a["page_bytes"] for a in allocs)
            out["rmu_buffer_bytes"] = sum(
                a["pages"] * a["page_bytes"] for a in allocs if a["name"].startswith("rmu.")
            )
            if up.lender is not None:
                st = up.lender.stats()
                out["lent_bytes"] = up.lender.lent_bytes
                out["lent_peak_bytes"] = st.lent_peak_bytes
                out["fallback_peak_bytes"] = st.fallback_peak_bytes

    gcfg = ro.model_config(args)
    schedule, adamw = WarmupCosine(total_iters=1000), AdamWConfig()
    if args.variant == "plain":
        out["ms"] = ro.plain(args, gcfg, device, schedule, adamw, after=after) * 1e3
    else:
        lend = args.variant == "leto"
        out["ms"] = ro.leto(args, gcfg, device, schedule, adamw, lend=lend, after=after)[0] * 1e3
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = ro.parser(__doc__)
    ap.add_argument("--variant", choices=VARIANTS, default=None, help="run one variant (child)")
    args = ap.parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    if args.variant is not None:
        print("RESULT " + json.dumps(child(args)))
        return {}
    res: dict = {"command": "python -m bench.rmu_memory " + " ".join(argv), "variants": {}}
    for v in VARIANTS:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.rmu_memory", *argv, "--variant", v],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"variant {v} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        res["variants"][v] = json.loads(lines[-1][len("RESULT ") :])
    t = Table(title="Peak device memory per iteration (GiB)")
    cols = ("variant", "peak (device-wide)", "pool pages", "torch max reserved", "lent", "ms / it")
    for c in cols:
        t.add_column(c, justify="right" if c != "variant" else "left")
    for v, r in res["variants"].items():
        t.add_row(
            v,
            f"{r['peak_bytes'] / GiB:.2f}",
            f"{r.get('pool_device_bytes', 0) / GiB:.2f}",
            f"{r['torch_max_reserved_bytes'] / GiB:.2f}",
            f"{r.get('lent_peak_bytes', 0) / GiB:.2f}",
            f"{r['ms']:.1f}",
        )
    Console().print(t)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
