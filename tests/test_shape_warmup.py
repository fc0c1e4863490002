"""A run-ahead shadow's warm-up at the script's shapes (leto.trainer.shape_warmup): the
active trainer records its model's first forward call and publishes it after the first
iteration; the shadow finds the same model among the script's variables and runs it
forward and backward once on zero inputs of those shapes, leaving its parameters,
gradients, buffers and the random generators as they were; anything that would act
outside the process stops it first; a promotion that has come skips it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from leto.job import keys
from leto.trainer import run_ahead, shape_warmup

CPU = torch.device("cpu")


class Net(torch.nn.Module):
    """A forward with keyword arguments, a buffer it changes, dropout and a scalar loss
    among its outputs; what it saw is counted."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 50)
        self.seen: list[tuple] = []
        self.on_forward = None

    def forward(self, idx, targets=None, *, scale=1.0):
        self.seen.append((tuple(idx.shape), idx.dtype, torch.is_autocast_enabled("cpu")))
        if self.on_forward is not None:
            self.on_forward()
        h = torch.nn.functional.dropout(self.norm(self.emb(idx).mean(1)), 0.5, self.training)
        logits = self.head(h) * scale
        loss = torch.nn.functional.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv(shape_warmup.ENV_SHAPE_WARMUP, "1")
    monkeypatch.setattr(run_ahead, "_state", {**run_ahead._state, "ahead": None})


def _recorded(store, model, rank=0):
    rec = shape_warmup.Recorder(model, store, rank, CPU)
    idx, tgt = torch.randint(0, 50, (4, 7)), torch.randint(0, 50, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, tgt, scale=0.5)
    model(idx[:2], tgt[:2])  # a later call is not what is recorded
    rec.done()
    return json.loads(store.get(keys.shape_warmup(rank)))


def test_the_first_forward_is_recorded_and_published():
    store = dist.HashStore()
    spec = _recorded(store, Net())
    assert spec["module"].endswith("test_shape_warmup.Net")
    assert spec["args"]["l"][0] == {"t": [4, 7], "dtype": "int64", "device": "cpu", "grad": False}
    assert spec["args"]["l"][1]["t"] == [4]
    assert spec["kwargs"] == {"d": {"scale": {"v": 0.5}}}
    assert spec["autocast"] is True and spec["autocast_dtype"] == "bfloat16"
    assert spec["peak_bytes"] == 0  # (the CPU: no device peak)


def test_what_cannot_be_recorded_is_published_as_why_not():
    store = dist.HashStore()
    model = torch.nn.Linear(3, 3)
    rec = shape_warmup.Recorder(model, store, 1, CPU)

    class Batch:  # a custom batch type
        pass

    rec._first(model, (Batch(),), {})  # (the hook, as the forward call would run it)
    rec.done()
    got = json.loads(store.get(keys.shape_warmup(1)))
    assert got == {"why_not": "the forward's arguments[0] is a Batch"}
    sharded = shape_warmup.Recorder(model, store, 2, CPU, why_not="the model is sharded")
    sharded.done()
    assert json.loads(store.get(keys.shape_warmup(2))) == {"why_not": "the model is sharded"}
    silent = shape_warmup.Recorder(model, store, 3, CPU)
    silent.done()  # no forward in the first iteration
    assert "was not called" in json.loads(store.get(keys.shape_warmup(3)))["why_not"]


def _state(model):
    return (
        [p.detach().clone() for p in model.parameters()],
        [b.detach().clone() for b in model.buffers()],
        torch.get_rng_state(),
    )


def _same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    assert torch.equal(a[2], b[2]), "the generator moved"


def test_the_shadow_runs_the_model_at_those_shapes_and_leaves_it_as_it_was(on):
    store = dist.HashStore()
    _recorded(store, Net())
    model = Net()  # the shadow's own, found among this frame's variables
    model.train()
    before = _state(model)
    got = shape_warmup.warm(store, 0, CPU, __import__("sys")._getframe())
    assert "shape_warmup_s" in got, got
    assert model.seen == [((4, 7), torch.int64, True)]  # the recorded call, autocast on
    assert all(p.grad is None for p in model.parameters())
    _same(before, _state(model))  # BatchNorm's statistics and the generator put back


def test_a_model_behind_a_wrapper_is_found():
    inner = Net()

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.module = m

    wrapped = Wrapper(inner)  # noqa: F841 (found in this frame)
    name = shape_warmup.qualname(inner)
    assert shape_warmup.find_module(name, __import__("sys")._getframe()) is inner
    assert shape_warmup.find_module("no.such.Model", __import__("sys")._getframe()) is None


