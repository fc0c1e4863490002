"""A hand-written data loader handed to Leto: llm.c's ``DistributedDataLoader`` pattern
(``train_gpt2.py``) — token shards on disk, each rank reading its slice of every step's
tokens, moving to the next shard at the end of one — with the two methods Leto needs to
retain its position (``state_dict`` / ``load_state_dict``), ported as docs/porting.md
says. Without ``data=loader`` a recovered rank would start again at shard 0 and train on
other tokens than the run that never failed; ``faultkit certify`` names that divergence
(``tests/test_certify.py`` shows it).

    leto run --nproc-per-node 2 examples/porting/shards_leto.py --data shards
    faultkit certify --nproc-per-node 2 -- examples/porting/shards_leto.py --data shards

The shards: llm.c's format (a 256 x int32 header: magic 20240520, version 1, token
count; then the tokens as uint16). If ``--data`` holds none, small synthetic shards are
written there first (llm.c's ``dev/data/*.py`` write real ones). Also llm.c's: gradient
accumulation, a hand-set learning rate (warm-up, then cosine decay) computed from the
iteration, fused AdamW with decayed and undecayed parameter groups, clipping.
"""

import argparse
import contextlib
import glob
import math
import os
import sys

import numpy as np
import torch
from nanogpt_model import GPT, GPTConfig

import leto

MAGIC, VERSION = 20240520, 1
VOCAB, SEQ = 256, 32


def write_shards(folder: str, shards: int = 3, tokens: int = 4096, seed: int = 0) -> None:
    """Synthetic shards in llm.c's format. Every rank may write them at once (no
    collective before leto.Run: a recovered rank runs this alone), so each file is
    written under a private name and renamed into place — the same bytes whoever wins."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for s in range(shards):
        header = np.zeros(256, dtype=np.int32)
        header[:3] = (MAGIC, VERSION, tokens)
        body = rng.integers(0, VOCAB, tokens, dtype=np.uint16)
        path = os.path.join(folder, f"shard_{s:06d}.bin")
        with open(f"{path}.{os.getpid()}", "wb") as f:
            f.write(header.tobytes())
            f.write(body.tobytes())
        os.replace(f"{path}.{os.getpid()}", path)


def load_shard(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        if header[0] != MAGIC or header[1] != VERSION:
            sys.exit(f"{path}: not an llm.c token shard (magic {header[0]}, version {header[1]})")
        tokens = np.frombuffer(f.read(), dtype=np.uint16)
    if len(tokens) != header[2]:
        sys.exit(f"{path}: header says {header[2]} tokens, the file holds {len(tokens)}")
    return tokens


class DistributedDataLoader:
    """llm.c's loader, plus ``state_dict``/``load_state_dict``: its whole position is the
    shard it reads and where in it, so that is all a recovery needs."""

    def __init__(self, pattern: str, B: int, T: int, rank: int, world: int):
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            sys.exit(f"no shard matches {pattern!r}")
        self.B, self.T, self.rank, self.world = B, T, rank, world
        self.reset()

    def reset(self) -> None:
        self.current_shard = 0
        self.current_position = self.B * self.T * self.rank
        self.tokens = load_shard(self.files[0])

    def state_dict(self) -> dict:
        return {"shard": self.current_shard, "position": self.current_position}

    def load_state_dict(self, state: dict) -> None:
        self.current_shard, self.current_position = state["shard"], state["position"]
        self.tokens = load_shard(self.files[self.current_shard])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.B, self.T
        buf = self.tokens[self.current_position : self.current_position + B * T + 1]
        buf = torch.tensor(buf.astype(np.int64))
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T * self.world
        if self.current_position + B * T * self.world + 1 > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.files)
            self.current_position = B * T * self.rank
            self.tokens = load_shard(self.files[self.current_shard])
        return x, y


def get_lr(it: int, max_lr: float, warmup: int, iterations: int) -> float:
    """llm.c's schedule: linear warm-up, then cosine decay to a tenth of the peak."""
    if it < warmup:
        return max_lr * (it + 1) / warmup
    ratio = (it - warmup) / max(1, iterations - warmup)
    return max_lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * ratio)))


def main(hand_over: bool = True) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="shards", help="folder of shard_*.bin (written if empty)")
    ap.add_argument("--iterations", type=int, default=12, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch and rank")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per iteration")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--out", default="out", help="folder for the final parameters")
    args = ap.parse_args()
    ctx = leto.init()
    if not glob.glob(os.path.join(args.data, "shard_*.bin")):
        write_shards(args.data)
    torch.manual_seed(1337)
    model = GPT(GPTConfig(VOCAB, SEQ, n_layer=2, n_head=2, n_embd=64))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )  # fmt: skip
    loader = DistributedDataLoader(
        os.path.join(args.data, "shard_*.bin"), args.batch, SEQ, ctx.rank, ctx.world_size
    )
    # The one line a hand-written loader needs: its position retained every iteration.
    run = leto.Run(ctx, model, optimizer, data=loader if hand_over else None)
    model = run.model
    for it in run.iterations(args.iterations):
        lr = get_lr(it, args.lr, warmup=3, iterations=args.iterations)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros(())
        for micro in range(args.accum):
            x, y = loader.next_batch()
            with model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext():
                loss = model(x, y) / args.accum
                loss.backward()
            total += loss.detach()
        run.record_loss(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    os.makedirs(args.out, exist_ok=True)
    state = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    torch.save(state, os.path.join(args.out, f"rank{ctx.rank}.params.pt"))


if __name__ == "__main__":
    main()
