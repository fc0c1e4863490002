"""Injection points: named places in the trainer where faultkit can stop a process.

Runs in the trainer (and, for page loss, the agent). Leto calls ``leto.plugins.point``
at its named places; this module plugs into that seam when it is imported (a trainer
imports it because ``LETO_PLUGINS`` names it: ``faultkit.job`` sets that, and ``leto
run`` does for a fault plan) — Leto never imports faultkit. A fault is armed by the environment variable ``LETO_FAULT_AT`` (set by faultkit
or a test for the process it starts) as ``NAME@ITERATION`` or ``NAME@ITERATION#N`` (the
N-th time that point is reached in that iteration, from 1), or in-process by ``arm``.
Mode ``kill`` (the default from the environment) is SIGKILL of this process, the most
faithful crash: nothing runs after it. Mode ``raise`` throws ``InjectedCrash`` (for
in-process state-machine tests that then discard every non-retained object).

Mode ``kill-synced`` waits for the device to finish the work queued before the point,
then SIGKILLs: the failure lands where the point is on the GPU too (plain ``kill`` comes
as the host reaches the point, and the GPU may be an update chunk or more behind).

Mode ``copy-corrupt`` (``LETO_FAULT_MODE``) fills the destination of the copy in
progress at the point with random bytes, then SIGKILLs: only points that pass ``dest``
(the parity copies) support it.

Mode ``corrupt:TARGET:K[:GROUP]`` flips one bit in each of K pages of this trainer's
retained state and lets it run on — silent corruption, no unmap, no death: TARGET
``data`` (device pages of state group GROUP, default 0, -1 the last: parameters,
optimizer state) or ``tier1`` / ``tier2`` (its host parity pages). Each page's bit sits in a different codeword, so
the scrub can locate every one. TARGET ``computed``, armed at ``leto.plugins.SDC_POINT``
(``update.computed``), flips one bit in the chunk's freshly computed values before its
parity absorbs them (or, after the fused chunk pass, folded into the parity it
absorbed them into): a wrong computation, which parity agrees with and the scrub cannot
see (faultkit's ``sdc-update``); armed at
``leto.plugins.SDC_GRAD_POINT`` it flips a bit of the local gradient before its
all-reduce (``sdc-grad``). TARGET ``activation``, armed at ``compute.forward``, flips one
bit of the output of the model's first ``nn.Linear`` in that forward (``sdc-activation``).
The gradient's and the activation's flip is an element's top mantissa bit (a value off by
up to half of it; a lowest bit often vanishes in the all-reduce's rounding). What was flipped goes to the abort log
(``LETO_TRIPWIRE_LOG``); whether and how Leto noticed is the verdict's business.

``LETO_FAULT_WHEN=parked`` (a fault plan's ``when``; ``arm(..., when="parked")``): at
the point, before anything else, the trainer waits until every rank's shadow of the next
generation has parked (``leto.plugins.wait_parked``, within the job's wait limit; past
it, a line says so and the fault strikes anyway) — the state a failure meets in a job
that has run a while, where a fault a few iterations after a recovery would otherwise
meet a shadow still starting (a cold promotion).

Mode ``kernel-abort`` arms the trip-wire (``nvbit_tools.tripwire``) instead: the next
of Leto's own kernels (codec, parity copy, optimizer landing) stops after
``LETO_TRIPWIRE_BLOCKS`` blocks (default 3) and the process is SIGKILLed with it in
flight. Mode ``hang`` SIGSTOPs the process (only a monitor notices).
"""

from __future__ import annotations

import os
import signal
import sys

from leto import plugins
from leto.plugins import ONCE_PER_ITERATION, POINTS

ENV_FAULT_AT = "LETO_FAULT_AT"
ENV_FAULT_MODE = "LETO_FAULT_MODE"  # kill (default), kill-synced, copy-corrupt, ...
ENV_FAULT_WHEN = "LETO_FAULT_WHEN"  # now (default) or parked
WHEN = ("now", "parked")
MODES = ("raise", "kill", "kill-synced", "copy-corrupt", "kernel-abort", "hang", "corrupt")
CORRUPT_TARGETS = ("data", "tier1", "tier2", "computed", "activation")

__all__ = ["ONCE_PER_ITERATION", "POINTS", "arm", "disarm", "parse", "point", "record"]


class InjectedCrash(Exception):
    """Raised at an armed point in ``raise`` mode."""


_armed: tuple[str, int, int, str] | None = None
_when = "now"
_hits: dict[tuple[str, int], int] = {}
_seen: list[str] = []  # every point name reached, when recording (for coverage tests)
_recording = False


