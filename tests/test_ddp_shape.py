"""``run.model`` (``leto.trainer.ddp_shape``) does what a DDP script does with its DDP
object, on the gradient buckets Leto reduces with (no processes): nanoGPT's
``require_backward_grad_sync = False`` and ``no_sync()`` skip the reduction of the
backward of the forwards they cover — also when the backward runs after the block, as
DDP decides at the forward — and ``True`` reduces; ``.module``, ``named_parameters()``
and ``state_dict()`` are DDP's (prefixed ``module.``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from leto.errors import InvalidInput
from leto.trainer.buckets import GradBuckets
from leto.trainer.ddp_shape import DDPShaped
from leto.trainer.retained import RetainedTraining
from tests.test_buckets import _model_on_flat


def _shaped():
    """A DDP-shaped model over retained-style flat gradients, its buckets' launches
    counted instead of all-reduced (one rank: nothing to reduce with)."""
    model, state = _model_on_flat()
    buckets = GradBuckets(dict(model.named_parameters()), state, bucket_mib=0.4)
    launched: list[int] = []
    buckets._launch = lambda b: (launched.append(b), setattr(buckets, "_next", b + 1))
    job = SimpleNamespace(fsdp=False, buckets=buckets)
    job.sync_backward = lambda on: RetainedTraining.sync_backward(job, on)
    zeroed = []
    run = SimpleNamespace(job=job, _zero_grad=lambda set_to_none=True: zeroed.append(1))
    return DDPShaped(model, run), model, buckets, launched, zeroed


def _step(ddp, buckets, x):
    loss = ddp(x).square().mean()
    loss.backward()
    buckets._ready = [0] * len(buckets.ranges)  # (finish() would reset; no process group here)
    buckets._next = 0


def test_the_sync_toggle_and_no_sync_skip_the_reduction_like_ddp():
    ddp, model, buckets, launched, _ = _shaped()
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    everything = list(range(len(buckets.ranges)))
    ddp.require_backward_grad_sync = False  # nanoGPT, every micro-step but the last
    _step(ddp, buckets, x)
    assert launched == [], f"reduced with require_backward_grad_sync=False: {launched}"
    ddp.require_backward_grad_sync = True
    _step(ddp, buckets, x)
    assert launched == everything, launched
    launched.clear()
    with ddp.no_sync():
        _step(ddp, buckets, x)
    assert launched == [] and ddp.require_backward_grad_sync, launched
    # DDP decides at the forward: a backward after the block still does not reduce.
    with ddp.no_sync():
        loss = ddp(x).square().mean()
    loss.backward()
    assert launched == [], f"the backward of a no_sync() forward reduced: {launched}"
    # A forward without autograd (evaluation) changes nothing.
    with torch.no_grad():
        ddp(x)
    _step(model, buckets, x)  # (the plain model: the last forward's decision stands)
    assert launched == [], launched
    _step(ddp, buckets, x)
    assert launched == everything, launched


def test_module_names_state_dict_and_zero_grad_are_ddps():
    ddp, model, _, _, zeroed = _shaped()
    assert ddp.module is model
    # DDP holds the model as its submodule "module": its names carry that prefix.
    want = [f"module.{k}" for k in model.state_dict()]
    assert list(ddp.state_dict()) == want, list(ddp.state_dict())
    assert [n for n, _ in ddp.named_parameters()] == [
        f"module.{n}" for n, _ in model.named_parameters()
    ]
    assert all(a is b for a, b in zip(ddp.parameters(), model.parameters(), strict=True))
    ddp.zero_grad()
    assert zeroed == [1], "zero_grad must zero the retained gradients in place"
    with pytest.raises(InvalidInput, match="load your own checkpoint into the model before"):
        ddp.load_state_dict(model.state_dict())


def test_the_toggle_under_fsdp_is_refused_naming_fsdps_own():
    ddp, *_ = _shaped()
    ddp._run.job.fsdp = True
    ddp.require_backward_grad_sync = False
    with pytest.raises(InvalidInput, match="set_requires_gradient_sync"):
        ddp(torch.zeros(1, 300))
