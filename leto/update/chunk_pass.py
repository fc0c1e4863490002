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

from leto import gpu_kernels
from leto.erasure import field, horner
from leto.erasure.codec import ReedSolomon
from leto.erasure.kernels import by_name, for_device
from leto.update.layout import RetainedModel
from leto.update.optim import CUT_ELEMS
from leto.update.user_optim import ADAM, ADAMW, UserOptimizer
from nvbit_tools import tripwire

ENV = "LETO_CHUNK_PASS"  # "0": the unfused steps
RESUMABLE_ENV = "LETO_RESUMABLE_PASS"  # "0": an undo copy of every chunk instead
RF_PARTS_ENV = "LETO_RF_PARTS"  # the parts (launches) the resumable pass runs a chunk in
# The default: on an H100 (2026-12-06) one launch for all items or two halves took the
# same time (17.6, 17.5 ms, bench.resumable_pass); four parts 23.1, eight 41.1: with fewer
# items a launch, each thread's walk through the chunk's units (two fences a step) is
# what takes the time. Two halves keep the slots at half the items.
RF_PARTS = 2
MAX_ROWS = 16
THREADS = 256
# Modes of the resumable pass (chunk_pass.cu's chunk_pass_rf_h*).
FRESH, RESUME, PARITY = 0, 1, 2
TAG_LIMIT = 1 << 39  # a tag fits the progress word's top 40 bits, sign bit clear
STEP_UNITS = gpu_kernels.rf_units()  # units a thread saves and writes per step (its build's)
MAX_CHUNK_UNITS = 1 << 14  # a step's first unit fits its 14 bits of the progress word
DONE = 2  # the progress code of an item that finished the chunk
STATE = ("param", "exp_avg", "exp_avg_sq")  # the arrays the pass updates, in group order
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


def not_resumable(h1: int) -> str | None:
    """Why the fused pass cannot run resumably (with an ``ItemLog`` in place of an undo
    copy of every chunk) under a code with ``h1`` tier-1 pages (None: it can)."""
    if os.environ.get(RESUMABLE_ENV, "1") == "0":
        return f"{RESUMABLE_ENV}=0"
    if not horner.applies(h1):
        return (
            f"{h1} tier-1 pages: the resumable pass takes the Horner scheme's at most "
            f"{horner.HORNER_ROWS}"
            if h1 > horner.HORNER_ROWS
            else f"{horner.ENV}=0"
        )
    return None


