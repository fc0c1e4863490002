"""A parked shadow's warm-up: the script's own step, run once on throwaway data.

Runs in an L2/L3 shadow while it parks (``leto.init(warmup=...)``), after the device
runtime is up. A process's first forward and backward on a GPU pays for what later ones
reuse — lazily loaded kernels, cuBLAS/cuBLASLt handles and their heuristics, attention
kernels — ≈ 0.8–1.3 s for the example GPT on the H200 (docs/benchmarks.md, thirteenth
session): without a warm-up a promoted shadow pays it on the recovery's critical path.
The script knows its step; Leto cannot run the user's model (its parameters are the
live trainer's), so the script passes a function that runs a small stand-in with the
same shapes — e.g. one block of the model — on data of the real batch's shape.

What the warm-up leaves behind is bounded: the RNG states are restored (the promoted
trainer draws what a fresh process would), and the caching allocator's blocks are
released before parking, so the shadow holds only what its kernels and library handles
keep (reported as ``warmup_reserved_bytes``). A warm-up that raises costs only the head
start: the shadow says so in its log and parks without it.

Tools plugged into Leto warm up here too (``leto.plugins.install_shadow_warmup``): under
``--verify`` the verifiers' digest allocates its pinned staging buffers (512 MiB, ~0.1 s
a GB) and starts its hashing threads, which a promoted trainer would otherwise do in
its first record — the measurement's cost, not the job's, and not on its recovery path.

Not covered: warming collectives (a world-1 process group has nothing to connect); the
allocator's growth to the real model's peak (released here: holding it would double the
activation memory on the device while the trainer runs); the warm-up's transient peak in
the preinitialization controller's footprints (it runs before the shadow reports itself
parked; the trainer's own peak is reached by then — shadows start after its first
iteration — so it allocates little while a shadow warms up).
"""

from __future__ import annotations

import gc
import sys
import time

import torch

from leto import plugins


def warm_up(fn, device: torch.device, rank: int) -> dict:
    """Run ``fn(device)``; returns the shadow's timings of it."""
    t0 = time.time()
    failed = None
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        try:
            fn(device)
            if cuda:
                torch.cuda.synchronize(device)  # its kernels ran, not only were queued
        except Exception as e:  # the user's code: any error only costs the head start
            failed = f"{type(e).__name__}: {e}"
            print(
                f"rank {rank}: shadow: warm-up failed ({failed}); parks without it",
                file=sys.stderr,
                flush=True,
            )
    gc.collect()  # the stand-in's tensors, if a reference cycle held them
    if cuda:
        torch.cuda.empty_cache()
    out = {
        "warmup_s": time.time() - t0,
        "warmup_reserved_bytes": torch.cuda.memory_reserved(device) if cuda else 0,
    }
    if failed:
        out["warmup_failed"] = failed
    return out


def generic_step(device: torch.device) -> None:
    """The warm-up of a script that gives none (issue 37, a plain script): one small step
    through what a transformer's training step reaches lazily on first use — cuBLAS and
    cuBLASLt handles (fp32, TF32 and bf16 GEMMs, forward and backward), SDPA's fused
    attention kernels under bf16 autocast, layer norm, GELU, embedding, cross entropy,
    a gradient-norm clip and torch's fused AdamW. Not the script's shapes: kernels picked
    per shape still load at the first real iteration; the handles, the libraries'
    one-time set-up and the common kernels do not."""
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    emb = torch.nn.Embedding(64, 64, device=device)
    lin = torch.nn.Linear(64, 64, device=device)
    norm = torch.nn.LayerNorm(64, device=device)
    params = [*emb.parameters(), *lin.parameters(), *norm.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for allow in (False, True) if cuda else (False,):
            torch.backends.cuda.matmul.allow_tf32 = allow
            for dtype in (torch.bfloat16, None):
                with torch.autocast(
                    device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None
                ):
                    x = norm(emb(torch.randint(0, 64, (2, 16), device=device)))
                    q = F.gelu(lin(x)).view(2, 16, 4, 16).transpose(1, 2)
                    a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
                    logits = lin(a.transpose(1, 2).reshape(2, 16, 64))
                    loss = F.cross_entropy(
                        logits.float().view(-1, 64),
                        torch.zeros(32, dtype=torch.long, device=device),
                    )
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def warm_tools(device: torch.device, rank: int) -> dict:
    """The loaded plugins' shadow warm-ups; returns their time (and failures)."""
    t0 = time.time()
    failed = plugins.warm_shadow(device)
    for f in failed:
        print(f"rank {rank}: shadow: a tool's warm-up failed ({f})", file=sys.stderr, flush=True)
    out = {"tools_warmup_s": time.time() - t0}
    if failed:
        out["tools_warmup_failed"] = failed
    return out
