"""The user's own ``torch.optim`` optimizer, run by the updater on pieces of retained state.

Runs in the trainer. A script keeps its optimizer object (``torch.optim.AdamW`` with
its parameter groups, an LR scheduler driving it) and calls ``optimizer.step()``; Leto
reads the optimizer's per-group hyperparameters at that moment and runs the same torch
functional the optimizer's own ``step`` would (``torch.optim.adamw.adamw``,
``adam.adam``, ``sgd.sgd``) — with the group's ``fused``/``foreach`` choice, defaults
resolved by torch itself — on the pieces of each chunk, so the arithmetic is exactly
the optimizer's. Element-wise optimizers give the same bits on a piece as on the whole
tensor (pieces start at multiples of ``CUT_ELEMS`` from a parameter's start, for the CPU
kernels' vector body; see ``leto.update.optim``).

The optimizer's state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``)
lives in retained memory; ``optimizer.state`` holds views of it, so the user's
``optimizer.state_dict()`` sees the retained values.

Supported: ``AdamW`` and ``Adam`` (fused, foreach or single-tensor; no ``amsgrad``, no
``maximize``, no ``capturable``/``differentiable``), ``SGD`` with or without momentum
(dampening, Nesterov, weight decay), and ``Muon`` (its 2-D parameters are updated whole:
the updater gives each its own chunk), beside another optimizer for the rest as Muon
scripts do. Any number of parameter groups with their own hyperparameters, across any
number of optimizers (each parameter in exactly one). Anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim._muon import muon
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from leto.errors import InvalidInput

SUPPORTED = (
    "torch.optim.AdamW, torch.optim.Adam (fused, foreach or single-tensor) and torch.optim.SGD"
)
# Per-group keys that change the arithmetic; read at every step (a scheduler or the
# script may change any of them).
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
_ADAM_OFF = ("amsgrad", "maximize", "capturable", "differentiable")
_SGD_OFF = ("maximize", "differentiable")
_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
              "adjust_lr_fn")  # fmt: skip


@dataclass(frozen=True)
class OptimizerKind:
    name: str  # "adamw", "adam" or "sgd"
    states: tuple[str, ...]  # retained state tensors, as the layout names them

    @property
    def keys(self) -> tuple[str, ...]:
        return {"sgd": _SGD_KEYS, "muon": _MUON_KEYS}.get(self.name, _ADAM_KEYS)

    @property
    def layerwise(self) -> bool:
        """Whether a parameter is updated whole (never cut into pieces)."""
        return self.name == "muon"


ADAMW = OptimizerKind("adamw", ("exp_avg", "exp_avg_sq"))
ADAM = OptimizerKind("adam", ("exp_avg", "exp_avg_sq"))
SGD = OptimizerKind("sgd", ("exp_avg",))  # the momentum buffer, in the exp_avg tensors
MUON = OptimizerKind("muon", ("exp_avg",))  # its momentum buffer, likewise


def kind_of(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    t = type(optimizer)
    if t is torch.optim.AdamW:
        return ADAMW
    if t is torch.optim.Adam:
        if any(g.get("decoupled_weight_decay") for g in optimizer.param_groups):
            return ADAMW  # Adam(decoupled_weight_decay=True) is AdamW's arithmetic
        return ADAM
    if t is torch.optim.SGD:
        return SGD
    if t is torch.optim.Muon:
        return MUON
    raise InvalidInput(
        f"optimizer {t.__module__}.{t.__qualname__} is not supported by Leto; supported: "
        f"{SUPPORTED}"
    )


class UserOptimizer:
    """The bridge between the script's torch optimizer(s) and the updater's chunks. The
    parameter groups of every optimizer, in order, are numbered globally: ``groups[g]``
    is (optimizer, its group) and ``group_of[name]`` the number of a parameter's."""

    def __init__(self, optimizer, names: dict[int, str]):
        """``optimizer``: one torch optimizer or a list; ``names``: id(parameter) ->
        the model's parameter name, for every parameter the model has (the optimizers
        may hold a subset; the rest are never updated)."""
        opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if not opts:
            raise InvalidInput("no optimizer given")
        self.optimizers = opts
        self.names = names
        self.kinds = [kind_of(o) for o in opts]
        self.groups: list[tuple[int, dict]] = []  # (optimizer index, its param group)
        self.group_of: dict[str, int] = {}
        for oi, (opt, kind) in enumerate(zip(opts, self.kinds, strict=True)):
            off = _SGD_OFF if kind is SGD else () if kind is MUON else _ADAM_OFF
            for li, group in enumerate(opt.param_groups):
                g = len(self.groups)
                self.groups.append((oi, group))
                where = f"optimizer {oi} ({type(opt).__name__}) parameter group {li}"
                for key in off:
                    if group.get(key):
                        raise InvalidInput(
                            f"{where} sets {key}=True; Leto supports {SUPPORTED} without "
                            f"{', '.join(off)}"
                        )
                for p in group["params"]:
                    name = names.get(id(p))
                    if name is None:
                        raise InvalidInput(
                            f"{where} holds a tensor of shape {tuple(p.shape)} that is not a "
                            f"parameter of the model"
                        )
                    if name in self.group_of:
                        raise InvalidInput(f"parameter {name} is in two optimizer parameter groups")
                    if kind is MUON and p.ndim != 2:
                        raise InvalidInput(
                            f"{where}: Muon takes 2-D parameters, {name} is {p.ndim}-D"
                        )
                    self.group_of[name] = g
        # State the script loaded before handing the optimizers to Leto (its own
        # checkpoint: optimizer.load_state_dict): copied into retained memory on a
        # fresh pool (``loaded``: name -> state, ``loaded_steps``: per optimizer).
        self.loaded: dict[str, dict] = {}
        self.loaded_steps: list[int | None] = [None] * len(opts)
        want = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq")}
        for oi, (opt, kind) in enumerate(zip(opts, self.kinds, strict=True)):
            for p, st in opt.state.items():
                name = names.get(id(p))
                keys = want.get(kind.name, ("momentum_buffer",))
                missing = [k for k in keys if k not in st]
                if name is None or missing:
                    raise InvalidInput(
                        f"optimizer {oi}'s state for {name or 'a tensor not in the model'} "
                        f"lacks {missing or 'a parameter'}; nothing was retained"
                    )
                self.loaded[name] = {
                    k: (None if st[k] is None else st[k].detach().clone()) for k in keys
                }
                if "step" in st:
                    self.loaded_steps[oi] = int(float(st["step"]))
            opt.state.clear()  # Leto owns the state from here

    def layerwise(self, name: str) -> bool:
        """Whether parameter ``name`` is updated whole (a Muon parameter)."""
        g = self.group_of.get(name)
        return g is not None and self.kinds[self.groups[g][0]].layerwise

    def adopt(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Point the optimizer's groups at the retained parameters (``RetainedModel.bind``
        replaced the model's), so its ``state`` and ``state_dict`` use them."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["params"] = [params[self.names[id(p)]] for p in group["params"]]

    # -- hyperparameters ------------------------------------------------------------

    def hparams(self) -> list[dict]:
        """Each group's hyperparameters now (plain floats/tuples: they are retained)."""
        out = []
        for oi, group in self.groups:
            h = {}
            for k in self.kinds[oi].keys:
                v = group[k]
                if isinstance(v, torch.Tensor) or (
                    k == "betas" and any(isinstance(x, torch.Tensor) for x in v)
                ):
                    raise InvalidInput(
                        f"optimizer parameter group {len(out)}: {k} is a tensor; Leto "
                        f"supports plain float hyperparameters"
                    )
                h[k] = tuple(float(x) for x in v) if k in ("betas", "ns_coefficients") else v
            out.append(h)
        return out

    # -- the step on pieces ---------------------------------------------------------

    def step(
        self,
        hparams: list[dict],
        step,
        groups: list[int],
        views: dict[str, list[torch.Tensor]],
        grads: list[torch.Tensor],
        skip: frozenset = frozenset(),
    ) -> None:
        """One step in place, on pieces: ``step`` is the step number (from 1; a list:
        per optimizer), ``groups[i]`` the parameter group of piece i, ``views`` its
        retained tensors by name ("param", the state tensors, optionally "master"),
        ``grads[i]`` its gradient. One functional call per parameter group, as the
        optimizer's own ``step`` makes; the groups of optimizers in ``skip`` (steps a
        GradScaler skipped) are left as they are."""
        for gi in sorted(set(groups)):
            oi = self.groups[gi][0]
            if oi in skip:
                continue
            st = step[oi] if isinstance(step, list) else step
            idx = [i for i, g in enumerate(groups) if g == gi]
            pick = {n: [v[i] for i in idx] for n, v in views.items()}
            master = pick.get("master")
            params = master if master is not None else pick["param"]
            gs = [grads[i] for i in idx]
            if master is not None:
                gs = [g.float() for g in gs]  # the fp32 master takes the gradient in fp32
            group = self.groups[gi][1]
            self._functional(self.kinds[oi], group, hparams[gi], st, params, gs, pick)
            if master is not None:
                torch._foreach_copy_(pick["param"], master)

    def _functional(self, kind, group, h, step, params, grads, pick) -> None:
        fused, foreach = group.get("fused"), group.get("foreach")
        if kind is MUON:
            # Whole 2-D parameters (the updater never cuts a layer-wise one).
            muon(
                params,
                grads,
                pick["exp_avg"],
                lr=h["lr"],
                weight_decay=h["weight_decay"],
                momentum=h["momentum"],
                nesterov=h["nesterov"],
                ns_coefficients=h["ns_coefficients"],
                ns_steps=h["ns_steps"],
                eps=h["eps"],
                adjust_lr_fn=h["adjust_lr_fn"],
                has_complex=False,
            )
            return
        if kind is SGD:
            # torch's SGD makes the momentum buffer a clone of the first gradient; Leto's
            # is retained (zeros before the first step), so the first step passes None
            # and copies the buffer torch made into it.
            bufs = pick["exp_avg"]
            first = step == 1 and h["momentum"] != 0
            mlist = [None] * len(bufs) if first else list(bufs)
            sgd(
                params,
                grads,
                mlist,
                foreach=foreach,
                fused=fused,
                weight_decay=h["weight_decay"],
                momentum=h["momentum"],
                lr=h["lr"],
                dampening=h["dampening"],
                nesterov=h["nesterov"],
                maximize=False,
            )
            if first:
                torch._foreach_copy_(bufs, mlist)
            return
        if fused:
            # The kernel behind the functional's fused path, called directly: the
            # functional's per-call grouping and checks cost more host time than the
            # kernel on a GPU chunk (its pieces share one device and dtype already). The
            # step count is the optimizer's float32 on the device, already incremented.
            steps = list(torch.full((len(params),), float(step), dtype=torch.float32,
                                    device=params[0].device))  # fmt: skip
            kernel = torch._fused_adamw_ if kind is ADAMW else torch._fused_adam_
            kernel(
                params,
                grads,
                pick["exp_avg"],
                pick["exp_avg_sq"],
                [],
                steps,
                amsgrad=False,
                lr=h["lr"],
                beta1=h["betas"][0],
                beta2=h["betas"][1],
                weight_decay=h["weight_decay"],
                eps=h["eps"],
                maximize=False,
            )
            return
        # The step count as the optimizer keeps it: float32 on the CPU; the functional
        # increments it first. One fill for all pieces; views, so the in-place increment
        # counts each piece once.
        steps = list(torch.full((len(params),), float(step - 1), dtype=torch.float32))
        fn = adamw if kind is ADAMW else adam
        fn(
            params,
            grads,
            pick["exp_avg"],
            pick["exp_avg_sq"],
            [],
            steps,
            foreach=foreach,
            fused=fused,
            amsgrad=False,
            beta1=h["betas"][0],
            beta2=h["betas"][1],
            lr=h["lr"],
            weight_decay=h["weight_decay"],
            eps=h["eps"],
            maximize=False,
        )

    # -- the optimizer's view of retained state -------------------------------------

    def expose_state(self, params: dict[str, torch.nn.Parameter], views, step) -> None:
        """Fill ``optimizer.state`` with views of the retained state (after ``step``
        updates), so ``state_dict()`` reports it. ``views(name, state) -> tensor``."""
        for opt in self.optimizers:
            opt.state.clear()
        for name, gi in self.group_of.items():
            p = params[name]
            oi, group = self.groups[gi]
            n = step[oi] if isinstance(step, list) else step
            if n <= 0:
                continue
            kind, opt = self.kinds[oi], self.optimizers[oi]
            st = {}
            if kind is MUON:
                st["momentum_buffer"] = views(name, "exp_avg")
            elif kind is SGD:
                if group["momentum"] != 0:
                    st["momentum_buffer"] = views(name, "exp_avg")
                else:
                    st["momentum_buffer"] = None
            else:
                fused = group.get("fused")
                dev = p.device if fused else torch.device("cpu")
                st["step"] = torch.tensor(float(n), dtype=torch.float32, device=dev)
                st["exp_avg"] = views(name, "exp_avg")
                st["exp_avg_sq"] = views(name, "exp_avg_sq")
            opt.state[p] = st