def parse(spec: str) -> tuple[str, int, int]:
    try:
        name, rest = spec.split("@", 1)
        it, _, nth = rest.partition("#")
        return name, int(it), int(nth or 1)
    except ValueError:
        raise ValueError(
            f"{ENV_FAULT_AT}={spec!r}: expected NAME@ITERATION or NAME@ITERATION#N"
        ) from None


def arm(name: str, iteration: int, nth: int = 1, mode: str = "raise", when: str = "now") -> None:
    global _armed, _when
    if mode.split(":")[0] not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(MODES)}")
    if when not in WHEN:
        raise ValueError(f"when={when!r}: use one of {', '.join(WHEN)}")
    _when = when
    if mode.startswith("corrupt"):
        corrupt_spec(mode)  # refused now, not at the point
    _armed = (name, iteration, nth, mode)
    _hits.clear()


def disarm() -> None:
    global _armed, _when
    _armed, _when = None, "now"
    _hits.clear()


def record(on: bool = True) -> list[str]:
    """Start (or stop) recording reached point names; returns the list being filled."""
    global _recording
    _recording = on
    _seen.clear()
    return _seen


def point(name: str, iteration: int, dest=None) -> None:
    """``dest``: the tensors a copy in progress here writes (copy-corrupt mode fills
    them with random bytes, then kills: a torn, garbled copy)."""
    if _recording:
        _seen.append(name)
    if _armed is None:
        return
    want, it, nth, mode = _armed
    if name != want or iteration != it:
        return
    key = (name, iteration)
    _hits[key] = _hits.get(key, 0) + 1
    if _hits[key] != nth:
        return
    if _when == "parked" and plugins.wait_parked() is False:
        print(f"faultkit: {name}@{iteration}#{nth}: the next generation's shadows did not "
              "all park within the job's wait limit; striking anyway", file=sys.stderr,
              flush=True)  # fmt: skip
    if mode == "copy-corrupt":
        if dest is None:
            raise InjectedCrash(f"{name} copies nothing: copy-corrupt needs a copy's point")
        _corrupt(dest)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill-synced":
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kernel-abort":
        from nvbit_tools import tripwire

        blocks = int(os.environ.get(tripwire.ENV_BLOCKS, tripwire.DEFAULT_BLOCKS))
        tripwire.arm(blocks)  # the next of Leto's kernels stops, then the process dies
        return
    if mode.startswith("corrupt"):
        at = f"{name}@{iteration}#{nth}"
        target, k, group = corrupt_spec(mode)
        if target == "computed" and name == plugins.SDC_GRAD_POINT:
            _flip_value(at, dest[0], "gradient")
        elif target == "computed":
            if dest is None:
                raise InjectedCrash(
                    f"{at} passes no computed values: arm {plugins.SDC_POINT} or "
                    f"{plugins.SDC_GRAD_POINT}"
                )
            _flip_computed(at, dest)
        elif target == "activation":
            _flip_activation(at)
        else:
            _flip(at, target, k, group)
        return  # silent: the trainer runs on
    if mode == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped, not dead: only a monitor notices
        return
    raise InjectedCrash(f"injected crash at {name}@{iteration}#{nth}")


def _corrupt(dest) -> None:
    """Random bytes over every destination page, after the copies queued so far have
    landed (so the garbage is what the crash leaves, not overwritten by them)."""
    import torch

    if any(t.device.type == "cuda" for t in dest) or torch.cuda.is_initialized():
        torch.cuda.synchronize()
    g = torch.Generator().manual_seed(0x1E70)
    for t in dest:
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def corrupt_spec(mode: str) -> tuple[str, int, int]:
    """``corrupt:TARGET:K[:GROUP]`` -> (TARGET, K, GROUP)."""
    parts = mode.split(":")
    try:
        target, k = parts[1], int(parts[2])
        group = int(parts[3]) if len(parts) > 3 else 0
    except (IndexError, ValueError):
        raise ValueError(f"mode {mode!r}: expected corrupt:TARGET:PAGES[:GROUP]") from None
    if target not in CORRUPT_TARGETS or k < 1 or len(parts) > 4:
        raise ValueError(
            f"mode {mode!r}: TARGET is one of {', '.join(CORRUPT_TARGETS)}, PAGES >= 1"
        )
    return target, k, group


