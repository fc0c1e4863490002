"""A promoted trainer does not initialize parameters the pool is about to overwrite.

Runs in a promoted trainer, from ``leto.init()``'s return until ``leto.Run`` binds the
model (or its first heartbeat). A script builds its model after ``leto.init()`` as it
always does — ``GPT().to(device)``: every weight drawn at random on the CPU, then copied
to the GPU, 8.6 s of a 1.1 B model's recovery on the H200 (issue 57) — and ``leto.Run``
then makes every parameter a view of the retained state, so none of those values is
ever read. While this mode is on:

* ``torch.nn.init``'s functions on an ``nn.Parameter``, and an in-place write to one
  (``normal_``, ``uniform_``, ``fill_``, ``zero_``, ``copy_`` — a loaded checkpoint's
  values, which the retained state replaces too), are skipped;
* ``param.to(device)`` / ``param.cuda()`` to another device or dtype gives an
  uninitialized tensor there instead of a copy.

Everything else runs as written: buffers (a causal mask, rotary tables) are computed, a
flag like ``requires_grad_`` is set, random numbers drawn outside parameters are drawn
(the generators' states are the retained ones again when the loop starts).

Skipping a random fill leaves torch's global generators where they were, so whatever
the script draws from them afterwards (a synthetic dataset, a shuffle without its own
generator) would differ. So the active trainer *observes* the same window with the same
mode, skipping nothing: a draw from a global generator after a parameter's random
initialization marks the script unsafe, and its rank's promoted trainers then
initialize as written (the rank log and the store, ``leto/rank<r>/skip_init``, say
why). A promoted trainer skips only when the pool holds this rank's retained state for
certain — the failed generation of this rank began an iteration (its pace is in the
store), so its ``leto.Run`` had bound and protected the state — and the active trainer
found the window safe. A first start, a restart from a checkpoint, and a promotion
after a failure before any iteration initialize as written. ``LETO_SKIP_INIT=0`` turns
it off.

Not covered: a script that computes something other than a parameter from a
parameter's value before ``leto.Run`` (a buffer copied from a weight, say): with this
on it computes it from uninitialized memory — set ``LETO_SKIP_INIT=0``.
"""

from __future__ import annotations

import os

import torch
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)

from leto.job import keys

ENV_SKIP_INIT = "LETO_SKIP_INIT"

# In-place writes whose values the retained state replaces (what nn.init and a state
# dict's load do to a parameter).
WRITES = frozenset(
    """normal_ uniform_ log_normal_ exponential_ geometric_ cauchy_ random_ bernoulli_
    fill_ zero_ copy_ mul_ div_ add_ sub_ clamp_ clamp_min_ clamp_max_ erfinv_ addcmul_
    addcdiv_ masked_fill_ index_fill_ fill_diagonal_""".split()
)


# Ops that draw from a generator (torch's global ones unless given ``generator=``).
RANDOM = frozenset(
    """rand randn randint randperm rand_like randn_like randint_like normal bernoulli
    multinomial poisson dropout dropout_ feature_dropout alpha_dropout native_dropout
    random_ uniform_ normal_ bernoulli_ exponential_ geometric_ cauchy_ log_normal_""".split()
)


