"""Gradient parity taken in ``clip_grad_norm_``'s own pass over the gradients (issue 59).

Runs in the trainer. The updater protects an iteration's gradients before it updates
(marker GRADS_PROTECTED): it encoded their tier-1 parity at the step, a read of every
gradient on the update's critical path (1.6 ms at 1.1 B parameters on an H100). A script
that clips has just read and written every gradient: torch's ``clip_grad_norm_``
multiplies each by the clipping coefficient in place, even at a coefficient of 1.0. Under
Leto that multiply and the encode are one pass (``grad_clip.cu``): the gradients' bytes
are torch's (``x * c`` in float, IEEE denormals), the parity the codec's encode of them.

How it is wired: ``install`` replaces ``torch.nn.utils.clip_grad._clip_grads_with_norm_``
(what ``clip_grad_norm_`` calls once it has the norm) by a function that computes the
coefficient as torch does, runs the pass on the gradients that are views of the retained
buffer, and hands every other gradient to torch's own function. The parity is then good
for the step of that iteration only while the buffer's autograd version counter has not
moved (any in-place write to a gradient after the clip moves it: a GradScaler, a second
clip, the landing of a parameter no backward reached): ``parity`` says so, and otherwise
the updater encodes at the step, as before.

A write autograd does not see (``p.grad.data.mul_(...)`` after the clip, a library's own
kernel) would leave the parity stale: the first two such parities and every
``AUDIT_EVERY``-th are compared with a fresh encode at the step (the fresh one is what
protects those iterations), and a difference turns the pass off for the job with a line
on the console.

Where it applies (``unsupported`` names the first thing that rules it out): CUDA, fp32
gradients in one unsharded buffer, at most ``horner.HORNER_ROWS`` tier-1 pages, the
script's own optimizer (it clips), ``LETO_CLIP_PARITY`` not ``0``. On the CPU the same
bookkeeping runs with torch's multiply and the codec's encode, so CI runs all of it but
the kernel.
"""

from __future__ import annotations

import functools
import os
import types

import numpy as np
import torch

from leto import gpu_kernels, rank_log
from leto.erasure import horner
from leto.erasure.kernels import by_name
from nvbit_tools import tripwire

ENV = "LETO_CLIP_PARITY"  # "0": the gradients' parity encoded at the step
AUDIT_FIRST = 2  # the first parities compared with a fresh encode
AUDIT_EVERY = 256  # then one in this many
THREADS = 256
PAGE_SEG = np.dtype([("lo", "<i8"), ("hi", "<i8")])  # grad_clip.cu's struct PageSeg

_active: ClipParity | None = None  # the trainer's (one updater at a time)
_torch_clip = None  # torch's own _clip_grads_with_norm_


def unsupported(upd) -> str | None:
    """Why the gradients' parity cannot be taken in the clip's pass (None: it can)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if upd.user is None:
        return "the updater's own AdamWConfig path (it clips itself)"
    if not horner.applies(upd.h1):
        return f"{upd.h1} tier-1 pages"
    st = upd.state
    if st.grad.dtype != torch.float32:
        return f"{st.grad.dtype} gradients"
    if st.shard is not None or st.shard_start or st.local_valid != st.grad.numel():
        return "a sharded gradient buffer"
    if not upd.grad_groups:
        return "no gradient protection groups"
    if any(m[0] != "grad" for g in upd.grad_groups for m in g.members):
        # (a page of another allocation could change between the clip and the step)
        return "gradient protection groups shared with other allocations"
    return None


def install(cp: ClipParity | None) -> None:
    """Make ``cp`` the one ``clip_grad_norm_`` takes the parity for (None: none; torch's
    function is then called as it is)."""
    global _active, _torch_clip
    import torch.nn.utils.clip_grad as clip_grad

    if _torch_clip is None:
        _torch_clip = clip_grad._clip_grads_with_norm_
        clip_grad._clip_grads_with_norm_ = _clip_grads_with_norm_
    _active = cp


def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None) -> None:
    """torch's ``_clip_grads_with_norm_``, the retained gradients scaled by the pass."""
    cp = _active
    if cp is None or isinstance(parameters, torch.Tensor):
        return _torch_clip(parameters, max_norm, total_norm, foreach)
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    mine, rest = cp.split(grads)
    if rest:
        _torch_clip([types.SimpleNamespace(grad=g) for g in rest], max_norm, total_norm, foreach)
    if mine:
        # As torch computes it (torch/nn/utils/clip_grad.py), so the bytes are the same.
        clip_coef = float(max_norm) / (total_norm + 1e-6)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        cp.scale(mine, clip_coef_clamped.to(mine[0][0].device))


