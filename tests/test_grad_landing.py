"""Gradients copied into the retained buffer as autograd hands them over
(``leto.trainer.grad_landing``) give the buffer the bytes that adding them to a zeroed
buffer gave — a negative zero lands as zero, a parameter no backward reached reads zero,
micro-batches accumulate, a tied parameter has one gradient, a sparse one lands too —
and a script that keeps its gradients gets the zeroed views, as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from leto.trainer import grad_landing
from leto.trainer.grad_landing import GradLanding
from leto.update.layout import ParamSlot


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.a = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        h = torch.relu(self.a(self.emb(idx)))
        h = self.frozen(h)
        # A gradient of -0.0 somewhere: relu's zeros times a negative upstream.
        return self.head(h)


def _bound(seed: int = 0):
    """The net with its parameters' gradients views of one flat buffer, as bound."""
    torch.manual_seed(seed)
    net = _Net()
    named = dict(net.named_parameters(remove_duplicate=True))
    slots, off = [], 0
    for name, p in named.items():
        off = -(-off // 16) * 16
        slots.append(ParamSlot(name, p.shape, off, p.numel(), trainable=p.requires_grad))
        off += p.numel()
    grad = torch.full((off,), 7.0)  # what a buffer holds from the last iteration
    return net, named, SimpleNamespace(grad=grad, slots=slots)


def _views_and_zero(named, state):
    state.grad.zero_()
    for s in state.slots:
        if s.trainable:
            named[s.name].grad = state.grad[s.offset : s.offset + s.numel].view(s.shape)


def _batches(k: int):
    g = torch.Generator().manual_seed(k)
    return [torch.randint(0, 11, (5, 3), generator=g) for _ in range(2)]


def _iteration(net, batches):
    for idx in batches:  # micro-batches: gradients accumulate
        net(idx).square().mean().neg().backward()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("gaps", ["indexed", "filled"])
def test_copied_gradients_give_the_buffer_the_bytes_a_zeroed_buffer_got(gaps, monkeypatch):
    # (what no view covers — alignment gaps, the frozen layer — zeroed by one indexed
    # fill, or a fill a gap where the index would be too large)
    if gaps == "filled":
        monkeypatch.setattr(grad_landing, "MAX_INDEXED", 0)
    ref_net, ref_named, ref_state = _bound()
    net, named, state = _bound()
    landing = GradLanding(named, state)
    for k in range(3):
        _views_and_zero(ref_named, ref_state)
        _iteration(ref_net, _batches(k))
        for p in named.values():
            p.grad = None  # the script's zero_grad(set_to_none=True)
        assert landing.begin() is True
        _iteration(net, _batches(k))
        landing.finish()
        assert torch.equal(_bits(state.grad), _bits(ref_state.grad)), f"iteration {k}"
        for s in state.slots:
            view = state.grad[s.offset : s.offset + s.numel]
            if s.trainable:
                assert named[s.name].grad.data_ptr() == view.data_ptr(), s.name
        # The unused parameter read zero (not last iteration's 7.0), as before.
        u = next(s for s in state.slots if s.name == "unused.weight")
        assert not state.grad[u.offset : u.offset + u.numel].any()
        with torch.no_grad():  # an update between iterations
            for p in list(named.values()) + list(ref_named.values()):
                p.add_(0.01)


def test_a_negative_zero_lands_as_zero_as_it_did_into_a_zeroed_buffer():
    p = torch.nn.Parameter(torch.zeros(4))
    state = SimpleNamespace(grad=torch.full((4,), 3.0), slots=[ParamSlot("w", p.shape, 0, 4)])
    landing = GradLanding({"w": p}, state)
    assert landing.begin()
    (p * torch.tensor([-0.0, 1.0, -2.0, 0.0])).sum().backward()
    assert _bits(state.grad).tolist() == _bits(torch.tensor([0.0, 1.0, -2.0, 0.0])).tolist()


def test_a_sparse_gradient_lands_too():
    emb = torch.nn.Embedding(6, 2, sparse=True)
    p = emb.weight
    state = SimpleNamespace(grad=torch.full((12,), 5.0), slots=[ParamSlot("w", p.shape, 0, 12)])
    landing = GradLanding({"w": p}, state)
    p.grad = None
    assert landing.begin()
    emb(torch.tensor([1, 1, 4])).sum().backward()
    want = torch.zeros(6, 2)
    want[1], want[4] = 2.0, 1.0
    assert torch.equal(state.grad.view(6, 2), want)
    assert p.grad.layout is torch.strided and p.grad.data_ptr() == state.grad.data_ptr()


def test_a_script_that_keeps_its_gradients_gets_the_zeroed_views_as_before():
    net, named, state = _bound()
    landing = GradLanding(named, state)
    _views_and_zero(named, state)  # attached at the bind, kept by zero_grad(set_to_none=False)
    assert landing.begin() is False
    before = state.grad.clone()
    _iteration(net, _batches(0))
    landing.finish()  # nothing to do
    assert not torch.equal(state.grad, before)  # accumulated into the views


@pytest.mark.gpu
def test_on_the_gpu_copied_gradients_give_the_bytes_a_zeroed_buffer_got():
    """The hooks run on autograd's device thread: the copy is queued on the stream its
    node runs on, before the post-accumulate hook hands the view back."""
    dev = torch.device("cuda")
    ref_net, ref_named, ref_state = _bound()
    net, named, state = _bound()
    for x in (ref_net, net):
        x.to(dev)
    for st in (ref_state, state):
        st.grad = st.grad.to(dev)
    ref_named = dict(ref_net.named_parameters())
    named = dict(net.named_parameters())
    landing = GradLanding(named, state)
    for k in range(3):
        _views_and_zero(ref_named, ref_state)
        batches = [b.to(dev) for b in _batches(k)]
        _iteration(ref_net, batches)
        for p in named.values():
            p.grad = None
        assert landing.begin()
        _iteration(net, batches)
        landing.finish()
        assert torch.equal(_bits(state.grad), _bits(ref_state.grad)), f"iteration {k}"


def test_a_script_that_zeroes_after_the_iteration_began_lands_by_copy_too():
    # optimizer.zero_grad() at the top of the loop body: the iteration began with the
    # views attached and zeroed; the script's zero_grad(set_to_none=True) then sets them
    # to None (release), and the backward after it lands by copy.
    ref_net, ref_named, ref_state = _bound()
    net, named, state = _bound()
    landing = GradLanding(named, state)
    _views_and_zero(named, state)
    assert landing.begin() is False
    landing.release()
    assert all(p.grad is None for p in named.values())
    _views_and_zero(ref_named, ref_state)
    _iteration(ref_net, _batches(4))
    _iteration(net, _batches(4))
    landing.finish()
    assert torch.equal(_bits(state.grad), _bits(ref_state.grad))


def test_a_bucket_launched_at_backwards_end_carries_zero_for_a_parameter_no_backward_reached(
    monkeypatch,
):
    # The bucket holding an unused parameter completes only in finish(), at backward's
    # end: its view must be zeroed before that launch (the all-reduce, and gradient
    # replay's digest of the local gradient just before it), not after.
    import torch.distributed as dist

    from leto.trainer.buckets import GradBuckets

    net, named, state = _bound()
    landing = GradLanding(named, state)
    state.numel = state.grad.numel()
    buckets = GradBuckets(named, state, bucket_mib=64, at_backward_end=True)
    buckets.before_finish = landing.finish
    seen = []
    buckets.before_launch = lambda view: seen.append(view.clone())
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: SimpleNamespace(wait=lambda: None))
    landing.release()
    net(_batches(1)[0]).square().mean().backward()  # its callback ran finish()
    assert buckets.reduced and len(seen) == 1
    u = next(s for s in state.slots if s.name == "unused.weight")
    assert not seen[0][u.offset : u.offset + u.numel].any(), "the last iteration's 7.0 went out"


def test_the_gaps_are_zeroed_once_an_iteration_when_the_script_releases_its_gradients():
    # zero_grad(set_to_none=True) at the iteration's end zeroes them; the next
    # iteration's start, finding every gradient None, does not again.
    net, named, state = _bound()
    landing = GradLanding(named, state)
    fills = []
    real = landing._land
    landing._land = lambda: (fills.append(1), real())
    assert landing.begin() and len(fills) == 1  # (bound without gradients: lands)
    _iteration(net, _batches(0))
    landing.release()
    assert len(fills) == 2
    assert landing.begin() and len(fills) == 2 and landing.on
    _iteration(net, _batches(1))
    for p in named.values():  # the script drops them itself: the start zeroes the gaps
        p.grad = None
    assert landing.begin() and len(fills) == 3
