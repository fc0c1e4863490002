"""The fused chunk pass: a chunk's optimizer step and its parity delta in one read.

Runs in the trainer, inside the updater's chunk transaction, after the undo copy
(marker UNDO_DONE) and once the scratch tier-1 parity holds a copy of the authoritative
one. Without it a chunk takes three passes over its state: the script's fused AdamW
(reads parameter, gradient and both moments, writes three), then the codec's parity
update (reads the undo copy and the new state again). The CUDA kernel
(``chunk_pass.cu``) reads each element once, applies torch's fused Adam/AdamW
arithmetic and folds the change into the scratch parity in registers: with at most
``horner.HORNER_ROWS`` tier-1 pages by the code's Horner scheme (``leto.erasure.horner``:
shifts, no table lookups in the loop), with more by a table multiply per column.

Bit-identical to the unfused steps, or not used: the kernel mirrors torch's
``adam_math`` (ATen's fused_adam_utils.cuh), and at start-up ``ChunkPass.create`` runs
it beside ``torch._fused_adamw_``/``_fused_adam_`` of the installed torch on edge-case
values; any differing byte (a torch release changed its arithmetic) and the updater
keeps the unfused steps, saying why in ``ChunkPass.reason``. On the CPU the pass runs
its twin: the same segment tables through torch's fused CPU kernel, and the parity
change by the same Horner scheme in NumPy (``horner_sums``: the kernel's shift steps,
then the host-built matrix) or, above ``horner.HORNER_ROWS`` (or with ``LETO_HORNER=0``),
the codec's update — the bytes the unfused steps give — so CI runs everything but the
kernel.

Where it applies (``create`` names the first thing that rules it out): the script's
optimizers are all ``torch.optim.AdamW``/``Adam`` with ``fused=True``, fp32 state (no
master weights), at most 16 tier-1 pages, pages a multiple of 16 bytes; not with
``LETO_CHUNK_PASS=0`` (benchmarks compare both). Muon, SGD, foreach/single-tensor
AdamW and bf16 parameters keep the unfused steps.

A segment is an element range of one parameter with its group's hyperparameters
(frozen parameters and a step a GradScaler skipped have none, so nothing there
changes). The table is built once per update from that iteration's hyperparameters.
"""

from __future__ import annotations

import bisect
import functools
import os

import numpy as np
import torch

from leto.erasure import horner
from leto.erasure.codec import ReedSolomon
from leto.erasure.kernels import by_name, for_device
from leto.update.layout import RetainedModel
from leto.update.user_optim import ADAM, ADAMW, UserOptimizer
from nvbit_tools import tripwire

ENV = "LETO_CHUNK_PASS"  # "0": the unfused steps
MAX_ROWS = 16
THREADS = 256
SEG = np.dtype(
    [
        ("start", "<i8"),
        ("end", "<i8"),
        ("lr", "<f4"),
        ("beta1", "<f4"),
        ("beta2", "<f4"),
        ("weight_decay", "<f4"),
        ("eps", "<f4"),
        ("step", "<f4"),
        ("adamw", "<i4"),
        ("pad", "<i4"),
    ]
)  # fmt: skip - chunk_pass.cu's struct Seg, 48 bytes


