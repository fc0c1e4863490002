"""A small GPT (decoder-only transformer) for the example job.

Plain PyTorch. Attention is ``torch.nn.functional.scaled_dot_product_attention`` with
the backend pinned (``attention_backend``), so which kernel ran is known and stays the
same on every run and every recovery: FlashAttention on CUDA for bf16/fp16 inputs (bf16
autocast) — under ``torch.use_deterministic_algorithms(True)`` its backward runs the
deterministic algorithm — and the math backend otherwise (fp32 on CUDA, where the
memory-efficient kernel's backward is not deterministic; every input on the CPU).
Dropout (attention and residual) draws from the global generators, which the training
loop seeds from (seed, iteration, rank).

Not covered: cuDNN attention (refused under deterministic mode on the H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention_backend(device: torch.device, dtype: torch.dtype) -> SDPBackend:
    """The SDPA backend the example GPT pins for inputs of ``dtype`` on ``device``."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return SDPBackend.FLASH_ATTENTION
    return SDPBackend.MATH


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    block: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.out = nn.Linear(4 * c.n_embd, c.n_embd)
        self.n_head = c.n_head
        self.drop = nn.Dropout(c.dropout)
        self.backend = None  # the SDPA backend of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        backend = attention_backend(q.device, q.dtype)
        self.backend = backend.name  # what ran, for logs and benchmarks
        with sdpa_kernel([backend]):
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.drop.p if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.n_embd)
        self.pos = nn.Embedding(c.block, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def attention_backend(self) -> str | None:
        """The SDPA backend the last forward ran (None before the first)."""
        return self.blocks[0].backend if len(self.blocks) else None


def init_weights(model: nn.Module, seed: int, std: float = 0.006) -> None:
    """Appendix A.1: weights from N(0, 0.006²); biases zero, LayerNorm weights one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln"):
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))