def _flip(at: str, target: str, k: int, group: int) -> None:
    """One bit in each of ``k`` pages of state group ``group``'s ``target`` pages (an
    index into the trainer's state groups; -1 the last), at byte offsets in different
    codewords (a page's symbol is 2 bytes)."""
    import json
    import time

    import torch

    from nvbit_tools.tripwire import ENV_LOG

    groups = plugins.retained_groups()
    if not groups:
        raise InjectedCrash(f"corrupt at {at}: this process exposes no retained state")
    g = groups[group]
    pages = {"data": g.data, "tier1": g.tier1, "tier2": g.tier2}[target]
    k = min(k, len(pages))  # a small last group holds fewer pages than asked
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the flip lands between the kernels queued so far and later ones
    flipped = []
    for i in range(k):
        page = _raw_bytes(pages[i])
        byte = (1000 + 6 * i) % page.numel()
        page[byte] ^= 1 << (i % 8)
        flipped.append({"page": i, "byte": byte, "bit": i % 8})
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    log = os.environ.get(ENV_LOG)
    if log:
        rec = {"corrupt": target, "group": g.gid, "at": at, "pages": flipped, "time": time.time()}
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _raw_bytes(t):
    """``t``'s bytes (contiguous) as a uint8 tensor of its own: a write through it
    changes the memory without bumping ``t``'s autograd version counter, as a hardware
    flip does (a write through a view of ``t`` would make backward refuse to run)."""
    import torch

    if not t.is_contiguous():
        raise ValueError("faultkit flips bits of contiguous tensors only")
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (t.nbytes,))


def _flip_computed(at: str, dest) -> None:
    """One bit of the first page of the chunk being updated (its lowest bytes: the
    parameters' low mantissa bits, a small wrong value that training carries on with).
    Where parity absorbed the values already (``leto.plugins.Computed``: the fused chunk
    pass), the change is folded into it, so parity agrees with the wrong value as it
    would had the pass computed it: silent, as sdc-update must be."""
    import torch

    pages = list(getattr(dest, "pages", dest))
    absorb = getattr(dest, "absorb", None)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    before = pages[0].clone() if absorb is not None else None
    page = _raw_bytes(pages[0])
    byte = 1000 % page.numel()
    page[byte] ^= 1
    if absorb is not None:
        absorb([before], [pages[0]])
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    _record_flip("computed", at, {"page": 0, "byte": byte, "bit": 0})


def _flip_value(at: str, x, what: str) -> None:
    """The top mantissa bit of one element of the floating-point tensor ``x`` (element
    250, or the last): a value off by up to half of itself — what a wrong GEMM or a wrong
    gradient leaves, and too large to vanish in the rounding of a later sum (a flipped
    lowest bit of a gradient often does, in the all-reduce)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    i = min(250, x.numel() - 1)
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}
    bit = mantissa[x.dtype] - 1
    _raw_bytes(x)[i * x.element_size() + bit // 8] ^= 1 << (bit % 8)  # little-endian
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    _record_flip(what, at, {"page": 0, "element": i, "bit": bit})


def _record_flip(what: str, at: str, where: dict) -> None:
    """A wrong computation made: one line of the abort log (``LETO_TRIPWIRE_LOG``)."""
    import json
    import time

    from nvbit_tools.tripwire import ENV_LOG

    log = os.environ.get(ENV_LOG)
    if log:
        rec = {"corrupt": what, "group": None, "at": at, "pages": [where], "time": time.time()}
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _flip_activation(at: str) -> None:
    """One bit of the output of the model's first ``nn.Linear`` in the forward now
    starting (the point is the model's forward pre-hook): a wrong GEMM result that the
    rest of the forward, the loss and every gradient carry on with."""
    import torch

    model = plugins.exposed_model()
    if model is None:
        raise InjectedCrash(f"corrupt at {at}: this process exposes no model (leto.Run)")
    linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is None:
        raise InjectedCrash(f"corrupt at {at}: the model has no nn.Linear")
    handle = None

    def flip(_module, _args, out):
        handle.remove()  # once: this forward only
        with torch.no_grad():
            _flip_value(at, out.detach(), "activation")

    handle = linear.register_forward_hook(flip)


def _arm_spec(spec: str, mode: str, when: str = "now") -> None:
    arm(*parse(spec), mode=mode, when=when)


def _lose(client, pages: int, host_parity_pages: int, rng) -> dict:
    from faultkit.loss import lose_pages

    return lose_pages(client, pages, host_parity_pages, rng)


plugins.install_point_handler(point)
plugins.install_arm(_arm_spec)
plugins.install_page_loss(_lose)

if os.environ.get(ENV_FAULT_AT):
    arm(
        *parse(os.environ[ENV_FAULT_AT]),
        mode=os.environ.get(ENV_FAULT_MODE, "kill"),
        when=os.environ.get(ENV_FAULT_WHEN, "now"),
    )
