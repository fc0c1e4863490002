"""An in-process driver of the updater for tests: one rank, gradients from a seeded
generator (no model forward), every retained byte compared with torch.optim.AdamW —
``fused=True`` with ``clip_grad_norm_(foreach=True)`` for ``impl="fused"`` (the
default), ``foreach=False`` with ``clip_grad_norm_(foreach=False)`` for ``"single"``.

A "crash" is faultkit's raise mode: the exception unwinds, every non-retained object
(the client, the updater, the model) is dropped and the pool is unmapped, exactly what
a dead process leaves behind; the next "process" reconnects and recovers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from faultkit import hooks
from leto.memory.client import PoolClient
from leto.update.optim import AdamWConfig, MuonConfig
from leto.update.rmu import Updater, UpdaterConfig, decide
from leto.update.schedule import WarmupCosine

# The points one_iteration below reaches (no forward, all-reduce or gather here).
POINTS = [p for p in hooks.POINTS if p not in ("gather", "compute.forward", "allreduce")]
SCHEDULE = WarmupCosine(peak_lr=1e-2, total_iters=8)
ADAMW = AdamWConfig(max_grad_norm=0.5)


DIMS = (50, 90, 40, 7)


def mlp(dims) -> torch.nn.Module:
    return torch.nn.Sequential(
        *(torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=False))
    )


def build_model(dtype=torch.float32, dims=DIMS) -> torch.nn.Module:
    with torch.device("meta"):
        m = mlp(dims)
    return m.to(dtype)


def init_params(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(1234)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def grads_for(model: torch.nn.Module, iteration: int) -> None:
    g = torch.Generator().manual_seed(10_000 + iteration)
    for p in model.parameters():
        p.grad.copy_((torch.randn(p.shape, generator=g) * (1 + iteration)).to(p.dtype))


MUON = MuonConfig(lr_scale=3.0)


def reference_muon(iterations: int, dims=DIMS) -> dict[str, list[torch.Tensor]]:
    """torch.optim.Muon on the 2-D weights, torch.optim.AdamW (fused) on the rest,
    clip_grad_norm_(foreach=True) first; results per parameter (the retained layout pads
    each layer to whole units, so it is compared tensor by tensor)."""
    model = mlp(dims)
    with torch.no_grad():
        init_params(model)
    params = list(model.parameters())
    weights = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    muon = torch.optim.Muon(
        weights,
        lr=1.0,
        weight_decay=MUON.weight_decay,
        momentum=MUON.momentum,
        nesterov=MUON.nesterov,
        ns_coefficients=MUON.ns_coefficients,
        eps=MUON.eps,
        ns_steps=MUON.ns_steps,
        adjust_lr_fn=MUON.adjust_lr_fn,
    )
    adam = torch.optim.AdamW(
        others,
        lr=1.0,
        betas=(ADAMW.beta1, ADAMW.beta2),
        eps=ADAMW.eps,
        weight_decay=ADAMW.weight_decay,
        **torch_impl(ADAMW.impl),
    )
    for t in range(iterations):
        for p in params:
            p.grad = torch.zeros_like(p)
        grads_for(model, t)
        torch.nn.utils.clip_grad_norm_(params, ADAMW.max_grad_norm, foreach=ADAMW.clip_foreach)
        for group in muon.param_groups:
            group["lr"] = SCHEDULE(t) * MUON.lr_scale
        for group in adam.param_groups:
            group["lr"] = SCHEDULE(t)
        muon.step()
        adam.step()
    out: dict[str, list[torch.Tensor]] = {
        "param": [p.detach().reshape(-1) for p in params],
        "exp_avg": [],
        "exp_avg_sq": [],
    }
    for p in params:
        st = (muon if p.ndim == 2 else adam).state.get(p, {})
        zeros = torch.zeros(p.numel())
        if p.ndim == 2:
            out["exp_avg"].append(st["momentum_buffer"].reshape(-1) if st else zeros)
            out["exp_avg_sq"].append(zeros)
        else:
            out["exp_avg"].append(st["exp_avg"].reshape(-1) if st else zeros)
            out["exp_avg_sq"].append(st["exp_avg_sq"].reshape(-1) if st else zeros)
    return out


def torch_impl(impl: str) -> dict:
    """torch.optim.AdamW's keyword for one of Leto's ``AdamWConfig.impl``."""
    return {"fused": True} if impl == "fused" else {"foreach": False}


def reference(
    iterations: int, dtype=torch.float32, device="cpu", dims=DIMS, impl: str = ADAMW.impl
) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW (``impl``: fused, or foreach=False) with the matching
    clip_grad_norm_, on ``device``; parameters concatenated."""
    model = mlp(dims).to(dtype)
    with torch.no_grad():
        init_params(model)
    model = model.to(device)
    params = list(model.parameters())
    master = (
        [p.detach().float().clone().requires_grad_() for p in params]
        if dtype != torch.float32
        else params
    )
    opt = torch.optim.AdamW(
        master,
        lr=1.0,
        betas=(ADAMW.beta1, ADAMW.beta2),
        eps=ADAMW.eps,
        weight_decay=ADAMW.weight_decay,
        **torch_impl(impl),
    )
    for t in range(iterations):
        for p in params:
            p.grad = torch.zeros_like(p)
        grads_for(model, t)
        torch.nn.utils.clip_grad_norm_(params, ADAMW.max_grad_norm, foreach=impl == "fused")
        if master is not params:
            for mp, p in zip(master, params, strict=True):
                mp.grad = p.grad.float()
        for group in opt.param_groups:
            group["lr"] = SCHEDULE(t)
        opt.step()
        if master is not params:
            with torch.no_grad():
                for mp, p in zip(master, params, strict=True):
                    p.copy_(mp)
    out = {"param": torch.cat([p.detach().reshape(-1) for p in params])}
    if master is not params:
        out["master"] = torch.cat([p.detach().reshape(-1) for p in master])
    for k in ("exp_avg", "exp_avg_sq"):  # before the first step there is no state: zeros
        out[k] = torch.cat(
            [
                opt.state[p][k].reshape(-1)
                if p in opt.state
                else torch.zeros(p.numel(), device=device)
                for p in master
            ]
        )
    out = {k: v.cpu() for k, v in out.items()}
    return out