class SkipInit(TorchFunctionMode):
    """``observe=True``: skip nothing, only find whether skipping would be safe."""

    def __init__(self, observe: bool = False):
        super().__init__()
        self.observe = observe
        self.skipped = 0  # in-place writes to parameters not run
        self.moved = 0  # parameters given an uninitialized tensor on another device
        self.filled = False  # a parameter was initialized at random
        self.unsafe: str | None = None  # the first global draw after that, if any

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # (nn.init's functions come here once, their tensor as a keyword; what they call
        # inside is not seen again)
        if getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.nn.Parameter):
                self.filled |= name not in ("ones_", "zeros_", "constant_", "eye_", "dirac_")
                if not self.observe:
                    self.skipped += 1
                    return target
            else:
                self._draw(name, kwargs)
            return func(*args, **kwargs)
        param = bool(args) and isinstance(args[0], torch.nn.Parameter)
        if param and name in RANDOM:
            self.filled = True
        elif name in RANDOM:
            self._draw(name, kwargs)
        if self.observe:
            return func(*args, **kwargs)
        if param:
            if name in WRITES:
                self.skipped += 1
                return args[0]
            if name in ("to", "cuda"):
                moved = _moved(name, args[0], args[1:], kwargs)
                if moved is not None:
                    self.moved += 1
                    return moved
        return func(*args, **kwargs)

    def _draw(self, name: str, kwargs: dict) -> None:
        """A draw not for a parameter: from a global generator after a parameter's
        random initialization, it would differ were that initialization skipped."""
        if self.filled and self.unsafe is None and kwargs.get("generator") is None:
            self.unsafe = (
                f"{name}() drew from torch's global generator after the model's initialization"
            )


def _moved(name: str, p: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The uninitialized tensor ``p.to(...)`` / ``p.cuda(...)`` would have copied into,
    or None where it would not move ``p`` (same device and dtype)."""
    if name == "cuda":
        dev = args[0] if args else kwargs.get("device")
        device = torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev or "cuda")
        dtype = p.dtype
    else:
        if any(isinstance(a, torch.Tensor) for a in args) or "other" in kwargs:
            return None  # p.to(other): rare for a parameter; run as written
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        device = device or p.device
        dtype = dtype or p.dtype
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device == p.device and dtype == p.dtype:
        return None
    return torch.empty(p.shape, dtype=dtype, device=device)


SAFE = "safe"


def observe() -> SkipInit | None:
    """In an active trainer: watch the script's set-up, skipping nothing."""
    if os.environ.get(ENV_SKIP_INIT, "1") == "0":
        return None
    mode = SkipInit(observe=True)
    _push_mode(mode)
    return mode


def mark_unsafe(mode: SkipInit | None, why: str) -> None:
    """What the observed set-up's verdict must say although the script drew nothing: a
    parameter the retained state does not restore (``why``), which a promoted trainer
    must initialize as written."""
    if mode is not None and mode.observe and mode.unsafe is None:
        mode.unsafe = why


def publish(store, rank: int, mode: SkipInit) -> str:
    """What an observed set-up showed, for this rank's promoted trainers; returns it."""
    verdict = mode.unsafe or SAFE
    if store is not None:
        store.set(keys.skip_init(rank), verdict)
    return verdict


def retained_for_certain(store, generation: int, rank: int) -> bool:
    """Whether the previous generation of this rank bound and protected its state (it
    began an iteration: its pace is in the store)."""
    return generation > 0 and store is not None and store.check([keys.pace(generation - 1, rank)])


def start(store, generation: int, rank: int) -> SkipInit | None:
    """Turn the mode on in a promoted trainer whose pool holds its retained state."""
    if os.environ.get(ENV_SKIP_INIT, "1") == "0" or not retained_for_certain(
        store, generation, rank
    ):
        return None
    key = keys.skip_init(rank)
    if not store.check([key]) or store.get(key).decode() != SAFE:
        return None  # the active trainer's set-up drew after its initialization, or unseen
    mode = SkipInit()
    _push_mode(mode)
    return mode


def resume(mode: SkipInit) -> None:
    """Turn a stopped mode on again (an observation paused over ``leto.Run``)."""
    if mode not in _get_current_function_mode_stack():
        _push_mode(mode)


def stop(mode: SkipInit | None) -> None:
    """Turn it off, wherever it stands in the mode stack (a ``with device:`` the script
    opened after it may still be open)."""
    if mode is None or mode not in _get_current_function_mode_stack():
        return
    above = []
    while (m := _pop_mode()) is not mode:
        above.append(m)
    for m in reversed(above):
        _push_mode(m)
