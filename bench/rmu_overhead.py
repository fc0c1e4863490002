"""Fault-free overhead of the Resumable Model Updater, side by side in one run.

The same GPT, data and loop, twice: (a) plain PyTorch as users tune it — parameters in
ordinary memory, ``clip_grad_norm_(foreach=True)`` and ``torch.optim.AdamW(fused=True)``,
bf16 autocast, TF32, SDPA (``--baseline single`` is the older, slower
``foreach=False`` loop, labelled as such); (b) Leto — parameters, gradients and AdamW
state in a Resilient Memory Pool (a real state-manager process), gradient parity,
global-norm clipping and the chunked transactional update with incremental parity,
bit-identical to (a)'s optimizer. ``--micro-batches K`` accumulates K micro-batches per
iteration in both. Reports mean iteration time of each (after warm-up), the overhead
ratio, peak device memory of each, and the RMU's breakdown measured in a separate
profiled pass (profiling adds synchronizations, so it is not in the timed pass).

    python -m bench.rmu_overhead --device cpu
    python -m bench.rmu_overhead --device cuda --n-layer 20 --n-embd 2048 --batch 16 --seq 1024

Not covered: multi-rank runs (the all-reduce is the same in both loops and omitted).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import time
from collections import defaultdict

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from leto.integrity.scrub import Scrubber  # noqa: E402
from leto.memory.client import PoolClient  # noqa: E402
from leto.memory.config import PoolConfig  # noqa: E402
from leto.memory.launch import start_state_manager  # noqa: E402
from leto.trainer.buckets import GradBuckets  # noqa: E402
from leto.update.chunk_pass import ENV as ENV_CHUNK_PASS  # noqa: E402
from leto.update.optim import AdamWConfig  # noqa: E402
from leto.update.rmu import Updater, UpdaterConfig  # noqa: E402
from leto.update.schedule import WarmupCosine  # noqa: E402
from leto.update.user_optim import UserOptimizer  # noqa: E402
from leto.workload.corpus import batch  # noqa: E402
from leto.workload.gpt import GPT, GPTConfig, init_weights  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(step, iters: int, warmup: int, device: torch.device) -> float:
    for t in range(warmup):
        step(t)
    sync(device)
    t0 = time.perf_counter()
    for t in range(warmup, warmup + iters):
        step(t)
    sync(device)
    return (time.perf_counter() - t0) / iters


def compute(args, model, device: torch.device, t: int, no_sync=None) -> torch.Tensor:
    """Forward and backward of iteration ``t``: ``--micro-batches`` micro-batches, their
    gradients accumulated, under the autocast the flags ask for. Returns the loss."""
    k = args.micro_batches
    loss = torch.zeros((), device=device)
    for mb in range(k):
        stream = args.rank * k + mb
        x, y = (v.to(device, non_blocking=True) for v in batch(0, t, stream, args.batch, args.seq))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            part = model(x, y) / k
        # Only the last micro-batch's backward reduces (DDP's and Leto's no_sync).
        with no_sync() if (no_sync is not None and mb < k - 1) else contextlib.nullcontext():
            part.backward()
        loss += part.detach()
    return loss


def plain(
    args, gcfg: GPTConfig, device: torch.device, schedule, adamw: AdamWConfig, after=None
) -> float:
    model = GPT(gcfg).to(device=device, dtype=getattr(torch, args.dtype))
    init_weights(model, 0)
    module = model
    if args.world > 1:
        # What a data-parallel user runs: DDP's bucketed all-reduce overlapped with
        # backward (25 MiB buckets), gradients as bucket views.
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_mib,
            gradient_as_bucket_view=True,
        )
    opt = torch_adamw(model.parameters(), adamw)

    def step(t):
        opt.zero_grad(set_to_none=False)
        compute(args, model, device, t, getattr(model, "no_sync", None))
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), adamw.max_grad_norm, foreach=adamw.clip_foreach
        )
        for group in opt.param_groups:
            group["lr"] = schedule(t)
        opt.step()

    seconds = time_loop(step, args.iters, args.warmup, device)
    args.attention = module.attention_backend()
    if after is not None:
        after(None)
    return seconds


def torch_adamw(params, adamw: AdamWConfig) -> torch.optim.AdamW:
    """The user's optimizer: torch's AdamW with the implementation ``adamw.impl`` names
    (the learning rate is set per iteration from the schedule)."""
    return torch.optim.AdamW(
        params,
        lr=1.0,
        betas=(adamw.beta1, adamw.beta2),
        eps=adamw.eps,
        weight_decay=adamw.weight_decay,
        **({"fused": True} if adamw.impl == "fused" else {"foreach": False}),
    )


def leto(
    args,
    gcfg: GPTConfig,
    device: torch.device,
    schedule,
    adamw: AdamWConfig,
    lend: bool = True,
    after=None,
    scrub_mib: float = 0.0,
) -> tuple[float, dict]:
    cfg = PoolConfig(
        device="cpu" if device.type == "cpu" else f"cuda:{device.index or 0}",
        tier1_pages=args.tier1_pages,
    )
    sm = start_state_manager(cfg)
    try:
        client = PoolClient.connect(sm.socket_path, sm.token)
        with torch.device("meta"):
            model = GPT(gcfg).to(getattr(torch, args.dtype))
        ucfg = UpdaterConfig(chunk_units=args.chunk_units, adamw=adamw, lend_activations=lend)
        user = opt = None
        if args.leto_optimizer == "script":
            # What leto.Run does: the script's own torch.optim.AdamW, clipped by the
            # script in place, hyperparameters read and retained at each step.
            opt = torch_adamw(model.parameters(), adamw)
            user = UserOptimizer(opt, {id(p): n for n, p in model.named_parameters()})
        up = Updater(client, model, schedule, ucfg, user=user)
        if user is not None:
            user.adopt(up.params)
        # Device pages of the pool (records live in host memory, parity too).
        allocs = client.status()["allocations"]
        args.pool_device_gib = sum(a["nbytes"] for a in allocs if a["kind"] != "record") / 2**30
        up.initialize(lambda: init_weights(model, 0))
        # The background scrub, as RetainedTraining runs it (leto run's default rate).
        scrub = Scrubber(up, budget_bytes=int(scrub_mib * 2**20))

        buckets = GradBuckets(up.params, up.state, args.bucket_mib) if args.world > 1 else None
        group = dist.group.WORLD if args.world > 1 else None

        def reduce():
            if buckets is not None:
                buckets.finish()  # sums, then divides by the world size

        def script_step(t):
            """The script's clipping and hyperparameters (leto.Run's optimizer.step())."""
            if user is None:
                return
            torch.nn.utils.clip_grad_norm_(
                model.parameters(), adamw.max_grad_norm, foreach=adamw.clip_foreach
            )
            for g in opt.param_groups:
                g["lr"] = schedule(t)
            up.hparams = user.hparams()
            up.loop.write(t, {"hparams": up.hparams, "scheduler": [], "state": {}})

        def step(t):
            up.begin(t)
            scrub.step()
            with up.lent_memory():
                compute(args, model, device, t, buckets and buckets.no_sync)
            reduce()
            script_step(t)
            scrub.before_update()
            # The loss is not read (neither loop reads it: a host synchronization
            # would stall the queue; leto.Run logs it only if the script records it).
            up.protect_grads(t)
            up.sync(t, group=group)
            up.update(t)

        seconds = time_loop(step, args.iters, args.warmup, device)
        args.chunk_pass = up.update_path
        if after is not None:
            after(up)
        up.profile = defaultdict(float)
        t = args.warmup + args.iters
        for k in range(args.iters):
            sync(device)
            t0 = time.perf_counter()
            up.begin(t + k)
            scrub.step()
            sync(device)
            up.profile["scrub step"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            with up.lent_memory():
                compute(args, model, device, t + k, buckets and buckets.no_sync)
            sync(device)
            up.profile["forward + backward"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            reduce()
            sync(device)
            up.profile["all-reduce wait"] += time.perf_counter() - t1
            t2 = time.perf_counter()
            script_step(t + k)
            sync(device)
            if user is not None:
                up.profile["script's clipping + loop record"] += time.perf_counter() - t2
            scrub.before_update()
            up.protect_grads(t + k)
            up.sync(t + k, group=group)
            up.update(t + k)
        breakdown = {k: v / args.iters * 1e3 for k, v in up.profile.items()}
        state = sum(len(g.data) for g in up.groups) * up.state.page_bytes
        breakdown["scrub: iterations per full pass"] = (
            state / scrub.budget if scrub.budget else float("inf")
        )
        client.close()
        return seconds, breakdown
    finally:
        sm.stop()


def parser(doc: str = __doc__) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (fp32 master weights)")
    ap.add_argument(
        "--leto-optimizer",
        default="script",
        choices=("script", "config"),
        help="script: Leto runs the script's torch.optim.AdamW as leto.Run does (the script "
        "clips in place); config: the updater's own AdamWConfig path (clip into scratch)",
    )
    ap.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    ap.add_argument("--n-embd", type=int, default=128, help="model width")
    ap.add_argument("--n-head", type=int, default=4, help="attention heads")
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches accumulated per iteration"
    )
    ap.add_argument(
        "--baseline",
        choices=["fused", "single"],
        default="fused",
        help="fused: AdamW(fused=True) + clip_grad_norm_(foreach=True), what users run; "
        "single: the older AdamW(foreach=False) + clip foreach=False loop (slower)",
    )
    ap.add_argument(
        "--autocast", choices=["bf16", "off"], default="bf16", help="forward/backward autocast"
    )
    ap.add_argument(
        "--tf32", action=argparse.BooleanOptionalAction, default=True, help="TF32 matmuls (CUDA)"
    )
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    ap.add_argument(
        "--chunk-units", type=int, default=64, help="RMU chunk size in units (pages of parameters)"
    )
    ap.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="data-parallel ranks (one process and GPU each): DDP vs Leto's bucketed reduction",
    )
    ap.add_argument(
        "--bucket-mib", type=float, default=25.0, help="gradient bucket size, DDP's and Leto's"
    )
    ap.add_argument(
        "--tier1-pages",
        type=int,
        default=16,
        help="H1: tier-1 parity pages per protection group (lost pages it tolerates per group)",
    )
    ap.add_argument(
        "--scrub-mib",
        type=float,
        default=64.0,
        help="the background scrub's data MiB per iteration (leto run's default; 0: off)",
    )
    ap.add_argument(
        "--scrub-compare",
        action="store_true",
        help="also time Leto with the scrub off, side by side: the scrub's own cost",
    )
    ap.add_argument(
        "--unfused-compare",
        action="store_true",
        help=f"also time Leto with the fused chunk pass off ({ENV_CHUNK_PASS}=0), side by side",
    )
    ap.add_argument("--json-out", default=None, help="write results as JSON here")
    return ap


def model_config(args) -> GPTConfig:
    return GPTConfig(
        block=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, dropout=0.0
    )


def _rank(rank: int, argv: list[str], port: int, out: str) -> None:
    args = parser().parse_args(argv)
    args.rank, args.world = rank, args.world_size
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, args.world, rank == 0)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=args.world,
        device_id=torch.device("cuda", rank) if device == "cuda" else None,
    )
    try:
        res = measure(args, torch.device("cuda", rank) if device == "cuda" else torch.device("cpu"))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    argv = list(argv if argv is not None else __import__("sys").argv[1:])
    args = parser().parse_args(argv)
    if args.world_size > 1:
        import tempfile

        import torch.multiprocessing as mp

        from leto.job.store import free_port

        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            mp.spawn(_rank, args=(argv, free_port(), tmp.name), nprocs=args.world_size)
            res = json.load(open(tmp.name))
    else:
        args.rank, args.world = 0, 1
        res = measure(args, torch.device(args.device))
    res["command"] = "python -m bench.rmu_overhead " + " ".join(argv)
    show(res, args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return res


def measure(args, device: torch.device) -> dict:
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    gcfg = model_config(args)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(gcfg).parameters())
    schedule = WarmupCosine(total_iters=1000)
    adamw = AdamWConfig(impl=args.baseline)
    peaks = {}

    def peak(name):
        def after(_):
            if device.type == "cuda":
                sync(device)
                peaks[name] = torch.cuda.max_memory_allocated(device) / 2**30
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)

        return after

    t_plain = plain(args, gcfg, device, schedule, adamw, after=peak("plain"))
    t_leto, breakdown = leto(
        args, gcfg, device, schedule, adamw, after=peak("leto"), scrub_mib=args.scrub_mib
    )
    fused = args.chunk_pass
    t_noscrub = t_unfused = None
    if args.scrub_compare:
        t_noscrub, _ = leto(args, gcfg, device, schedule, adamw, scrub_mib=0.0)
    if args.unfused_compare:
        os.environ[ENV_CHUNK_PASS] = "0"
        try:
            t_unfused, _ = leto(args, gcfg, device, schedule, adamw, scrub_mib=args.scrub_mib)
        finally:
            del os.environ[ENV_CHUNK_PASS]
    res = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "params": n_params,
        "dtype": args.dtype,
        "baseline": args.baseline,
        "autocast": args.autocast,
        "tf32": args.tf32,
        "attention": args.attention,
        "tokens_per_iteration": args.batch * args.seq * args.micro_batches,
        "micro_batches": args.micro_batches,
        "tier1_pages": args.tier1_pages,
        "chunk_units": args.chunk_units,
        # torch's allocator peak; Leto's retained state lives in pool pages beside it.
        "peak_allocated_gib": peaks,
        "pool_device_gib": args.pool_device_gib,
        "plain_ms": t_plain * 1e3,
        "leto_ms": t_leto * 1e3,
        "overhead_pct": (t_leto / t_plain - 1) * 100,
        "scrub_mib": args.scrub_mib,
        "chunk_pass": fused,
        "leto_unfused_ms": t_unfused * 1e3 if t_unfused else None,
        "unfused_overhead_pct": (t_unfused / t_plain - 1) * 100 if t_unfused else None,
        "leto_no_scrub_ms": t_noscrub * 1e3 if t_noscrub else None,
        "scrub_cost_pct": (t_leto / t_noscrub - 1) * 100 if t_noscrub else None,
        "rmu_breakdown_ms": breakdown,
        "world_size": args.world,
        "bucket_mib": args.bucket_mib,
    }
    return res


def show(res: dict, args) -> None:
    t = Table(
        title=f"RMU overhead on {res['device']} x {res['world_size']}: "
        f"{res['params'] / 1e6:.1f} M parameters ({args.dtype}, autocast {args.autocast}, "
        f"TF32 {args.tf32}, attention {res['attention']}, {res['tokens_per_iteration']} "
        f"tokens per rank in {args.micro_batches} micro-batch(es))"
    )
    t.add_column("what")
    t.add_column("ms / iteration", justify="right")
    label = {
        "fused": "plain PyTorch (AdamW fused=True, clip foreach=True)",
        "single": "plain PyTorch (AdamW foreach=False: the older, slower baseline)",
    }[args.baseline]
    if res["world_size"] > 1:
        label += f", DDP ({args.bucket_mib:g} MiB buckets)"
    t.add_row(label, f"{res['plain_ms']:.1f}")
    t.add_row(
        f"Leto (pool + RMU, scrub {res['scrub_mib']:g} MiB/iteration)", f"{res['leto_ms']:.1f}"
    )
    t.add_row("overhead", f"{res['overhead_pct']:+.1f} %")
    t.add_row("  chunk pass", res["chunk_pass"])
    if res["leto_unfused_ms"] is not None:
        t.add_row("Leto, unfused steps", f"{res['leto_unfused_ms']:.1f}")
        t.add_row("overhead, unfused steps", f"{res['unfused_overhead_pct']:+.1f} %")
    if res["leto_no_scrub_ms"] is not None:
        t.add_row("Leto, scrub off", f"{res['leto_no_scrub_ms']:.1f}")
        t.add_row("the scrub's cost", f"{res['scrub_cost_pct']:+.2f} %")
    for k, v in sorted(res["rmu_breakdown_ms"].items(), key=lambda kv: -kv[1]):
        t.add_row(f"  profiled: {k}", f"{v:.1f}")
    for k, v in res["peak_allocated_gib"].items():
        t.add_row(f"peak allocated by torch, {k} (GiB)", f"{v:.2f}")
    if res["device"] != "cpu":
        t.add_row("Leto pool pages on the device (GiB)", f"{res['pool_device_gib']:.2f}")
    Console().print(t)


if __name__ == "__main__":
    main()
