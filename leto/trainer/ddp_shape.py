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
* ``zero_grad()`` zeroes the retained gradients in place (as ``optimizer.zero_grad()``
  does under Leto: never None);
* buffers: rank 0's running statistics are broadcast before a forward that follows a
  synchronizing one, as DDP's ``broadcast_buffers`` (``leto.trainer.buffer_state``).

Not covered: ``isinstance(model, DistributedDataParallel)`` (it is not one),
communication hooks, ``static_graph``, ``find_unused_parameters`` (Leto refuses a
parameter that gets no gradient instead), ``load_state_dict`` (load before ``leto.Run``).
"""

from __future__ import annotations

import contextlib

import torch

from leto.errors import InvalidInput


class DDPShaped(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, run, buffers=None):
        """``run``: the ``leto.Run`` that retains ``module``; ``buffers``: its
        ``RetainedBuffers`` (None: none to broadcast)."""
        super().__init__()
        self.module = module
        # Plain attributes (Run is no Module): not part of state_dict or parameters.
        self._run = run
        self._stats = buffers if buffers is not None and buffers.stats else None
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
