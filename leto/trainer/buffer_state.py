"""The model's persistent buffers under ``leto.Run``: normalization layers' running
statistics retained per iteration, constant buffers (a causal mask) left to the script,
and DDP's buffer broadcast kept.

Runs in a trainer, made by ``leto.Run``. A persistent buffer is in the model's state
dict, so a script expects it to survive as its parameters do. Two kinds:

* **running statistics** (``running_mean``, ``running_var``, ``num_batches_tracked`` of
  BatchNorm and InstanceNorm layers that track them): forward writes them — and, alike,
  the ``expert_bias`` of Megatron's MoE routers (``moe_router_enable_expert_bias``:
  updated in ``finalize_model_grads`` from the iteration's token counts, before the
  optimizer step, the same on every rank that routes alike, so never broadcast). They
  travel in the data records (``leto.trainer.data_state``: two parity-protected slots,
  one per iteration parity, carried by checkpoints), written when an iteration commits — after
  its forwards — and loaded at a recovery's resume, so an iteration redone after a
  failure starts from the statistics its first attempt started from (nothing applied
  twice), and an update a recovery finishes has them as they were after its own
  forwards (an iteration's record is written at its step);
* **every other persistent buffer** (llm.c's causal mask, a position table): the script
  computes it when it builds the model, and a promoted trainer builds it again, equal.
  One that training writes anyway is refused when the iteration that wrote it commits,
  by name — it would be lost at a recovery.

DDP broadcasts rank 0's buffers to every rank before a forward that follows a forward
with gradient synchronization (the first one included: its ``require_forward_param_sync``
state); ``run.model`` does the same for the running statistics — the only buffers that
can differ between ranks — so a BatchNorm model's statistics are DDP's bit for bit
(``tests/test_buffers_integ.py``).

Not covered: running statistics and expert biases on a CUDA device (refused at
``leto.Run``: their record is a device-to-host copy at every commit, not yet run on a
GPU); running statistics of models that are not data parallel (FSDP2, tensor and
pipeline parallel: refused as before).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from leto.errors import InvalidInput

# Pickle's framing of a tensor beside its bytes (the data record's size).
PER_TENSOR_BYTES = 1024


def _expert_biases(model: torch.nn.Module) -> list[str]:
    """Megatron's MoE routers' ``expert_bias`` buffers, where their config updates them."""
    return [
        f"{mn}.expert_bias"
        for mn, m in model.named_modules()
        if type(m).__module__.startswith("megatron.")
        and getattr(m, "enable_expert_bias", False)
        and getattr(m, "expert_bias", None) is not None
    ]


def _stats_modules(model: torch.nn.Module):
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
            yield name, m


class RetainedBuffers:
    """``state_dict``/``load_state_dict`` over ``model``'s running statistics (one of the
    data records' objects), and the checks and broadcast of its persistent buffers."""

    def __init__(self, model: torch.nn.Module, device: torch.device, world: int = 1):
        self.model, self.world = model, world
        persistent = set(model.state_dict(keep_vars=True).keys())
        buffers = dict(model.named_buffers())
        # Broadcast from rank 0 as DDP does (they can differ between ranks) ...
        self.broadcast_stats = [
            f"{mn}.{bn}" if mn else bn
            for mn, m in _stats_modules(model)
            for bn, b in m.named_buffers(recurse=False)
            if b is not None
        ]
        # ... and every buffer training writes that is retained per iteration.
        self.stats = [*self.broadcast_stats, *_expert_biases(model)]
        self.constants = {
            n: b._version for n, b in buffers.items() if n in persistent and n not in self.stats
        }
        if self.stats and device.type != "cpu":
            raise InvalidInput(
                f"buffer {self.stats[0]} is written in training (running statistics, or a "
                f"Megatron router's expert bias) on {device.type}: Leto retains such buffers "
                f"on the CPU build only so far (their per-iteration record is not yet run "
                f"on a GPU); use track_running_stats=False (or an auxiliary load-balancing "
                f"loss instead of moe_router_enable_expert_bias), or train on the CPU — "
                f"nothing was retained"
            )

    def record_bytes(self) -> int:
        """Room the statistics take in a data record (pickled)."""
        return sum(
            self.model.get_buffer(n).nbytes + PER_TENSOR_BYTES for n in self.stats
        )  # fmt: skip

    def state_dict(self) -> dict:
        """The running statistics as the iteration commits (CPU copies); a constant
        buffer training wrote is refused here, before anything of the iteration is."""
        for n, v in self.constants.items():
            if self.model.get_buffer(n)._version != v:
                raise InvalidInput(
                    f"persistent buffer {n} was written during training: Leto retains the "
                    f"running statistics of normalization layers, and takes other "
                    f"buffers to be what the script builds (a recovered rank builds them "
                    f"again); register it with persistent=False if it is recomputed, or "
                    f"make it a parameter"
                )
        return {n: self.model.get_buffer(n).detach().clone() for n in self.stats}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for n, v in state.items():
                self.model.get_buffer(n).copy_(v)

    def broadcast(self) -> None:
        """Rank 0's running statistics to every rank, as DDP's forward does."""
        with torch.no_grad():
            for n in self.broadcast_stats:
                dist.broadcast(self.model.get_buffer(n), src=0)