def one_iteration(up: Updater, model: torch.nn.Module, t: int) -> None:
    up.begin(t)
    hooks.point("compute.backward", t)
    grads_for(model, t)
    up.protect_grads(t)
    up.sync(t)
    up.update(t)


def start(
    pool, cfg: UpdaterConfig, dtype=torch.float32, dims=DIMS
) -> tuple[PoolClient, Updater, torch.nn.Module, int]:
    """Connect as a new trainer: localize, attach, recover; returns the next iteration."""
    client = PoolClient.connect(pool.socket_path, pool.token, takeover=True)
    try:
        return _resume(client, cfg, dtype, dims)
    except BaseException:
        client.close()
        raise


def _resume(
    client: PoolClient, cfg: UpdaterConfig, dtype, dims
) -> tuple[PoolClient, Updater, torch.nn.Module, int]:
    report = client.localize()
    model = build_model(dtype, dims)
    up = Updater(client, model, SCHEDULE, cfg)
    m = up.recover(report)
    if m is None:
        up.initialize(lambda: init_params(model))
        return client, up, model, 0
    action, t = decide([m])
    if action == "finish" and m.next_iteration() == t:
        up.finish(m)
        return client, up, model, t + 1
    return client, up, model, t


def run(
    pool, iterations: int, cfg: UpdaterConfig, dtype=torch.float32, crash=None, lose=None, dims=DIMS
) -> dict[str, torch.Tensor]:
    """Train to ``iterations``; ``crash`` = (point, iteration, nth) once, then ``lose``
    (a callable taking a faultkit client) runs while no trainer is attached."""
    # The reference's hyperparameters (and the implementation the caller chose).
    cfg = dataclasses.replace(cfg, adamw=dataclasses.replace(ADAMW, impl=cfg.adamw.impl), muon=MUON)
    if crash is not None:
        hooks.arm(*crash, mode="raise")
    try:
        client, up, model, t = start(pool, cfg, dtype, dims)
        try:
            while t < iterations:
                one_iteration(up, model, t)
                t += 1
            if crash is not None:
                raise AssertionError(
                    f"crash point {crash} was never reached: the test would prove nothing"
                )
        except hooks.InjectedCrash:
            client.close()
            del client, up, model
            hooks.disarm()
            if lose is not None:
                with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
                    lose(f)
            client, up, model, t = start(pool, cfg, dtype, dims)
            while t < iterations:
                one_iteration(up, model, t)
                t += 1
        out = {k: v.to("cpu", copy=True) for k, v in up.state.flat.items()}  # before unmapping
        # Per-parameter slices of the padded layout (layers padded to units, every
        # parameter aligned to 16 bytes): concatenated like the reference's.
        slots = up.state.slots
        if cfg.layerwise:
            out = {
                k: [v[s.offset : s.offset + s.numel] for s in slots]
                for k, v in out.items()
                if k != "master"
            }
        else:
            out = {
                k: torch.cat([v[s.offset : s.offset + s.numel] for s in slots])
                for k, v in out.items()
            }
        client.close()
        return out
    finally:
        hooks.disarm()


@contextlib.contextmanager
def watched_update(up: Updater):
    """While inside: every chunk copy between the state and its undo copy (the units, in
    order; each still made) and every UPDATE marker step written, as two lists."""
    copies, steps = [], []
    real_copy, real_write = up._runs_copy, up.marker.write

    def copy(units, to_undo, hook_it=None):
        copies.append(units)
        real_copy(units, to_undo, hook_it)

    def write(state):
        if state.phase.name == "UPDATE":
            steps.append(state.step.name)
        return real_write(state)

    up._runs_copy, up.marker.write = copy, write
    try:
        yield copies, steps
    finally:
        up._runs_copy, up.marker.write = real_copy, real_write


def update_steps_without_copies(up: Updater) -> int:
    """The UPDATE marker writes of an update that copies no chunk: per group LOAD->START,
    STORE and TIER2, per chunk its commit."""
    n_chunks = sum(len(up.state.chunks(gi)) for gi in range(len(up.groups)))
    return n_chunks + 3 * len(up.groups)