@pytest.mark.parametrize("reaches", ["collective", "file"])
def test_a_step_outside_the_process_stops_the_warm_up_before_it_happens(on, tmp_path, reaches):
    store = dist.HashStore()
    _recorded(store, Net())
    model = Net()
    promotions = []
    ahead = run_ahead.Ahead(0, lambda: promotions.append(ahead.stopped_at), store, CPU)
    target = tmp_path / "written.log"
    if reaches == "collective":
        model.on_forward = lambda: dist.all_reduce(torch.zeros(1))
    else:
        model.on_forward = lambda: open(target, "w").close()
    before = _state(model)
    ahead.start()
    try:
        ahead.reach("reached leto.Run")
    finally:
        ahead._unhook()
        ahead._release()
    assert promotions == ["reached leto.Run"]  # the promotion went on, once
    why = ahead.warmup["shape_warmup_not"]
    assert why.startswith("stopped: the model's forward or backward "), why
    assert ("all_reduce" in why) if reaches == "collective" else (str(target) in why)
    assert not target.exists()
    assert all(p.grad is None for p in model.parameters())
    _same(before, _state(model))


def test_a_promotion_that_came_skips_it(on):
    store = dist.HashStore()
    _recorded(store, Net())
    model = Net()
    assert shape_warmup.warm(store, 0, CPU, __import__("sys")._getframe(), lambda: True) == {}
    assert model.seen == []
    calls = iter([False, True])  # it comes during the forward: no backward
    got = shape_warmup.warm(store, 0, CPU, __import__("sys")._getframe(), lambda: next(calls))
    assert got["shape_warmup_not"] == "stopped: the promotion came after its forward"
    assert len(model.seen) == 1 and all(p.grad is None for p in model.parameters())


def test_a_model_on_the_meta_device_is_not_run_and_it_says_why(on):
    # A script's prepare= skeleton (the example job's): no values until leto.Run binds
    # the retained state; before, its forward raised and the log said "stopped: ...".
    store = dist.HashStore()
    _recorded(store, Net())
    with torch.device("meta"):
        model = Net()
    got = shape_warmup.warm(store, 0, CPU, __import__("sys")._getframe())
    assert "meta device" in got["shape_warmup_not"] and "warmup=" in got["shape_warmup_not"]
    assert not got["shape_warmup_not"].startswith("stopped"), got
    assert model.seen == []


def test_without_room_for_the_whole_batch_a_fraction_that_fits_is_chosen():
    # The peak scales with the batch (the leading size every tensor argument shares):
    # the smallest power-of-two fraction whose peak and margin fit; none where the batch
    # is not shared, is odd, or not even a single sample's part would fit.
    GiB, margin = shape_warmup.GiB, shape_warmup.MARGIN_BYTES
    t = lambda *shape: {"t": list(shape), "dtype": "int64", "device": "cpu", "grad": False}  # noqa: E731
    spec = {"args": {"l": [t(16, 1024), t(16, 1024)], "tuple": True},
            "kwargs": {"d": {"scale": {"v": 0.5}}}, "peak_bytes": 32 * GiB}  # fmt: skip
    assert shape_warmup.fraction(spec, 40 * GiB) == 1
    assert shape_warmup.fraction(spec, 16 * GiB) == 4  # 8 + 1 fits; 16 + 1 does not
    assert shape_warmup.fraction(spec, 17 * GiB) == 2
    assert shape_warmup.fraction(spec, 2 * GiB + margin) == 16
    assert shape_warmup.fraction(spec, 2 * GiB + margin - 1) is None  # one sample is too much
    odd = {**spec, "args": {"l": [t(3, 1024)], "tuple": True}}
    assert shape_warmup.fraction(odd, 16 * GiB) is None
    mixed = {**spec, "args": {"l": [t(16, 1024), t(8)], "tuple": True}}
    assert shape_warmup.fraction(mixed, 16 * GiB) is None
    # The arguments made for it: the leading size divided, the rest as recorded.
    (a, b) = shape_warmup._decode(spec["args"] | {"l": [t(16, 1024)] * 2}, CPU, 4)
    assert a.shape == b.shape == (4, 1024)
    assert shape_warmup._decode(spec["kwargs"], CPU, 4) == {"scale": 0.5}


def test_without_shapes_or_room_it_says_why(on):
    store = dist.HashStore()
    assert "published no shapes" in shape_warmup.warm(store, 0, CPU, None)["shape_warmup_not"]
    store.set(keys.shape_warmup(0), json.dumps({"why_not": "the model is compiled"}))
    assert shape_warmup.warm(store, 0, CPU, None)["shape_warmup_not"] == "the model is compiled"


def test_it_is_on_for_a_gpu_and_asked_for_on_the_cpu(monkeypatch):
    monkeypatch.delenv(shape_warmup.ENV_SHAPE_WARMUP, raising=False)
    assert shape_warmup.enabled(torch.device("cuda", 0))
    assert not shape_warmup.enabled(CPU)
    monkeypatch.setenv(shape_warmup.ENV_SHAPE_WARMUP, "0")
    assert not shape_warmup.enabled(torch.device("cuda", 0))
    monkeypatch.setenv(shape_warmup.ENV_SHAPE_WARMUP, "1")
    assert shape_warmup.enabled(CPU)
