"""A real text corpus that needs no download: the Python standard library's own source.

Runs in each trainer. Byte-level tokens (vocabulary 256). The file list is sorted and
the corpus cut to ``max_bytes``, so every process on one machine reads the same bytes;
another Python version gives another (equally deterministic) corpus. A batch is a pure
function of (seed, iteration, rank): redoing an iteration after a crash sees the same
data.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


@functools.lru_cache(maxsize=4)
def corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    root = Path(os.__file__).parent
    data = bytearray()
    for f in sorted(root.glob("*.py")):
        data += f.read_bytes()
        if len(data) >= max_bytes:
            break
    if len(data) < 1 << 16:
        raise RuntimeError(f"the standard library under {root} gave only {len(data)} bytes of text")
    return torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).to(torch.int64)


def batch(
    seed: int, iteration: int, rank: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = corpus()
    g = torch.Generator().manual_seed(((seed * 1_000_003) + iteration) * 1_009 + rank)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g)
    x = torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1 : s + seq_len + 1] for s in starts.tolist()])
    return x, y
