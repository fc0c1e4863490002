"""A run-ahead shadow's first forward and backward, at the script's own shapes (issue 57).

A process's first forward and backward on a GPU loads the kernels those shapes pick
(GEMM tiles, attention, reductions), asks cuBLAS(Lt) for its heuristics and grows the
caching allocator — on a promoted trainer's critical path (docs/benchmarks.md, "Recovery
as the user lives it", has what it cost and what this saves). The parked shadow's
generic warm-up (``leto.trainer.warmup.generic_step``) runs a stand-in; a shadow that ran
the script's set-up ahead (``leto.trainer.run_ahead``) holds the script's model itself, so
before it waits for its promotion it runs that model once on throwaway inputs shaped as
the active trainer's first forward had them.

* The active trainer (``Recorder``): ``leto.Run``'s model's first forward call, its
  arguments' shapes, dtypes and devices, the autocast state around it; after the first
  iteration, the device memory that iteration needed above the model (its peak less
  what was allocated at that forward). Published in the store per rank
  (``keys.shape_warmup``); or why not: a model that is not data parallel over the whole
  world (its forward talks to other ranks), a compiled one, an argument that is neither a
  tensor nor a plain value.
* The shadow (``warm``): finds that model among the script's variables (the frames that
  called ``leto.Run``, or whatever step awaited the promotion first), checks the device
  has room for the iteration's peak (where it has not, runs a fraction of the batch that
  fits: ``fraction``), runs forward (under the recorded autocast) and
  backward on zero-filled inputs, then puts back what it touched: the gradients
  (``None`` again), the buffers' values, the random generators' states; the caching
  allocator's blocks are released (holding them would double the activation memory on
  the device while the live trainer runs). Anything that would reach outside the
  process — a collective, a file written, a subprocess (``run_ahead``'s audit) — stops
  the warm-up there, said in the rank log, before it happens; the promotion goes on.

What the script computes outside the model (its loss on the logits, the clip, the
optimizer's step) is not run: their kernels are few and the optimizer's is Leto's.

On by default on a GPU; on the CPU nothing is loaded lazily, so there it runs only with
``LETO_SHAPE_WARMUP=1`` (the tests); ``LETO_SHAPE_WARMUP=0`` turns it off.

Not covered: a forward that changes the model's Python attributes (a step counter kept
in an ``int``); arguments of other types (dataclasses, custom batches) — not recorded,
no warm-up; per-sample shapes that vary between iterations (the first one's are used).
"""

from __future__ import annotations

import gc
import json
import os
import time

import torch

from leto import rank_log
from leto.job import keys

ENV_SHAPE_WARMUP = "LETO_SHAPE_WARMUP"
GiB = 1 << 30
MARGIN_BYTES = 1 * GiB  # beside the iteration's recorded peak: the allocator's rounding


class NotHere(Exception):
    """The warm-up reached something that would act outside this process."""


def enabled(device: torch.device) -> bool:
    v = os.environ.get(ENV_SHAPE_WARMUP)
    if v is not None:
        return v != "0"
    return device.type == "cuda"


# -- the active trainer's side ---------------------------------------------------------


def _encode(v, where: str):
    """A JSON description of a forward argument; raises ValueError for what is not
    recorded."""
    if isinstance(v, torch.Tensor):
        return {
            "t": list(v.shape),
            "dtype": str(v.dtype).removeprefix("torch."),
            "device": v.device.type,
            "grad": bool(v.requires_grad),
        }
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"v": v}
    if isinstance(v, (list, tuple)):
        return {
            "l": [_encode(x, f"{where}[{i}]") for i, x in enumerate(v)],
            "tuple": isinstance(v, tuple),
        }
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"d": {k: _encode(x, f"{where}[{k!r}]") for k, x in v.items()}}
    raise ValueError(f"the forward's {where} is a {type(v).__name__}")


