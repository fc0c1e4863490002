"""A nanoGPT-style GPT (after karpathy/nanoGPT's ``model.py``) and a synthetic token
stream, shared by ``gpt_torchrun.py`` and its Leto port ``gpt_leto.py``, as a user's
``model.py`` beside the training script.

The model: learned token and position embeddings, the output head tied to the token
embedding, pre-LayerNorm blocks (no biases), causal attention through
``F.scaled_dot_product_attention`` (torch picks the backend), a GELU MLP, no dropout.
No buffers (the positions are made per forward): every tensor of the state is a
parameter.

Not covered: loading real data or pretrained weights, generation, ``torch.compile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64
    seq: int = 1024  # context length: positions the model has embeddings for
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        if c.n_embd % c.n_head:
            raise ValueError(f"n_embd {c.n_embd} is not a multiple of n_head {c.n_head}")
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=False)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=False)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=False)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.n_embd)
        self.wpe = nn.Embedding(c.seq, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=False)
        self.lm_head = nn.Linear(c.n_embd, c.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two names
        # GPT-2's initialization (as nanoGPT): N(0, 0.02), the residual projections
        # scaled down by sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting ``targets`` from ``idx`` (both (B, T))."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


_ZIPF: dict[int, torch.Tensor] = {}


def _zipf(vocab: int) -> torch.Tensor:
    if vocab not in _ZIPF:
        _ZIPF[vocab] = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return _ZIPF[vocab]


def batch(
    seed: int,
    rank: int,
    iteration: int,
    micro: int,
    batch_size: int,
    seq: int,
    vocab: int,
    device: torch.device,
    tokens: str = "uniform",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of ``iteration`` on ``rank``: (inputs, targets), each
    (batch_size, seq) int64 on ``device``. A pure function of its arguments (random
    tokens from a CPU generator seeded by them), so every run, and every restart of a
    rank, sees the same stream. ``tokens="zipf"`` draws them with text's frequencies
    (token k with weight 1/k): most of the vocabulary is then absent from a batch, and a
    tied embedding's rows for those tokens get only the output head's tiny gradients —
    float32 denormals in AdamW's second moment, which uniform tokens never produce."""
    key = ((seed * 1_000_003 + rank) * 1_000_003 + iteration) * 1_009 + micro
    g = torch.Generator().manual_seed(key % 2**63)
    if tokens == "zipf":
        n = batch_size * (seq + 1)
        drawn = torch.multinomial(_zipf(vocab), n, replacement=True, generator=g)
        tokens_ = drawn.view(batch_size, seq + 1)
    elif tokens == "uniform":
        tokens_ = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    else:
        raise ValueError(f"tokens={tokens!r}: expected 'uniform' or 'zipf'")
    tokens = tokens_
    if device.type == "cuda":
        tokens = tokens.pin_memory()  # so the copy is queued, not waited for
    tokens = tokens.to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]
