"""``run.model``: the script's model shaped like the ``DistributedDataParallel`` it replaces.

Runs in a trainer, made by ``leto.Run``. A DDP script keeps what it does with its DDP
object — so its port is ``model = run.model`` where it had ``model = DDP(model)``:

* ``model(x)`` runs the model (``.module``); Leto's fault points and retained
  parameters are the model's own;
* ``model.no_sync()`` and ``model.require_backward_grad_sync = False`` (nanoGPT's
  toggle) make the backward of the forwards they cover accumulate without reducing, as
  DDP's: the flag is read at each forward with autograd on, so a backward outside the
  ``no_sync()`` block of its forward does not reduce either (DDP decides at the forward);
* ``.module`` is the plain model; ``parameters()``, ``named_parameters()`` and
  ``state_dict()`` are DDP's, names prefixed ``module.`` (a script that saves
  ``model.module.state_dict()`` or ``model.state_dict()`` saves what it saved under DDP);
* ``zero_grad()`` does what ``optimizer.zero_grad()`` does under Leto: the gradients
  None (the next backward lands them in retained memory again), or zeroed in place with
  ``set_to_none=False`` (``leto.trainer.grad_landing``);
* buffers: rank 0's running statistics are broadcast before a forward that follows a
  synchronizing one, as DDP's ``broadcast_buffers`` (``leto.trainer.buffer_state``);
* ``torch.compile``: a model compiled inside DDP's forward is compiled by Dynamo in
  pieces split at DDP's gradient buckets (its ``DDPOptimizer``, ``optimize_ddp``), and the
  pieces round as they do; inside this forward Dynamo sees the same bucket size
  (``leto.Run(bucket_mib=)``, DDP's ``bucket_cap_mb``, 25 by default) and each
  parameter's own bytes (a retained parameter is a view of one large buffer, whose size
  DDPOptimizer would otherwise count for each), so it splits where it would under DDP.

Not covered: ``isinstance(model, DistributedDataParallel)`` (it is not one),
communication hooks, ``static_graph``, ``find_unused_parameters`` (Leto refuses a
parameter that gets no gradient instead), ``load_state_dict`` (load before ``leto.Run``).
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

from leto.errors import InvalidInput

MiB = 1 << 20


class DDPShaped(torch.nn.Module):
    def __init__(
        self, module: torch.nn.Module, run, buffers=None, bucket_mib: float | None = None
    ):
        """``run``: the ``leto.Run`` that retains ``module``; ``buffers``: its
        ``RetainedBuffers`` (None: none to broadcast); ``bucket_mib``: the gradient
        buckets' size, for Dynamo's graph splits (None: the model is not data parallel,
        nothing to split at)."""
        super().__init__()
        self.module = module
        self._split = (
            _DynamoBuckets(int(bucket_mib * MiB))
            if bucket_mib is not None and math.isfinite(bucket_mib)
            else None
        )
        # Plain attributes (Run is no Module): not part of state_dict or parameters.
        self._run = run
        self._stats = buffers if buffers is not None and buffers.broadcast_stats else None
        self.require_backward_grad_sync = True
        # DDP's require_forward_param_sync: rank 0's buffers are broadcast before a
        # forward that follows one with gradient synchronization (and before the first).
        self._sync_buffers = True

    def forward(self, *args, **kwargs):
        run = self._run
        if self._sync_buffers and self._stats is not None and self._stats.world > 1:
            self._stats.broadcast()  # the running statistics: DDP's broadcast_buffers
        if torch.is_grad_enabled():
            # DDP prepares its reducer here, for the backward of this forward.
            run.job.sync_backward(self.require_backward_grad_sync)
        if self._split is not None and "torch._dynamo" in sys.modules:
            with self._split.inside():  # a model compiled inside: split as under DDP
                out = self.module(*args, **kwargs)
        else:
            out = self.module(*args, **kwargs)
        self._sync_buffers = torch.is_grad_enabled() and self.require_backward_grad_sync
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's: the backward of every forward inside accumulates, nothing is reduced."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._run._zero_grad(set_to_none)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        raise InvalidInput(
            "model.load_state_dict() after leto.Run: the parameters are retained and "
            "restored by Leto; load your own checkpoint into the model before leto.Run "
            "(with start_iteration=) — nothing was changed"
        )


class _DynamoBuckets:
    """What Dynamo reads of the DDP whose forward it compiles inside
    (``DistributedDataParallel._get_active_ddp_module()``): its ``bucket_bytes_cap``."""

    def __init__(self, bucket_bytes_cap: int):
        self.bucket_bytes_cap = bucket_bytes_cap

    @contextlib.contextmanager
    @torch._disable_dynamo(recursive=False)  # as DDP's _inside_ddp_forward
    def inside(self):
        from torch.nn.parallel import DistributedDataParallel as DDP

        _own_bytes_in_buckets()
        old = DDP._active_ddp_module
        DDP._active_ddp_module = self
        _state["on"] += 1
        try:
            yield
        finally:
            _state["on"] -= 1
            DDP._active_ddp_module = old


_state = {"on": 0, "patched": False}


def _own_bytes_in_buckets() -> None:
    """DDPOptimizer counts a parameter by its storage's bytes: a standalone parameter's
    own, under DDP; a retained one's is the whole buffer it is a view of. Inside
    ``_DynamoBuckets.inside`` it counts each parameter's own bytes (what its storage
    holds under DDP), so the buckets, and the graph's pieces, are DDP's."""
    if _state["patched"]:
        return
    from torch._dynamo.backends import distributed

    original = distributed.DDPOptimizer.add_param

    def add_param(self, bucket, param, name):
        if not _state["on"]:
            return original(self, bucket, param, name)
        bucket.size += param.numel() * param.element_size()
        bucket.params.append(name)
        bucket.param_ids.append(id(param))

    distributed.DDPOptimizer.add_param = add_param
    _state["patched"] = True