class ClipParity:
    """The pass for one updater: per-group tier-1 parity buffers, and whether they hold
    the parity of the retained gradients as they now are, for which iteration."""

    def __init__(self, upd):
        self.upd = upd
        st = upd.state
        self.base = st.grad.data_ptr()
        self.elems = st.grad.numel()
        self.page_elems = st.page_bytes // 4
        self.device = st.grad.device
        self.bufs = [
            torch.empty((upd.h1, st.page_bytes), dtype=torch.uint8, device=self.device)
            for _ in upd.grad_groups
        ]
        self.pages = [upd._pages(("grad", g.gid), g.data_pages or g.data).pages for g in upd.grad_groups]
        self._plans: dict[tuple, list] = {}
        self.token: tuple[int, int] | None = None  # (iteration, the buffer's version)
        self.taken = 0  # parities taken in the clip's pass
        self.used = 0  # of which the step used
        self.off: str | None = None  # why it was turned off (an audit found a difference)
        self.name = "cuda kernel" if self.device.type == "cuda" else "CPU twin"
        if self.device.type == "cuda":
            module = _module()
            self._launch = {h: module.get_function(f"grad_clip_h{h}") for h in range(1, 5)}

    # -- the clip -----------------------------------------------------------------

    def split(self, grads: list[torch.Tensor]) -> tuple[list, list]:
        """([(gradient, start element in the buffer)] of the retained views, the rest)."""
        mine, rest = [], []
        if self.off is not None or self.upd.client.sock.fileno() < 0:  # (off, or unmapped)
            return mine, grads
        end = self.base + 4 * self.elems
        for g in grads:
            p = g.data_ptr()
            if (
                g.layout is torch.strided
                and g.dtype == torch.float32
                and g.device == self.device
                and g.is_contiguous()
                and self.base <= p < end
                and p + 4 * g.numel() <= end
            ):
                mine.append((g, (p - self.base) // 4))
            else:
                rest.append(g)
        return mine, rest

    def scale(self, mine: list[tuple[torch.Tensor, int]], coef: torch.Tensor) -> None:
        """Multiply ``mine`` by ``coef`` (a float32 device scalar) and take every group's
        tier-1 parity of the buffer as it then is."""
        upd = self.upd
        m = upd.marker.state
        key = tuple((a, g.numel()) for g, a in mine)
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = self._plan(sorted((a, a + g.numel()) for g, a in mine))
        for gi, g in enumerate(upd.grad_groups):
            code = upd.code(g).tier1
            out = list(self.bufs[gi])
            if self.device.type == "cuda":
                self._kernel(gi, plans[gi], code, coef, out)
            else:
                self._twin(gi, plans[gi], coef, code, out, g.gid)
        # As torch's in-place multiply would: autograd sees the gradients written.
        torch.autograd.graph.increment_version([g for g, _ in mine])
        self.token = (m.iteration, upd.state.grad._version)
        self.taken += 1

    def _plan(self, ranges: list[tuple[int, int]]) -> list:
        """Per group: (page_seg, segs) — each page's clipped ranges, relative to it."""
        plans = []
        for pages in self.pages:
            page_seg, segs = [0], []
            for pg in pages:
                p = pg.data_ptr()
                if self.base <= p < self.base + 4 * self.elems:
                    e0 = (p - self.base) // 4
                    e1 = e0 + self.page_elems
                    for a, b in ranges:
                        if a < e1 and b > e0:
                            segs.append((max(a, e0) - e0, min(b, e1) - e0))
                page_seg.append(len(segs))
            plans.append((np.array(page_seg, dtype=np.int32), np.array(segs, dtype=PAGE_SEG)))
        if self.device.type == "cuda":
            plans = [
                (torch.from_numpy(ps).to(self.device),
                 torch.from_numpy(sg.view(np.uint8)).to(self.device) if len(sg) else None, sg)
                for ps, sg in plans
            ]  # fmt: skip
        return plans

    def _kernel(self, gi: int, plan, code, coef: torch.Tensor, out: list[torch.Tensor]) -> None:
        page_seg, segs, _ = plan
        pages = self.pages[gi]
        cuda = by_name("cuda")
        table = cuda._pointer_table(self.device, [p.data_ptr() for p in pages] + [o.data_ptr() for o in out])
        tables = cuda.tables(code.horner_coefficients(0, len(pages)), self.device)
        n_items = self.page_elems // 4
        blocks = -(-n_items // THREADS)
        tw = tripwire.launch_arg(self.device, blocks)
        with tripwire.launch_on_torch_stream(self.device):
            self._launch[len(out)]((blocks,), (THREADS,), (
                np.uint64(table.data_ptr()), np.uint64(page_seg.data_ptr()),
                np.uint64(segs.data_ptr() if segs is not None else 0), np.int32(len(pages)),
                np.int64(n_items), np.uint64(coef.data_ptr()), np.uint64(tables.data_ptr()),
                np.uint64(table.data_ptr() + 8 * len(pages)), np.uint64(tw)))  # fmt: skip
        if tw:
            tripwire.fire(self.device)

    def _twin(self, gi: int, plan, coef: torch.Tensor, code, out, gid) -> None:
        """The same bytes on the CPU: torch's multiply of each clipped range, then the
        codec's encode of the group."""
        page_seg, segs = plan
        pages = self.pages[gi]
        c = coef.reshape(())
        for k, pg in enumerate(pages):
            x = pg.view(torch.float32)
            for lo, hi in segs[page_seg[k] : page_seg[k + 1]].tolist():
                x[lo:hi].mul_(c)
        code.encode(list(pages), out=out, group=gid)

    # -- the step -----------------------------------------------------------------

    def parity(self, iteration: int) -> list[torch.Tensor] | None:
        """The groups' tier-1 parity taken in iteration ``iteration``'s clip, where the
        gradients have not been written since; None: encode them at the step."""
        if self.off is not None or self.token != (iteration, self.upd.state.grad._version):
            return None
        return self.bufs

    def audit_due(self) -> bool:
        """Whether the parity about to be used is compared with a fresh encode: the
        first ``AUDIT_FIRST``, then every ``AUDIT_EVERY``-th."""
        return self.used < AUDIT_FIRST or (self.used + 1) % AUDIT_EVERY == 0

    def audit(self, gi: int, fresh: list[torch.Tensor]) -> None:
        """Group ``gi``'s parity from the clip against ``fresh`` (the step's encode of
        the same gradients): a difference turns the pass off, said on the console."""
        if all(torch.equal(a, b) for a, b in zip(self.bufs[gi], fresh, strict=True)):
            return
        self.off = (
            f"the gradients changed after clip_grad_norm_ without autograd seeing it "
            f"(a write through .data, or a kernel of the script's own), at iteration "
            f"{self.upd.marker.state.iteration}"
        )
        rank_log.tell(None, f"gradient parity is taken at the step from now on: {self.off}")


@functools.cache
def _module():
    """Built by NVRTC with IEEE denormals, loaded as ``chunk_pass._module`` loads its own
    (not through ``cupy.RawModule``, which flushes them: why is there)."""
    from cupy.cuda import function

    from leto.update.chunk_pass import _Module

    def load(path: str):
        m = function.Module()
        m.load_file(path)
        return m

    return _Module(gpu_kernels.load("grad_clip", load))
