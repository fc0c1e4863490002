"""Gradient buckets reduced while backward runs: cut at parameter boundaries from the
end of the buffer, launched in index order whatever order backward finishes them, and
equal byte for byte to one all-reduce of the whole buffer (two gloo ranks)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leto.job.store import free_port
from leto.trainer.buckets import GradBuckets
from leto.update.layout import ParamSlot

DIMS = (300, 700, 500, 9)


def _model_on_flat():
    """An MLP whose parameters and gradients are views of flat buffers, at aligned
    offsets, as the retained layout binds them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(a, b) for a, b in zip(DIMS[:-1], DIMS[1:], strict=False))
    )
    slots, off = [], 0
    for name, p in model.named_parameters():
        off = -(-off // 64) * 64
        slots.append(ParamSlot(name, p.shape, off, p.numel()))
        off += p.numel()
    flat, grad = torch.zeros(off), torch.zeros(off)
    for s in slots:
        mod_name, _, attr = s.name.rpartition(".")
        mod = model.get_submodule(mod_name)
        flat[s.offset : s.offset + s.numel] = getattr(mod, attr).detach().reshape(-1)
        p = torch.nn.Parameter(flat[s.offset : s.offset + s.numel].view(s.shape))
        p.grad = grad[s.offset : s.offset + s.numel].view(s.shape)
        setattr(mod, attr, p)
    return model, SimpleNamespace(grad=grad, slots=slots, numel=off)


def test_buckets_are_contiguous_and_cut_at_parameter_boundaries():
    model, state = _model_on_flat()
    b = GradBuckets(dict(model.named_parameters()), state, bucket_mib=0.5)
    starts = {s.offset for s in state.slots} | {0}
    assert b.ranges[-1][0] == 0 and b.ranges[0][1] == state.numel, b.ranges
    for (a, e), (a2, e2) in zip(b.ranges, b.ranges[1:], strict=False):
        assert a2 < e2 == a < e, b.ranges  # from the end backwards, no gap, no overlap
    assert all(a in starts for a, _ in b.ranges), b.ranges
    assert len(b.ranges) > 1, "the test model should need several buckets"


def test_rank_local_parameters_are_in_no_bucket_and_are_not_divided(monkeypatch):
    # An expert in the middle of the buffer and one at its start (offset 0).
    model, state = _model_on_flat()
    local = frozenset({"0.weight", "1.weight"})
    b = GradBuckets(dict(model.named_parameters()), state, bucket_mib=64, rank_local=local)
    spans = {s.name: (s.offset, s.offset + s.numel) for s in state.slots}
    for a, e in b.ranges:
        for name in local:
            lo, hi = spans[name]
            assert e <= lo or hi <= a, f"bucket [{a}, {e}) spans {name} at [{lo}, {hi})"
    covered = {n for n, (lo, hi) in spans.items() if any(a <= lo and hi <= e for a, e in b.ranges)}
    assert covered == set(spans) - local, b.ranges
    # finish() divides the buckets only (no process group: the sums are skipped).
    state.grad.fill_(6.0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: SimpleNamespace(wait=lambda: None))
    b.finish()
    for name, (lo, hi) in spans.items():
        want = 6.0 if name in local else 3.0
        assert bool((state.grad[lo:hi] == want).all()), f"{name}: {state.grad[lo:hi][:3]}"


@pytest.mark.parametrize("local", [frozenset(), frozenset({"1.weight"})])
def test_a_reduction_finished_after_the_clip_moves_the_buffers_version(monkeypatch, local):
    # leto.update.grad_clip uses the parity the script's clip took only while the
    # gradient buffer's autograd version counter has not moved since; a reduction that
    # finishes at the step (after the clip) ends with an in-place division, which moves
    # it (the all-reduce itself would not), whether it divides the whole buffer at once
    # or bucket by bucket (rank-local parameters between them).
    model, state = _model_on_flat()
    b = GradBuckets(dict(model.named_parameters()), state, bucket_mib=64, rank_local=local)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: SimpleNamespace(wait=lambda: None))
    clipped = state.grad._version
    b.finish()
    assert state.grad._version > clipped


def _rank(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.set_num_threads(1)
    model, state = _model_on_flat()
    params = dict(model.named_parameters())
    buckets = GradBuckets(params, state, bucket_mib=0.4)
    launched = []
    real = buckets._launch
    buckets._launch = lambda k: (launched.append(k), real(k))
    x = torch.randn(16, DIMS[0], generator=torch.Generator().manual_seed(rank))
    with buckets.no_sync():  # a first micro-batch: accumulates, reduces nothing
        model(x).square().mean().backward()
    assert launched == [], launched
    model(x * 2).square().mean().backward()
    in_backward = list(launched)
    buckets.finish()
    want = state.grad.clone()
    # The reference: the same local gradients, one all-reduce of the whole buffer.
    state.grad.zero_()
    with buckets.no_sync():
        model(x).square().mean().backward()
        model(x * 2).square().mean().backward()
    dist.all_reduce(state.grad)
    state.grad.div_(2)
    ref = state.grad.clone()
    # At backward's end (the script's own optimizer: its clipping follows backward): the
    # engine callback has reduced and averaged before backward() returns.
    end = GradBuckets(params, state, bucket_mib=0.4, at_backward_end=True)
    state.grad.zero_()
    with buckets.no_sync():  # the first object's hooks stay registered: silence them
        with end.no_sync():
            model(x).square().mean().backward()
        model(x * 2).square().mean().backward()
    at_end = end.reduced and torch.equal(ref.view(torch.int32), state.grad.view(torch.int32))
    torch.save(
        {"in_backward": in_backward, "order": launched, "equal": torch.equal(
            want.view(torch.int32), ref.view(torch.int32)), "n": len(buckets.ranges),
         "at_end": at_end},
        os.path.join(out, f"{rank}.pt"),
    )  # fmt: skip
    dist.destroy_process_group()


@pytest.mark.integ
def test_two_ranks_reduce_in_index_order_to_the_same_bytes(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = torch.load(tmp_path / f"{r}.pt")
        assert got["equal"], f"rank {r}: bucketed reduction differs from one all-reduce"
        assert got["order"] == list(range(got["n"])), got["order"]
        assert got["in_backward"], "no bucket was launched while backward ran"
        assert got["at_end"], f"rank {r}: backward returned before its gradients were reduced"
