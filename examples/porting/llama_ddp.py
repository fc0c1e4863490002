"""A plain torchrun + DDP training script: a small Hugging Face Llama (built from a config
object, no download) with AdamW parameter groups, a warm-up schedule, gradient
accumulation and clipping. ``llama_leto.py`` is the same script under Leto
(``docs/porting.md`` shows the difference).

    torchrun --nproc-per-node 2 examples/porting/llama_ddp.py --out ddp-out
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

ACCUM, BATCH, SEQ, VOCAB = 2, 4, 32, 256


def tokens(rank: int, it: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * it + 1_009 * rank + micro)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    # Testing on fewer GPUs (docs/runtime.md): LETO_RANKS_PER_GPU=N puts ranks N*g..N*g+N-1
    # on GPU g, over gloo (NCCL refuses two ranks on one GPU); leto run --ranks-per-gpu sets it.
    per_gpu = int(os.environ.get("LETO_RANKS_PER_GPU", "1"))
    dist.init_process_group("nccl" if torch.cuda.is_available() and per_gpu == 1 else "gloo")
    rank = dist.get_rank()
    cuda_device = torch.device("cuda", rank // per_gpu)
    device = cuda_device if torch.cuda.is_available() else torch.device("cpu")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        # Deterministic algorithms on: SDPA's fp32 CUDA backward is not deterministic.
        attn_implementation="eager" if torch.cuda.is_available() else "sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=3e-3, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 3))
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    for it in range(args.iterations):
        for micro in range(ACCUM):
            x = tokens(rank, it, micro).to(device)
            with model.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
                loss = model(input_ids=x, labels=x).loss / ACCUM
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    os.makedirs(args.out, exist_ok=True)
    state = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    torch.save(state, os.path.join(args.out, f"rank{rank}.params.pt"))
    # DDP's reducer must not hold the last reference to the process group: freed there,
    # gloo's destructor joins its threads with the GIL held and can deadlock (torch #56297).
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
