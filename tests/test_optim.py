"""Leto's AdamW pieces against torch's own optimizers, bit for bit: parameters laid out
in one flat buffer as the retained layout does, cut into pieces as the updater cuts
chunks (random cuts, odd sizes), give the bytes ``torch.optim.AdamW(fused=True)`` gives
on the per-parameter tensors (and ``adamw_piece`` those of ``foreach=False``); the
clipping coefficient equals the one ``clip_grad_norm_`` multiplies by, either foreach.

The same tests run on CUDA (marker ``gpu``), where the fused and foreach kernels are
different code from the CPU's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leto.update.layout import ALIGN_ELEMS
from leto.update.optim import CUT_ELEMS, AdamWConfig, adamw_fused, adamw_piece, clip_coefficient

CFG = AdamWConfig(max_grad_norm=0.5)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _torch_run(sizes, grads, params, device, impl, steps, lrs):
    ref = [p.clone().to(device).requires_grad_() for p in params]
    kw = {"fused": True} if impl == "fused" else {"foreach": False}
    opt = torch.optim.AdamW(
        ref, lr=1.0, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, weight_decay=CFG.weight_decay, **kw
    )
    for s in range(steps):
        for r, g in zip(ref, grads[s], strict=True):
            r.grad = g.clone().to(device)
        torch.nn.utils.clip_grad_norm_(ref, CFG.max_grad_norm, foreach=impl == "fused")
        for group in opt.param_groups:
            group["lr"] = lrs[s]
        opt.step()
    flat = {"param": torch.cat([r.detach().reshape(-1) for r in ref])}
    for k in ("exp_avg", "exp_avg_sq"):
        flat[k] = torch.cat([opt.state[r][k].reshape(-1) for r in ref])
    return flat


def _leto_run(sizes, grads, params, device, impl, steps, lrs, cuts):
    # Parameters at multiples of ALIGN_ELEMS in one flat buffer, as the retained layout
    # places them; each cut is snapped to a multiple of CUT_ELEMS from its parameter's
    # start, as the updater cuts chunks.
    offs, off = [], 0
    for n in sizes:
        off = -(-off // ALIGN_ELEMS) * ALIGN_ELEMS
        offs.append(off)
        off += n
    total = off
    flat = {k: torch.zeros(total, device=device) for k in ("param", "exp_avg", "exp_avg_sq")}
    gflat = torch.zeros(total, device=device)
    for o, n, p in zip(offs, sizes, params, strict=True):
        flat["param"][o : o + n] = p.to(device)
    ranges = []
    for o, n in zip(offs, sizes, strict=True):
        inner = sorted({o + (c % n) // CUT_ELEMS * CUT_ELEMS for c in cuts} - {o})
        ranges += list(zip([o, *inner], [*inner, o + n], strict=True))
    for s in range(steps):
        for o, n, g in zip(offs, sizes, grads[s], strict=True):
            gflat[o : o + n] = g.to(device)
        views = [gflat[o : o + n] for o, n in zip(offs, sizes, strict=True)]
        clip = clip_coefficient(views, CFG.max_grad_norm, foreach=impl == "fused")

        def args(rs):
            return {
                "param": [flat["param"][a:b] for a, b in rs],
                "grad": [gflat[a:b] for a, b in rs],
                "exp_avg": [flat["exp_avg"][a:b] for a, b in rs],
                "exp_avg_sq": [flat["exp_avg_sq"][a:b] for a, b in rs],
            }

        if impl == "fused":  # several pieces per call, as the updater's half chunks
            half = len(ranges) // 2
            for rs in (ranges[:half], ranges[half:]):
                adamw_fused(CFG, lr=lrs[s], step=s + 1, clip=clip, **args(rs))
        else:
            for r in ranges:
                one = {k: v[0] for k, v in args([r]).items()}
                adamw_piece(CFG, lr=lrs[s], step=s + 1, clip=clip, **one)
    return {
        k: torch.cat([v[o : o + n] for o, n in zip(offs, sizes, strict=True)])
        for k, v in flat.items()
    }


def _check(device, impl, sizes, cuts, seed, steps=3):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]
    # Large gradients on some steps so clipping really scales them.
    grads = [[torch.randn(n, generator=g) * (1 + 3 * s) for n in sizes] for s in range(steps)]
    lrs = [1e-2 * (s + 1) for s in range(steps)]
    want = _torch_run(sizes, grads, params, device, impl, steps, lrs)
    got = _leto_run(sizes, grads, params, device, impl, steps, lrs, cuts)
    for k, w in want.items():
        diff = (got[k].view(torch.int32) != w.view(torch.int32)).nonzero()
        assert diff.numel() == 0, (
            f"{impl} AdamW on {device}: {k} differs from torch at element {int(diff[0])} "
            f"(sizes {sizes}, cuts {cuts})"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "single"])
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 20000), max_size=5),
    seed=st.integers(0, 2**16),
)
def test_a_flat_buffer_cut_anywhere_equals_torch_adamw(device, impl, sizes, cuts, seed):
    _check(device, impl, sizes, cuts, seed)


@pytest.mark.parametrize("device", DEVICES)
def test_large_odd_tensors_equal_fused_adamw(device):
    # Sizes past the fused kernels' chunking (65,536 elements per chunk on CUDA).
    _check(device, "fused", [1, 70_001, 131_075, 3], [5, 69_999, 150_000], seed=7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("foreach", [True, False])
def test_clip_coefficient_equals_clip_grad_norm(device, foreach):
    g = torch.Generator().manual_seed(3)
    sizes = [4096 * 3, 90, 70_001, 7, 2048 * 2048 // 16]
    grads = [torch.randn(n, generator=g).to(device) * 5 for n in sizes]
    params = [torch.zeros(n, device=device, requires_grad=True) for n in sizes]
    for p, gr in zip(params, grads, strict=True):
        p.grad = gr.clone()
    total = torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=foreach)
    want = torch.clamp(0.5 / (total + 1e-6), max=1.0)
    # The same gradients as aligned views of one flat buffer.
    offs, off = [], 0
    for n in sizes:
        off = -(-off // ALIGN_ELEMS) * ALIGN_ELEMS
        offs.append(off)
        off += n
    flat = torch.zeros(off, device=device)
    for o, n, gr in zip(offs, sizes, grads, strict=True):
        flat[o : o + n] = gr
    got = clip_coefficient(
        [flat[o : o + n] for o, n in zip(offs, sizes, strict=True)], 0.5, foreach
    )
    assert got.view(torch.int32).item() == want.view(torch.int32).item(), (
        f"clip coefficient {got.item()!r} != clip_grad_norm_'s {want.item()!r} (foreach={foreach})"
    )
    assert float(got) < 1.0, "the gradients were not large enough to be clipped"


def test_an_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="AdamWConfig.impl='foreach'"):
        AdamWConfig(impl="foreach")