def parts(unit_elems: int, n: int) -> list[tuple[int, int]]:
    """The element ranges of every page a chunk's pass runs in, one launch each: ``n``
    parts (fewer where pages are short), cut at multiples of ``CUT_ELEMS``."""
    cuts = sorted({k * unit_elems // n // CUT_ELEMS * CUT_ELEMS for k in range(n)} | {unit_elems})
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def rf_parts() -> int:
    """The parts the resumable pass runs a chunk's items in (LETO_RF_PARTS)."""
    n = int(os.environ.get(RF_PARTS_ENV, str(RF_PARTS)))
    if not 1 <= n <= 64:
        raise ValueError(f"{RF_PARTS_ENV}={n}: from 1 to 64 parts")
    return n


def log_bytes(page_bytes: int, h1: int, part_list: list[tuple[int, int]]) -> int:
    """Bytes of an ``ItemLog`` for pages of ``page_bytes``, ``h1`` tier-1 pages and the
    pass's ``part_list``."""
    return ItemLog.nbytes(page_bytes, h1, slot_items(part_list))


def slot_items(part_list: list[tuple[int, int]]) -> int:
    """Items of the largest part: the slots' length."""
    return max(hi - lo for lo, hi in part_list) // 4


def step_code(k: int, mask: int, slot: int) -> int:
    """The progress code of a step from unit ``k`` in flight: the old values of its units
    in ``mask`` and the sums before unit ``k`` in slot ``slot``."""
    return (k << 10) | (mask << 2) | (slot << 1) | 1


class ItemLog:
    """What the resumable pass records per item (16 bytes at one offset of every page of
    a chunk) so that a crash anywhere in it can be resumed without an undo copy of the
    chunk (chunk_pass.cu explains the protocol): a progress word per item, two slots per
    item in flight (the old values of the unit being written and the parity sums before
    it) and the final sums. A chunk's items run in parts (``parts``), one launch after the
    other, so the slots are for one part's items: ``slot_items`` of them, at the item's
    place in its part. Lives in pool memory, so it outlives the trainer that wrote it."""

    def __init__(self, flat: torch.Tensor, page_bytes: int, h: int, slot_items: int):
        self.items, self.h, self.slot_items = page_bytes // 16, h, slot_items
        n, s = self.items, slot_items
        self.progress = flat[: n * 8].view(torch.int64)
        planes = self.planes(h)
        end = n * 8 + planes * s * 16
        self.slots = flat[n * 8 : end].view(torch.int32).view(planes, s, 4)
        self.fin = flat[end : end + h * n * 16].view(torch.int32).view(h, n, 4)

    @staticmethod
    def planes(h: int) -> int:
        """Planes of the two slots (each: 3 per unit of a step, then ``h`` of sums)."""
        return 2 * (3 * STEP_UNITS + h)

    @classmethod
    def nbytes(cls, page_bytes: int, h: int, slot_items: int) -> int:
        items = page_bytes // 16
        return items * 8 + cls.planes(h) * slot_items * 16 + h * items * 16

    def plane_of_data(self, slot: int, unit: int, array: int) -> int:
        return slot * (3 * STEP_UNITS + self.h) + 3 * unit + array

    def plane_of_sums(self, slot: int, row: int) -> int:
        return slot * (3 * STEP_UNITS + self.h) + 3 * STEP_UNITS + row

    def data(self, slot: int, unit: int, array: int) -> torch.Tensor:
        """Slot ``slot``'s old values of the step's unit ``unit``, of ``array`` (0 param,
        1 exp_avg, 2 exp_avg_sq): [slot_items, 4] words, at the item's place in its part."""
        return self.slots[self.plane_of_data(slot, unit, array)]

    def sums(self, slot: int, row: int) -> torch.Tensor:
        """Slot ``slot``'s parity sums of row ``row`` ([slot_items, 4], at the item's place
        in its part); slot 2: the final sums ([items, 4], at the item)."""
        return self.fin[row] if slot == 2 else self.slots[self.plane_of_sums(slot, row)]


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
            self._launch_rf = {
                h: module.get_function(f"chunk_pass_rf_h{h}")
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
            scratch: list[torch.Tensor], code: ReedSolomon, pages, parity_update,
            log: ItemLog | None = None, tag: int = 0, mode: int = FRESH, mid=None) -> None:  # fmt: skip
        """Optimizer + parity delta on elements ``part`` = [lo, hi) of every page of the
        chunk's ``units`` (its first data page is column ``col0`` of the group; ``lo``
        and ``hi`` multiples of 64), the parity change accumulated into ``scratch``.
        ``code``: the group's tier-1 code; ``pages`` (the chunk's live pages, group
        order) and ``parity_update(scratch, col0, old, new)`` (the codec's) serve the
        CPU twin.

        With a ``log``: the resumable pass, its progress words tagged ``tag`` (< 2^39,
        naming the update's chunk), in ``mode`` FRESH, RESUME or PARITY (chunk_pass.cu).
        ``mid()``: the CPU twin calls it halfway through, with one unit of its items half
        written (a crash point)."""
        if self.table is None and mode != PARITY:  # (PARITY reads no hyperparameters)
            raise RuntimeError("ChunkPass.prepare was not called for this update")
        if log is not None and not 0 < tag < TAG_LIMIT:
            raise ValueError(f"resumable pass: tag {tag} outside 1 .. 2^39 - 1")
        if log is not None and (part[1] - part[0]) // 4 > log.slot_items:
            raise ValueError(
                f"resumable pass: part {part} has {(part[1] - part[0]) // 4} items, the item "
                f"log's slots {log.slot_items}"
            )
        if self.device.type == "cuda":
            self._kernel(units, part, col0, scratch, code, log, tag, mode)
        elif log is not None:
            self._twin_resumable(units, part, col0, scratch, code, pages, log, tag, mode, mid)
        else:
            self._twin(units, part, col0, scratch, code, pages, parity_update)

    def _segments(self, e0: int, e1: int) -> range:
        lo = bisect.bisect_right(self.ends, e0)
        hi = lo
        while hi < len(self.table) and self.table[hi]["start"] < e1:
            hi += 1
        return range(lo, hi)

    def _kernel(self, units, part, col0: int, scratch, code: ReedSolomon, log=None, tag=0,
                mode=FRESH) -> None:  # fmt: skip
        st, ue = self.state, self.state.unit_elems
        (u0, u1), (lo, hi) = units, part
        segs = range(0) if mode == PARITY else self._segments(u0 * ue, u1 * ue)
        if (not len(segs) and mode != PARITY) or hi <= lo:
            return  # (nothing changes: a resumable pass's items then start afresh)
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
            np.uint64(self.dev_table.data_ptr() + SEG.itemsize * segs.start if len(segs) else 0),
            np.int32(len(segs)),
        )
        if log is not None:
            m = code.horner_coefficients(col0, 3 * (u1 - u0))
            tail = (np.uint64(by_name("cuda").tables(m, self.device).data_ptr()),
                    np.uint64(ptrs.data_ptr()))  # fmt: skip
            tw = tripwire.launch_arg(self.device, blocks)
            with tripwire.launch_on_torch_stream(self.device):
                self._launch_rf[rows]((blocks,), (THREADS,), (
                    *head, *tail, np.uint64(tw), np.uint64(log.progress.data_ptr()),
                    np.uint64(log.slots.data_ptr()), np.uint64(log.fin.data_ptr()),
                    np.int64(log.items), np.int64(log.slot_items), np.uint64(tag),
                    np.int32(mode)))  # fmt: skip
            if tw:
                tripwire.fire(self.device)
            return
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
        f = st.flat
        by_kind = self._by_kind([(u * ue + lo, u * ue + hi) for u in range(u0, u1)])
        names = STATE
        # The parity change is taken from the values the optimizer read, as the kernel
        # takes it from its registers — not from the undo copy: a page changed silently
        # after the undo copy then leaves parity that disagrees with it (the scrub finds
        # it) instead of parity re-encoding the damage.
        cut = slice(4 * lo, 4 * hi)  # bytes of every page
        read = [p[cut].clone() for p in pages]
        for kind, ranges in by_kind.items():
            live = {n: [f[n][a:b] for a, b in ranges] for n in names}
            armed = tripwire.armed()  # faultkit kernel-abort: computed aside, landed
            out = {n: [v.clone() for v in vs] for n, vs in live.items()} if armed else live
            self._adam(kind, ranges, out)
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

    def _twin_resumable(self, units, part, col0, scratch, code, pages, log: ItemLog,
                        tag: int, mode: int, mid) -> None:  # fmt: skip
        """The resumable pass on the CPU: chunk_pass.cu's protocol item by item — the same
        progress words, slots and final sums, in the same places — with every item's unit
        stepped together, its values from torch's fused kernel on the ranges the other
        twin uses (the unfused steps' bytes)."""
        ue, h, G = self.state.unit_elems, log.h, STEP_UNITS
        (u0, u1), (lo, hi) = units, part
        n = u1 - u0
        i0, i1 = lo // 4, hi // 4
        held = tripwire.armed()  # faultkit kernel-abort: the first N blocks run, as there
        if held:
            i1 = min(i1, i0 + tripwire.cpu_blocks(-(-(i1 - i0) // THREADS)) * THREADS)
        items = i1 - i0
        # The chunk's pages in group order (unit by unit: param, exp_avg, exp_avg_sq),
        # whole pages: the last unit's run past the parameters' end too, as on the GPU.
        words = [pg.numpy().view(np.uint32) for pg in pages]
        prog = log.progress[i0:i1].numpy()
        slots = log.slots.numpy().view(np.uint32)[:, : i1 - i0]  # at the item's place in the part
        fin = log.fin.numpy().view(np.uint32)[:, i0:i1]

        def block(a: int, k: int) -> np.ndarray:  # [items, 4] words of array a, unit u0+k
            return words[3 * k + a][4 * i0 : 4 * i1].reshape(items, 4)

        # Which units have values to change for each item (a segment covers its start).
        table = self.table if mode != PARITY else np.zeros(0, dtype=SEG)
        starts, ends = table["start"], table["end"]
        e_items = 4 * np.arange(i0, i1, dtype=np.int64)
        inside = np.zeros((n, items), dtype=bool)
        for k in range(n):
            e = (u0 + k) * ue + e_items
            j = np.searchsorted(ends, e, side="right")
            ok = j < len(ends)
            ok[ok] &= starts[j[ok]] <= e[ok]
            inside[k] = ok
        t = np.zeros((h, items, 4), dtype=np.uint32)
        start = np.zeros(items, dtype=np.int64)  # the unit each item's next step starts at
        slot = np.zeros(items, dtype=np.int64)
        done = np.zeros(items, dtype=bool)
        if mode != FRESH:
            match = (prog >> 24) == tag
            c = prog & 0xFFFFFF
            done = match & (c == DONE)
            stopped = match & (c % 2 == 1)
            start = np.where(stopped, c >> 10, 0)
            start[done] = n
            slot = np.where(stopped, (c >> 1) & 1, 0)
            mask = np.where(stopped, (c >> 2) & 0xFF, 0)
            for r in range(h):
                t[r][done] = fin[r][done]
            for s_ in (0, 1):
                sel = stopped & (slot == s_)
                for r in range(h):
                    t[r][sel] = slots[log.plane_of_sums(s_, r)][sel]
                for jj in range(G):  # the step's units back to their old values
                    # (a set, not np.unique: that imports numpy.ma, on a promoted
                    # trainer's path to its first iteration)
                    for k in sorted(set(start[sel & (mask >> jj & 1 == 1)].tolist())):
                        at = np.nonzero(sel & (mask >> jj & 1 == 1) & (start == k))[0]
                        for a in range(3):
                            block(a, int(k) + jj)[at] = slots[log.plane_of_data(s_, jj, a)][at]
        mine = tag << 24
        b = field.first_root(h)
        zero = np.zeros((items, 4), dtype=np.uint32)
        called = mid is None
        step_mask = np.zeros(items, dtype=np.int64)  # the data units of each item's step
        for k in range(n):
            active = (start <= k) & ~done
            if not active.any():
                continue
            first = active & ((k - start) % G == 0)  # items whose step starts here
            if mode != PARITY and first.any():
                m_ = np.zeros(items, dtype=np.int64)
                for jj in range(min(G, n - k)):
                    m_ |= inside[k + jj].astype(np.int64) << jj
                step_mask[first] = m_[first]
                saving = np.nonzero(first & (m_ != 0))[0]
                if len(saving):
                    for jj in range(min(G, n - k)):
                        for s_ in (0, 1):
                            at = saving[(slot[saving] == s_) & (m_[saving] >> jj & 1 == 1)]
                            for a in range(3):
                                slots[log.plane_of_data(s_, jj, a)][at] = block(a, k + jj)[at]
                    for s_ in (0, 1):
                        at = saving[slot[saving] == s_]
                        for r in range(h):
                            slots[log.plane_of_sums(s_, r)][at] = t[r][at]
                    prog[saving] = mine | step_code(k, m_[saving], slot[saving])
            jj_of = (k - start) % G
            writes = np.nonzero(active & (step_mask >> jj_of & 1 == 1))[0]
            if mode == PARITY:
                writes = writes[:0]
            deltas = [zero] * 3
            if len(writes):
                old = [block(a, k).copy() for a in range(3)]
                new = self._unit_values(u0 + k, 4 * i0, 4 * i1, old)
                if mid is not None and not called and k >= n // 2:
                    # A crash here: unit k's parameters half written, its moments not.
                    half = writes[: len(writes) // 2]
                    block(0, k)[half] = new[0][half]
                    mid()
                    called = True
                deltas = []
                for a in range(3):
                    block(a, k)[writes] = new[a][writes]
                    d = np.zeros((items, 4), dtype=np.uint32)
                    d[writes] = old[a][writes] ^ new[a][writes]
                    deltas.append(d)
            last = active & ((jj_of == G - 1) | (k == n - 1))
            if mode != PARITY:
                slot[last & (step_mask != 0)] ^= 1  # the next data step takes the other slot
            for d in deltas:  # the unit's three columns: param, exp_avg, exp_avg_sq
                for r in range(h):
                    t[r][active] = horner.mul_a_pow(t[r][active], -(b + r)) ^ d[active]
        if not called:
            mid()  # (no unit of the chunk had a value to write halfway)
        if mode != PARITY:
            rest = np.nonzero(~done)[0]
            for r in range(h):
                fin[r][rest] = t[r][rest]
            prog[rest] = mine | DONE
        cut = slice(16 * i0, 16 * i1)  # bytes of every page
        sums = [torch.from_numpy(np.ascontiguousarray(t[r]).reshape(-1).view(np.uint8)) for r in range(h)]
        m = code.horner_coefficients(col0, 3 * n)
        for_device(self.device).matmul(m, sums, [y[cut] for y in scratch], accumulate=True)
        if held:
            tripwire.fire(self.device)

    def _unit_values(self, u: int, e0: int, e1: int, old: list) -> list:
        """Unit ``u``'s new values over elements [e0, e1) of its page (words, [items, 4],
        param, exp_avg, exp_avg_sq) from ``old``: torch's fused kernel on copies of the
        twin's ranges."""
        a0 = u * self.state.unit_elems
        new = [v.copy() for v in old]
        flat = {k: torch.from_numpy(v.reshape(-1).view(np.float32)) for k, v in zip(STATE, new, strict=True)}
        for kind, ranges in self._by_kind([(a0 + e0, a0 + e1)]).items():
            self._adam(kind, ranges, {k: [flat[k][a - a0 - e0 : b - a0 - e0] for a, b in ranges] for k in flat})
        return new

    def _by_kind(self, spans: list[tuple[int, int]]) -> dict[tuple, list]:
        """The segments' element ranges inside ``spans`` ([(start, end)] of the shard's
        elements), grouped by their hyperparameters (``self.exact``)."""
        by_kind: dict[tuple, list] = {}
        for e0, e1 in spans:
            for i in self._segments(e0, e1):
                r = self.table[i]
                a, b = max(int(r["start"]), e0), min(int(r["end"]), e1)
                if a < b:
                    by_kind.setdefault(self.exact[i], []).append((a, b))
        return by_kind

    def _adam(self, kind: tuple, ranges: list, out: dict) -> None:
        """torch's fused Adam/AdamW of hyperparameters ``kind`` stepping ``out``'s tensors
        (param, exp_avg, exp_avg_sq: one per range) with the ranges' gradients."""
        lr, b1, b2, wd, eps, step, adamw = kind
        g = self.state.grad[self.state.shard_start :]
        steps = list(torch.full((len(ranges),), step, dtype=torch.float32))
        kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
        kernel(out["param"], [g[a:b] for a, b in ranges], out["exp_avg"], out["exp_avg_sq"],
               [], steps, amsgrad=False, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
               maximize=False)  # fmt: skip

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
