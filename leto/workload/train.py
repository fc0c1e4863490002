"""The example job's configuration: one frozen dataclass, one flag per field.

``examples/train_gpt.py`` (run by ``leto run``) parses its flags into a ``TrainConfig``
(``add_arguments`` / ``from_args``); faultkit, the benchmarks and the tests build one
and turn it back into those flags (``flags``), so everything drives the same script.
Everything a rank computes is a function of (seed, iteration, rank): data, dropout and
the gradient all-reduce (fixed world size), with deterministic algorithms on, so a
recovered run equals a fault-free one bit for bit.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch

from leto.workload.gpt import GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    iterations: int = 6
    batch_size: int = 4  # sequences per rank
    seq_len: int = 64
    seed: int = 0  # data, dropout and weights
    dtype: str = "float32"  # or "bfloat16" (fp32 master weights and moments)
    peak_lr: float = 1e-3
    chunk_units: int = 2  # updater chunk size (units)
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    dropout: float = 0.1
    zero1: bool = False  # shard optimizer state (and the update) across ranks
    # Gradient accumulation: micro-batches of batch_size sequences per iteration, their
    # gradients summed into the retained gradient buffer (each loss divided by the count).
    micro_batches: int = 1
    # "bf16": forward and backward under torch.autocast(bfloat16); "fp16": float16 with a
    # torch.amp.GradScaler (its first scale init_scale; a step with inf/NaN is skipped).
    autocast: str = "off"
    init_scale: float = 65536.0
    tf32: bool = False  # TF32 matmuls and convolutions on CUDA
    # AdamW as AdamW(fused=True); "single": AdamW(foreach=False); "muon": torch.optim.Muon
    # for the blocks' 2-D weights beside fused AdamW for the rest (two optimizers).
    optimizer: str = "fused"
    # Gradients all-reduced in buckets of this size while backward runs (0: one
    # all-reduce of the whole buffer after backward).
    bucket_mib: float = 25.0

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches}: at least 1")
        if self.autocast not in ("off", "bf16", "fp16"):
            raise ValueError(f"autocast={self.autocast!r}: 'off', 'bf16' or 'fp16'")
        if self.optimizer not in ("fused", "single", "muon"):
            raise ValueError(f"optimizer={self.optimizer!r}: 'fused', 'single' or 'muon'")

    def autocast_context(self, device: torch.device):
        """The forward/backward context this configuration asks for."""
        dtype = torch.float16 if self.autocast == "fp16" else torch.bfloat16
        return torch.autocast(device.type, dtype=dtype, enabled=self.autocast != "off")

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            block=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )

    def flags(self) -> list[str]:
        """The script's flags for this configuration (defaults left out)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(v, bool):
                out.append(flag if v else "--no-" + flag[2:])
            else:
                out += [flag, str(v)]
        return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            ap.add_argument(flag, type=kind, default=f.default, help=f"default {f.default}")


def from_args(ns: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(ns, f.name) for f in fields(TrainConfig)})