def _decode(spec, device: torch.device, div: int = 1):
    """The arguments ``spec`` describes, zero-filled; ``div``: the leading (batch) size of
    every tensor divided by it (``fraction``)."""
    if "t" in spec:
        dtype = getattr(torch, spec["dtype"])
        shape = [spec["t"][0] // div, *spec["t"][1:]] if div > 1 else spec["t"]
        t = torch.zeros(shape, dtype=dtype, device=device if spec["device"] != "cpu" else "cpu")
        return t.requires_grad_() if spec["grad"] and t.is_floating_point() else t
    if "v" in spec:
        return spec["v"]
    if "l" in spec:
        items = [_decode(x, device, div) for x in spec["l"]]
        return tuple(items) if spec["tuple"] else items
    return {k: _decode(x, device, div) for k, x in spec["d"].items()}


def _leading(spec, sizes: set) -> None:
    if "t" in spec:
        sizes.add(spec["t"][0] if spec["t"] else None)
    for x in spec.get("l", ()):
        _leading(x, sizes)
    for x in spec.get("d", {}).values():
        _leading(x, sizes)


def fraction(spec: dict, free: int) -> int | None:
    """The smallest power of two ``div`` such that the iteration's recorded peak over
    ``div``, and the margin, fit in ``free`` device bytes — dividing the leading size every
    tensor argument shares (the batch, where the script puts it first) — or None: no
    such size, or even the smallest batch would not fit. 1 where the whole one fits.
    A fraction of the batch runs the same kernels but for the rows of its matrix
    products, and grows the allocator part of the way: beside a live trainer on an
    80 GB card at 1 B, most of the head start is still there (the whole needed 33.5 GiB
    where 16.2 GiB were free)."""
    peak = spec["peak_bytes"]
    if free >= peak + MARGIN_BYTES:
        return 1
    sizes: set = set()
    _leading(spec["args"], sizes)
    _leading(spec["kwargs"], sizes)
    batch = sizes.pop() if len(sizes) == 1 else None
    div = 1
    while batch and batch % (2 * div) == 0 and free < peak // div + MARGIN_BYTES:
        div *= 2
    return div if div > 1 and free >= peak // div + MARGIN_BYTES else None


def qualname(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


class Recorder:
    """In an active trainer: the model's first forward call, published after the first
    iteration (``done``)."""

    def __init__(
        self, model: torch.nn.Module, store, rank: int, device: torch.device, why_not=None
    ):
        self.store, self.rank, self.device = store, rank, device
        self.spec: dict | None = None
        self.why_not: str | None = why_not
        self._handle = None
        if why_not is None and "OptimizedModule" in type(model).__name__:
            self.why_not = "the model is compiled (torch.compile)"
        if self.why_not is None:
            self.module = qualname(model)
            self._handle = model.register_forward_pre_hook(self._first, with_kwargs=True)

    def _first(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            return None  # (traced by Dynamo: not this call's Python values)
        self._handle.remove()
        dt = self.device.type
        try:
            self.spec = {
                "module": self.module,
                "args": _encode(tuple(args), "arguments"),
                "kwargs": _encode(dict(kwargs), "keyword arguments"),
                "autocast": torch.is_autocast_enabled(dt),
                "autocast_dtype": str(torch.get_autocast_dtype(dt)).removeprefix("torch."),
                "grad": torch.is_grad_enabled(),
                "allocated": torch.cuda.memory_allocated(self.device) if dt == "cuda" else 0,
            }
        except ValueError as e:
            self.why_not = str(e)
        return None

    def done(self) -> None:
        """The first iteration is over: publish what a shadow needs, or why not."""
        if self.store is None:
            return
        if self.spec is None and self.why_not is None:
            self.why_not = "the model's forward was not called in the first iteration"
        if self.why_not is not None:
            if self._handle is not None:
                self._handle.remove()
            value = {"why_not": self.why_not}
        else:
            peak = 0
            if self.device.type == "cuda":
                # (the process's peak so far: an upper bound of the iteration's)
                peak = torch.cuda.max_memory_allocated(self.device) - self.spec["allocated"]
            value = {**self.spec, "peak_bytes": max(peak, 0)}
        self.store.set(keys.shape_warmup(self.rank), json.dumps(value))


# -- the shadow's side ------------------------------------------------------------------


def find_module(name: str, frame) -> torch.nn.Module | None:
    """The script's model: a variable of the calling frames holding a module of class
    ``name`` (innermost frame first; a wrapper's ``.module`` too)."""
    while frame is not None:
        for v in list(frame.f_locals.values()):
            if isinstance(v, torch.nn.Module):
                if qualname(v) == name:
                    return v
                inner = getattr(v, "module", None)
                if isinstance(inner, torch.nn.Module) and qualname(inner) == name:
                    return inner
        frame = frame.f_back
    return None


def _loss(out):
    """What the backward starts from: the first scalar floating tensor that needs a
    gradient (a loss), else the sum of every output that needs one."""
    found = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            if v.requires_grad and v.is_floating_point():
                found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(out)
    for t in found:
        if t.ndim == 0:
            return t
    return sum(t.float().sum() for t in found) if found else None


class Warming:
    """While the warm-up runs: ``run_ahead``'s audit and collectives raise ``NotHere``."""

    active = False


def warm(store, rank: int, device: torch.device, frame, promoting=lambda: False) -> dict:
    """Run the script's model once at its trainer's shapes; returns timings (and why
    not, when it did not). ``promoting()``: the promotion is waiting — no warm-up, or
    none of its backward (the recovery must not wait for a head start)."""
    if not enabled(device) or promoting():
        return {}
    key = keys.shape_warmup(rank)
    if store is None or not store.check([key]):
        return _said(rank, "its trainer published no shapes yet")
    spec = json.loads(store.get(key))
    if "why_not" in spec:
        return _said(rank, spec["why_not"])
    model = find_module(spec["module"], frame)
    if model is None:
        return _said(rank, f"no {spec['module']} among the script's variables here")
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        # A script's prepare= skeleton: its values come only when leto.Run binds the
        # retained state, after the promotion. Running it would only raise.
        return _said(
            rank,
            "its model is on the meta device until leto.Run binds the retained state; "
            "leto.init's warmup= is what warms such a script",
        )
    cuda = device.type == "cuda"
    div = 1
    if cuda:
        free = torch.cuda.mem_get_info(device)[0]
        div = fraction(spec, free)
        if div is None:
            need = spec["peak_bytes"] + MARGIN_BYTES
            return _said(
                rank,
                f"device free memory {free / GiB:.1f} GiB is below the {need / GiB:.1f} GiB "
                f"its trainer's first iteration needed, and no fraction of its batch fits",
            )
    t0 = time.time()
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    failed = None
    Warming.active = True
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            args = _decode(spec["args"], device, div)
            kwargs = _decode(spec["kwargs"], device, div)
            with (
                torch.enable_grad(),
                torch.autocast(
                    device.type,
                    dtype=getattr(torch, spec["autocast_dtype"]),
                    enabled=spec["autocast"],
                ),
            ):
                out = model(*args, **kwargs)
            loss = _loss(out)
            if promoting():
                raise NotHere("the promotion came after its forward")
            if loss is not None:
                loss.backward()
            del out, loss, args, kwargs
            if cuda:
                torch.cuda.synchronize(device)
    except NotHere as e:
        failed = str(e)
    except Exception as e:  # the script's model on made-up inputs: only the head start
        failed = f"{type(e).__name__}: {e}"
    finally:
        Warming.active = False
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
        del buffers
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    took = time.time() - t0
    if failed is not None:
        return _said(rank, f"stopped: {failed}", shape_warmup_s=took)
    part = f", 1/{div} of its batch (the room beside the live trainer)" if div > 1 else ""
    rank_log.say(
        rank,
        f"shadow: ran the script's model forward and backward at its trainer's shapes{part} "
        f"in {took:.2f} s ({ENV_SHAPE_WARMUP}=0 turns it off)",
    )
    return {"shape_warmup_s": took, "shape_warmup_batch_div": div}


def _said(rank: int, why: str, **timings) -> dict:
    rank_log.say(rank, f"shadow: no warm-up at the script's shapes ({why})")
    return {"shape_warmup_not": why, **timings}


def refuse(what: str) -> None:
    """Called by ``run_ahead`` where the running-ahead set-up would await the promotion:
    inside the warm-up, stop instead."""
    if Warming.active:
        raise NotHere(f"the model's forward or backward {what}")