def unsupported(state: RetainedModel, user: UserOptimizer | None, h1: int) -> str | None:
    """Why the fused pass cannot run this model's updates (None: it can)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if user is None:
        return "the updater's own AdamWConfig path"
    for oi, kind in enumerate(user.kinds):
        if kind not in (ADAMW, ADAM):
            return f"optimizer {oi} is {kind.name}"
    for gi, (_, group) in enumerate(user.groups):
        if not group.get("fused"):
            return f"parameter group {gi} is not fused=True (its arithmetic differs)"
    if tuple(state.set_names) != ("param", "exp_avg", "exp_avg_sq") or state.master:
        return "bf16 parameters (fp32 master weights)"
    if h1 > MAX_ROWS:
        return f"{h1} tier-1 pages (the kernel takes at most {MAX_ROWS})"
    if state.page_bytes % 16 or state.shard_start % 4:
        return "pages or the shard are not 16-byte aligned"
    if any(s.layerwise for s in state.slots):
        return "layer-wise parameters"
    return None


class ChunkPass:
    """The fused pass for one updater; ``create`` returns (pass or None, reason)."""

    def __init__(self, state: RetainedModel, user: UserOptimizer, device: torch.device):
        self.state, self.user, self.device = state, user, device
        s0, n = state.shard_start, state.local_valid
        # (local start, local end, parameter group) of every trainable parameter here.
        self.pieces = []
        for slot in state.slots:
            gi = user.group_of.get(slot.name) if slot.trainable else None
            a, b = max(slot.offset - s0, 0), min(slot.offset + slot.numel - s0, n)
            if gi is not None and a < b:
                self.pieces.append((a, b, gi))
        self.ends = [b for _, b, _ in self.pieces]
        self.table: np.ndarray | None = None
        self.dev_table: torch.Tensor | None = None
        self.name = "cuda kernel" if device.type == "cuda" else "CPU twin"
        if device.type == "cuda":
            module = _module()
            self._launch = {k: module.get_function(f"chunk_pass_p{k}") for k in (1, 2, 4, 8)}
            self._launch_rs = {
                h: module.get_function(f"chunk_pass_rs_h{h}")
                for h in range(1, horner.HORNER_ROWS + 1)
            }

    @classmethod
    def create(cls, state, user, h1: int, device: torch.device):
        reason = unsupported(state, user, h1)
        if reason is not None:
            return None, reason
        if device.type == "cuda":
            reason = self_check(device)
            if reason is not None:
                return None, reason
        return cls(state, user, device), None

    # -- per update ---------------------------------------------------------------

    def prepare(self, hparams: list[dict], step, skip: frozenset) -> str | None:
        """The segment table of this update (hyperparameters and step numbers of the
        iteration being updated); on CUDA copied to the device without blocking.
        Returns why the pass cannot take this update (None: it can)."""
        rows = []
        for a, b, gi in self.pieces:
            oi = self.user.groups[gi][0]
            if oi in skip:
                continue
            h = hparams[gi]
            if self.user.kinds[oi] is ADAM and h["weight_decay"] != 0:
                # torch's fused Adam rounds its L2 term (grad + weight_decay * param)
                # with or without an fma depending on the element's lane in its unrolled
                # loop (measured on torch 2.11: lane 0 unfused, lanes 1-3 fused), so the
                # bytes depend on where a tensor starts; AdamW has no such term.
                self.table = None
                return f"parameter group {gi}: Adam with weight decay (L2) on the GPU"
            st = step[oi] if isinstance(step, list) else step
            rows.append((a, b, h["lr"], h["betas"][0], h["betas"][1], h["weight_decay"],
                         h["eps"], float(st), int(self.user.kinds[oi] is ADAMW), 0))  # fmt: skip
        self.table = np.array(rows, dtype=SEG)
        # As given (float64): torch's CPU kernel takes them so; its CUDA kernel, like
        # chunk_pass.cu, rounds them to float32.
        self.exact = [(r[2], r[3], r[4], r[5], r[6], r[7], r[8]) for r in rows]
        self.ends = [int(r["end"]) for r in self.table]
        if self.device.type == "cuda" and len(self.table):
            host = torch.from_numpy(self.table.view(np.uint8)).pin_memory()
            self.dev_table = host.to(self.device, non_blocking=True)
        return None

    def run(self, units: tuple[int, int], part: tuple[int, int], col0: int,
            scratch: list[torch.Tensor], code: ReedSolomon, pages, parity_update) -> None:  # fmt: skip
        """Optimizer + parity delta on elements ``part`` = [lo, hi) of every page of the
        chunk's ``units`` (its first data page is column ``col0`` of the group; ``lo``
        and ``hi`` multiples of 64), the parity change accumulated into ``scratch``.
        ``code``: the group's tier-1 code; ``pages`` (the chunk's live pages, group
        order) and ``parity_update(scratch, col0, old, new)`` (the codec's) serve the
        CPU twin."""
        if self.table is None:
            raise RuntimeError("ChunkPass.prepare was not called for this update")
        if self.device.type == "cuda":
            self._kernel(units, part, col0, scratch, code)
        else:
            self._twin(units, part, col0, scratch, code, pages, parity_update)

    def _segments(self, e0: int, e1: int) -> range:
        lo = bisect.bisect_right(self.ends, e0)
        hi = lo
        while hi < len(self.table) and self.table[hi]["start"] < e1:
            hi += 1
        return range(lo, hi)

    def _kernel(self, units, part, col0: int, scratch, code: ReedSolomon) -> None:
        st, ue = self.state, self.state.unit_elems
        (u0, u1), (lo, hi) = units, part
        segs = self._segments(u0 * ue, u1 * ue)
        if not len(segs) or hi <= lo:
            return
        rows = len(scratch)
        ptrs = _pointer_table(self.device, [p.data_ptr() for p in scratch])
        f = st.flat
        grad = st.grad.data_ptr() + 4 * st.shard_start
        blocks = -(-((hi - lo) // 4) // THREADS)
        head = (
            np.uint64(f["param"].data_ptr()),
            np.uint64(f["exp_avg"].data_ptr()),
            np.uint64(f["exp_avg_sq"].data_ptr()),
            np.uint64(grad),
            np.int64(ue),
            np.int32(u0),
            np.int32(u1),
            np.int64(lo // 4),
            np.int64(hi // 4),
            np.uint64(self.dev_table.data_ptr() + SEG.itemsize * segs.start),
            np.int32(len(segs)),
        )
        if horner.applies(rows):
            m = code.horner_coefficients(col0, 3 * (u1 - u0))
            tail = (np.uint64(by_name("cuda").tables(m, self.device).data_ptr()),
                    np.uint64(ptrs.data_ptr()))  # fmt: skip
            launch = self._launch_rs[rows]
        else:
            np_ = 1 if rows <= 2 else 2 if rows <= 4 else 4 if rows <= 8 else 8
            tables = by_name("cuda").tables(code.coefficients, self.device)
            tail = (np.uint64(tables.data_ptr()), np.int32(0), np.int32(col0),
                    np.uint64(ptrs.data_ptr()), np.int32(rows))  # fmt: skip
            launch = self._launch[np_]
        tw = tripwire.launch_arg(self.device, blocks)
        with tripwire.launch_on_torch_stream(self.device):
            launch((blocks,), (THREADS,), (*head, *tail, np.uint64(tw)))
        if tw:
            tripwire.fire(self.device)  # SIGKILL with the pass in flight

    def _twin(self, units, part, col0, scratch, code, pages, parity_update) -> None:
        """The same segments through torch's fused kernel, then the codec's update from
        the values it read: the unfused steps' bytes."""
        st, ue = self.state, self.state.unit_elems
        (u0, u1), (lo, hi) = units, part
        f, g = st.flat, st.grad[st.shard_start :]
        by_kind: dict[tuple, list] = {}
        for u in range(u0, u1):
            e0, e1 = u * ue + lo, u * ue + hi
            for i in self._segments(e0, e1):
                r = self.table[i]
                a, b = max(int(r["start"]), e0), min(int(r["end"]), e1)
                if a < b:
                    by_kind.setdefault(self.exact[i], []).append((a, b))
        names = ("param", "exp_avg", "exp_avg_sq")
        # The parity change is taken from the values the optimizer read, as the kernel
        # takes it from its registers — not from the undo copy: a page changed silently
        # after the undo copy then leaves parity that disagrees with it (the scrub finds
        # it) instead of parity re-encoding the damage.
        cut = slice(4 * lo, 4 * hi)  # bytes of every page
        read = [p[cut].clone() for p in pages]
        for (lr, b1, b2, wd, eps, step, adamw), ranges in by_kind.items():
            live = {n: [f[n][a:b] for a, b in ranges] for n in names}
            armed = tripwire.armed()  # faultkit kernel-abort: computed aside, landed
            out = {n: [v.clone() for v in vs] for n, vs in live.items()} if armed else live
            steps = list(torch.full((len(ranges),), step, dtype=torch.float32))
            kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
            kernel(out["param"], [g[a:b] for a, b in ranges], out["exp_avg"],
                   out["exp_avg_sq"], [], steps, amsgrad=False, lr=lr, beta1=b1, beta2=b2,
                   weight_decay=wd, eps=eps, maximize=False)  # fmt: skip
            if armed:
                tripwire.land([t for n in names for t in live[n]],
                              [t for n in names for t in out[n]])  # fmt: skip
        ys = [y[cut] for y in scratch]
        if horner.applies(len(scratch)):  # the kernel's way: Horner steps, then M
            t = horner.horner_sums(code.parity_pages, read, [p[cut] for p in pages])
            m = code.horner_coefficients(col0, len(pages))
            for_device(self.device).matmul(m, t, ys, accumulate=True)
        else:
            parity_update(ys, col0, read, [p[cut] for p in pages])


@functools.cache
def _module():
    """The kernel, built by NVRTC with IEEE denormals (``-ftz=false``), as torch's own
    kernels are built. Not through ``cupy.RawModule``: CuPy appends ``-ftz=true`` to every
    module it compiles, and with denormals flushed a second moment below 1.2e-38 (a tied
    embedding's rows of tokens a batch lacks: gradients of ~1e-20) became 0 where torch
    keeps it — the parameters still equal torch's (its square root is far below eps), the
    optimizer state did not, and the update recheck rightly said so (the issue "Real
    models on the GPU")."""
    from cupy.cuda import function

    from leto import gpu_kernels

    def load(path: str):
        m = function.Module()
        m.load_file(path)
        return m

    # Compiled once per machine (or by the prebuild leto run starts: leto.gpu_kernels),
    # not in every trainer and shadow.
    return _Module(gpu_kernels.load("chunk_pass", load))


class _Module:
    """``get_function(name)``: a launcher on CuPy's current stream (the torch stream that
    ``tripwire.launch_on_torch_stream`` makes current)."""

    def __init__(self, module):
        self.module = module

    def get_function(self, name: str):
        import cupy

        fn = self.module.get_function(name)

        def launch(grid, block, args):
            fn(grid, block, args, stream=cupy.cuda.get_current_stream())

        return launch


_POINTERS: dict = {}


def _pointer_table(device: torch.device, ptrs: list[int]) -> torch.Tensor:
    key = (device.index, tuple(ptrs))
    t = _POINTERS.get(key)
    if t is None:  # a few scratch buffers per trainer: kept for its life
        t = torch.tensor(ptrs, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        _POINTERS[key] = t
    return t


_CHECKED: dict[int, str | None] = {}  # device index -> the self-check's answer


def self_check(device: torch.device) -> str | None:
    """Run the kernel's Adam/AdamW beside the installed torch's fused kernels on values
    that exercise every branch (zero and huge gradients, tiny second moments, weight
    decay on and off, first and late steps); the first differing byte is the reason
    the fused pass is not used. Once per process and device: a parked shadow runs it
    while warming up (``leto.trainer.api``), so a promotion does not."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CHECKED:
        _CHECKED[idx] = _self_check(torch.device("cuda", idx))
    return _CHECKED[idx]


def _self_check(device: torch.device) -> str | None:
    fn = _module().get_function("adam_check")
    for n in (4099, 8192):  # torch's unaligned path, then its vectorized one
        reason = _check(fn, device, n)
        if reason is not None:
            return reason
    return None


def _check(fn, device: torch.device, n: int) -> str | None:
    gen = torch.Generator().manual_seed(7)
    base = {k: torch.randn(n, generator=gen) * s for k, s in (("p", 1.0), ("g", 1e-2), ("m", 1e-3))}
    base["v"] = torch.rand(n, generator=gen) * 1e-6
    base["g"][:50] = 0.0
    base["g"][50:100] *= 1e6
    base["v"][100:150] = 0.0
    # Denormal territory (the optimizer state of rarely-used embedding rows): squared
    # gradients and second moments below float32's smallest normal, 1.2e-38.
    base["g"][150:400] *= torch.logspace(-28, -14, 250, dtype=torch.float32)
    base["v"][150:400] = torch.logspace(-45, -37, 250, dtype=torch.float32)
    base["m"][400:500] *= 1e-35
    for adamw, wd, lr, step, betas, eps in (
        (1, 0.1, 3e-4, 1.0, (0.9, 0.95), 1e-8),
        (1, 0.0, 1e-2, 1234.0, (0.9, 0.999), 1e-6),
        (1, 0.01, 1e-3, 7.0, (0.8, 0.99), 1e-8),
        (0, 0.0, 2.5e-3, 100000.0, (0.9, 0.95), 1e-5),
    ):
        want = {k: v.to(device) for k, v in base.items()}
        got = {k: v.clone() for k, v in want.items()}
        kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
        kernel([want["p"]], [want["g"]], [want["m"]], [want["v"]], [],
               [torch.tensor(step, device=device)], amsgrad=False, lr=lr, beta1=betas[0],
               beta2=betas[1], weight_decay=wd, eps=eps, maximize=False)  # fmt: skip
        seg = np.array([(0, n, lr, betas[0], betas[1], wd, eps, step, adamw, 0)], dtype=SEG)
        seg_t = torch.from_numpy(seg.view(np.uint8)).to(device)
        with tripwire.launch_on_torch_stream(device):
            fn((-(-n // THREADS),), (THREADS,),
               (np.uint64(got["p"].data_ptr()), np.uint64(got["g"].data_ptr()),
                np.uint64(got["m"].data_ptr()), np.uint64(got["v"].data_ptr()),
                np.int64(n), np.uint64(seg_t.data_ptr())))  # fmt: skip
        torch.cuda.synchronize(device)
        for k in ("p", "m", "v"):
            diff = (got[k].view(torch.int32) != want[k].view(torch.int32)).nonzero()
            if diff.numel():
                i = int(diff[0])
                return (
                    f"the fused pass's {'AdamW' if adamw else 'Adam'} differs from torch "
                    f"{torch.__version__}'s fused kernel ({k}[{i}]: {got[k][i].item()!r} vs "
                    f"{want[k][i].item()!r}); the unfused steps run"
                )
    return None
