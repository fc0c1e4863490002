"""The Resumable Model Updater: Pseudocode 1 of the paper, plus its recovery.

Runs in the trainer. One iteration, after forward/backward and the gradient all-reduce:

1. ``protect_grads``: parity of every gradient group, written to host memory
   (marker GRADS_PROTECTED) — before the global sync, so every rank's gradients are
   recoverable before any model state changes.
2. ``sync``: the global norm for clipping (marker SYNCED with the coefficient).
3. ``update``: per protection group of the allocation set: load tier-1 parity into
   device buffer A (LOAD); per chunk: copy the chunk to the undo buffer (UNDO_DONE),
   recompute the chunk from the undo copy with AdamW in place (UPDATE_DONE), scratch
   parity = authoritative parity ⊕ G·(old ⊕ new) (PARITY_DONE), commit = the marker
   names the scratch buffer authoritative (START of the next chunk); then copy the
   parity to host (STORE) and refresh tier 2 (TIER2). Marker DONE ends the iteration.
   UPDATE_DONE and PARITY_DONE are steps, not marker writes: recovery reverts a chunk
   from its undo copy in all three in-flight steps alike, so a chunk costs two writes
   (UNDO_DONE and the commit).

Every step reads only state the previous marker vouches for and writes state no
earlier marker relies on, so redoing a step is harmless: a crash anywhere — or a
marker write torn by the crash, which leaves the previous marker — resumes correctly.

``recover`` runs after a crash, once the pool is localized and everything attached:
it rebuilds the marker's record, reverts an in-flight chunk from the undo buffer,
rebuilds lost pages from whichever parity the marker names authoritative, and returns
the marker so the job-wide rule can decide (``decide``).

``transactions=False`` is the ablation of the paper's Fig. 12: chunks updated in place
without undo or incremental parity, parity re-encoded after each group. It exists to
show that the transactions are necessary; never train with it.

Memory and overlap: the undo, parity and gradient-parity buffers are reusable pool
memory lent to activations during the compute phase (``lent_memory``, CUDA
only; ``leto.memory.lending``). Three parity buffers rotate: group g uses a pair and
the next group's tier-1 parity is prefetched into the third on a copy stream while g's
chunks run; a chunk's scratch parity is initialized on that stream while the optimizer
runs. Kept in stream order, because the marker is one linear record that must not run
ahead of them: the undo copy (the previous chunk's parity update reads the undo
buffer), the parity update (it needs the optimizer's output) and the parity store to
host with the tier-2 refresh (the next group's progress would otherwise be recorded
before this group's parity is durable).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from leto import plugins
from leto.erasure import TwoTierCode
from leto.erasure.pages import PageList, as_pages
from leto.errors import InvalidInput, RetainedStateLost
from leto.integrity import settle
from leto.integrity.recheck import Recheck, words_sum
from leto.integrity.replica import group_digest
from leto.job.config import UNDO_MODES
from leto.memory.client import GroupView, PoolClient
from leto.memory.config import AllocationKind
from leto.memory.errors import PoolFdLimit, RemoteError
from leto.memory.lending import Lender
from leto.plugins import SDC_POINT, Computed, point
from leto.ranges import leto_range
from leto.update import grad_clip, rmu_recovery, steps
from leto.update.chunk_pass import (
    FRESH,
    MAX_CHUNK_UNITS,
    RESUME,
    TAG_LIMIT,
    ChunkPass,
    ItemLog,
    log_bytes,
    not_resumable,
    parts,
    rf_parts,
    slot_items,
)
from leto.update.layout import RetainedModel
from leto.update.loop_record import LoopRecord
from leto.update.marker import (
    BUFFERS,
    Auth,
    Marker,
    MarkerState,
    Phase,
    Step,
    StreamOrderedWrites,
    scratch_buffer,
    start_buffer,
)
from leto.update.optim import (
    AdamWConfig,
    MuonConfig,
    clip_coefficient,
)
from leto.update.schedule import WarmupCosine
from nvbit_tools import tripwire

MARKER_NAME = "rmu.marker"


# A chunk's parameters, when the caller names no chunk size: 64 pages of 2 MiB on CUDA.
# Per chunk the update costs a fixed number of launches and a copy of the H1 parity
# pages, so small chunks multiply host work and parity traffic: at 2 units a chunk a
# 1 B-parameter model took ~1,000 chunks and ~16,000 copies an iteration (the issue
# "The overhead users see"); the incremental parity update reaches its bandwidth at
# ≥ 64 pages a launch (FACTS). The undo buffer (a chunk's pages) is lent to activations.
CHUNK_PARAM_BYTES = 128 << 20


def default_chunk_units(page_bytes: int) -> int:
    """Units per chunk for ``CHUNK_PARAM_BYTES`` of parameters (the layout caps it at a
    group's units)."""
    return max(1, CHUNK_PARAM_BYTES // page_bytes)


@dataclass(frozen=True)
class UpdaterConfig:
    # Units (one parameter page each, plus its state) per chunk; None: default_chunk_units.
    chunk_units: int | None = None
    adamw: AdamWConfig = AdamWConfig()
    transactions: bool = True  # False only for the Fig. 12 ablation
    layerwise: str | None = None  # "muon": 2-D weights by Muon, whole layers per chunk
    muon: MuonConfig = MuonConfig()
    lend_activations: bool = True  # CUDA: the RMU buffers hold forward activations
    # Where a chunk's undo copy comes from (``UNDO_MODES``): "chunk", copied just before
    # the chunk is updated (on the update's critical path); "ahead", the whole retained
    # state copied once an iteration while forward and backward run (``leto run --undo``).
    undo: str = "chunk"


class Updater:
    AHEAD_NAME = "rmu.undo_ahead"  # the whole-state undo copy (--undo ahead)
    LOG_NAME = "rmu.itemlog"  # the resumable pass's progress words and slots

    def __init__(
        self,
        client: PoolClient,
        model: torch.nn.Module,
        schedule: WarmupCosine,
        cfg: UpdaterConfig = UpdaterConfig(),
        shard: tuple[int, int] | None = None,
        user=None,
        swap_data: bool = False,
    ):
        """``swap_data``: the parameters keep their objects (``RetainedModel.bind``).
        ``user``: the script's own optimizer (``leto.update.user_optim.UserOptimizer``)
        in place of ``cfg.adamw`` and ``schedule``; its per-group hyperparameters for the
        iteration being updated are ``self.hparams`` (set before ``update``/``finish``),
        and clipping is the script's own (done in place before its ``step()``)."""
        if cfg.undo not in UNDO_MODES:
            raise ValueError(f"undo={cfg.undo!r}: use {' or '.join(UNDO_MODES)}")
        self.client = client
        self.cfg = cfg
        self.schedule = schedule
        self.user = user
        self.hparams: list[dict] | None = None
        # The optimizer step number of the update (torch's state["step"] after it):
        # updates committed so far + 1 — not the iteration + 1 once a GradScaler skipped
        # steps. None: the iteration + 1.
        self.user_step: int | list[int] | None = None  # a list: per optimizer
        self.user_skip: frozenset = frozenset()  # optimizers whose step a GradScaler skipped
        layerwise = None
        if cfg.layerwise == "muon":
            layerwise = lambda name, p: p.ndim == 2 and not name.startswith(cfg.muon.exclude)  # noqa: E731
        elif cfg.layerwise is not None:
            raise ValueError(
                f"layerwise={cfg.layerwise!r}: the only layer-wise optimizer is 'muon'"
            )
        if user is not None and any(k.layerwise for k in user.kinds):
            layerwise = lambda name, p: user.layerwise(name)  # noqa: E731 - the script's Muon
        chunk_units = cfg.chunk_units or default_chunk_units(client.config.page_bytes)
        self.state = RetainedModel(client, model, chunk_units, shard, layerwise)
        self.params = self.state.bind(model, swap_data)  # by name: the retained parameters
        self.device = self.state.grad.device
        pb = self.state.page_bytes
        h1, h2 = client.config.tier1_pages, client.config.tier2_pages
        self.h1, self.h2 = h1, h2
        max_chunk_pages = self.state.max_chunk_units * self.state.unit
        reusable = AllocationKind.REUSABLE
        undo = client.attach("rmu.undo", max_chunk_pages * pb, kind=reusable)
        self.undo = [undo[i * pb : (i + 1) * pb] for i in range(max_chunk_pages)]
        self._undo_pages = as_pages(undo.view(max_chunk_pages, pb), None, "undo", None)
        self._undo_flat = undo
        self._alloc_pages = {n: client.pages_of(n) for n in self.state.set_names}
        # The fused chunk pass (optimizer + parity delta in one read) where it applies;
        # otherwise the unfused steps, and the reason is kept for the run's log.
        self.chunk_pass, self.chunk_pass_reason = ChunkPass.create(
            self.state, user, h1, self.device
        )
        # --undo ahead: a mirror of every allocation of the set, refilled while forward
        # and backward run (``begin``); a chunk's undo copy is its own offsets there.
        # Never lent to activations: it is written during the compute phase. Not taken
        # where the fused pass cannot run (known now, the same in every generation of
        # the job): the unfused steps copy each chunk anyway (see ``_update_group``), so
        # the whole copy would only add its memory and traffic.
        self.ahead = cfg.undo == "ahead" and cfg.transactions
        self.undo_note: str | None = None  # why not ahead, when asked (the checks line)
        if self.ahead and self.chunk_pass is None:
            self.ahead = False
            self.undo_note = (
                f"--undo ahead not taken: the unfused steps ({self.chunk_pass_reason}) copy "
                "each chunk anyway"
            )
        self._ahead: dict[str, torch.Tensor] = {}
        self._ahead_first: dict[str, int] = {}  # each mirror's first page in the allocation
        self._ahead_done: torch.cuda.Event | None = None
        self._ahead_of: int | None = None  # the iteration whose update the copy serves
        # Set by a trainer that hooks its parameters' gradients (RetainedJob): the copy
        # is then queued when the iteration's first gradient lands, not at its start.
        self.ahead_at_grad = False
        self._ahead_pending: int | None = None  # the iteration whose copy waits for it
        if self.ahead:
            total = sum(t.numel() for t in self._alloc_pages.values())
            try:
                whole = client.attach(self.AHEAD_NAME, total, kind=reusable)
            except (RemoteError, PoolFdLimit) as e:  # the state manager could not make them
                raise InvalidInput(
                    f"--undo ahead: the whole-state copy needs {total / 2**30:.2f} GiB more "
                    f"pool memory, which the pool could not allocate ({e}); nothing of it "
                    f"was kept — run with --undo chunk (the default)"
                ) from e
            off = 0
            for n, t in self._alloc_pages.items():
                self._ahead[n] = whole[off : off + t.numel()]
                self._ahead_first[n] = off // pb
                off += t.numel()
            self._ahead_pages = as_pages(whole.view(-1, pb), None, "undo ahead", None)
        # The resumable pass (where the fused pass runs with the Horner scheme): no undo
        # copy of a chunk; each item's old values go to small slots as it is written
        # (``chunk_pass.ItemLog``). Not under --undo ahead (the whole state is copied
        # there), nor in the ablation. Never lent: a recovery reads it.
        self.log: ItemLog | None = None
        ue = self.state.unit_elems  # (the fused pass's launches: parts of every page)
        self._parts = {False: parts(ue, 2), True: parts(ue, rf_parts())}
        if self.chunk_pass is not None and cfg.transactions and not self.ahead:
            why = not_resumable(h1)
            if why is None and self.state.max_chunk_units > MAX_CHUNK_UNITS:
                why = f"chunks of {self.state.max_chunk_units} units (its record names {MAX_CHUNK_UNITS})"
            if why is None:
                rf = self._parts[True]
                size = -(-log_bytes(pb, h1, rf) // pb) * pb
                self.log = ItemLog(
                    client.attach(self.LOG_NAME, size, kind=reusable), pb, h1, slot_items(rf)
                )
            else:
                self.undo_note = f"not resumable: {why}"
        self._resume_chunk: tuple[int, int] | None = None  # (group, chunk) a finish resumes
        par = client.attach("rmu.parity", len(BUFFERS) * h1 * pb, kind=reusable)
        self.buf = {
            b: [par[(k * h1 + i) * pb : (k * h1 + i + 1) * pb] for i in range(h1)]
            for k, b in enumerate(BUFFERS)
        }
        # Each buffer's pages are adjacent: moved as one copy (see _copy).
        self._buf_flat = {b: par[k * h1 * pb : (k + 1) * h1 * pb] for k, b in enumerate(BUFFERS)}
        gp = client.attach("rmu.gradparity", (h1 + h2) * pb, kind=reusable)
        self.gradparity = [gp[i * pb : (i + 1) * pb] for i in range(h1 + h2)]
        self._gp_flat = gp
        record = client.attach(MARKER_NAME, 128, kind=AllocationKind.RECORD)
        # The script's loop state (hyperparameters per iteration), after every other
        # allocation so group numbers stay those of a job without it.
        self.loop = LoopRecord(client) if user is not None else None
        self.views = client.layout()
        if self.loop is not None:
            self.loop.bind(self.views)
        self.groups = self.state.set_groups(self.views)
        # Every group's host parity (tier 1, then tier 2) is one mapping: moved whole.
        self._host_parity = {g.gid: client.parity_mapping(g.gid) for g in self.views}
        plugins.expose_retained(lambda: self.groups)  # fault tools' view of the state
        self.grad_groups = RetainedModel.groups_of(self.views, "grad")
        self.record_group = RetainedModel.groups_of(self.views, MARKER_NAME)[0]
        if len(self.record_group.tier1) != 1:
            # The marker mirrors its bytes into the parity pages, valid for XOR parity only.
            raise ValueError(
                "the marker needs record_parity_pages=1 (XOR parity) in the pool config"
            )
        writes = None
        if self.device.type == "cuda":
            # Page-lock host parity and the marker: parity moves by async DMA and the
            # marker is written in stream order, with no host synchronization per step.
            client.register_host(record)
            for g in self.views:
                client.register_host(client.parity_mapping(g.gid))
            writes = StreamOrderedWrites(self.device)
        mirrors = [*self.record_group.tier1, *self.record_group.tier2]
        self.marker = Marker(record, mirrors, stream_writes=writes)
        self.lender = None
        self.copy_stream = None
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
            if cfg.lend_activations:
                self.lender = Lender([undo, par, gp])
        self._prefetched: int | None = None  # group whose parity is in its start buffer
        self._prefetch_done: torch.cuda.Event | None = None
        self._codes: dict[int, TwoTierCode] = {}
        self._stale: set[Auth] = set()  # parity buffers whose pages were lost (recovery)
        self.profile: defaultdict[str, float] | None = None  # seconds per step kind, if set
        self._page_lists: dict = {}  # see _pages
        # Undo-buffer pages in the group order of a chunk's pages (allocation-major
        # in the buffer, so each allocation's run is one contiguous copy).
        self._undo_order = self._undo_page_order()
        self._fused: ChunkPass | None = None
        # Replica agreement (leto.integrity.replica): when on, each group's final tier-1
        # parity of an update is reduced to one word on the device, in stream order.
        self.digest_on = False
        self.digests = torch.zeros(len(self.groups), dtype=torch.int64, device=self.device)
        self._digested = [False] * len(self.groups)
        # The update recheck (leto.integrity.recheck), where no replica checks this rank's
        # update: set by the trainer. Chunks are numbered over every group.
        self.recheck: Recheck | None = None
        self._chunk_base = [0]
        for gi in range(len(self.groups)):
            self._chunk_base.append(self._chunk_base[-1] + len(self.state.chunks(gi)))
        if self.log is not None and self._chunk_base[-1] >= 1 << 16:
            raise InvalidInput(
                f"{self._chunk_base[-1]} chunks an update: the resumable pass names at most "
                f"65,535 (give a larger chunk size)"
            )
        # The gradients' tier-1 parity taken in the script's clip_grad_norm_ pass
        # (leto.update.grad_clip): made by the trainer where it applies (the reason
        # where it does not; the trainer adds its own).
        self.clip_parity: grad_clip.ClipParity | None = None
        self.clip_parity_reason = grad_clip.unsupported(self)

    @property
    def digest_complete(self) -> bool:
        """Whether the last update digested every state group (not when a recovery
        finished it from a later group, nor in the in-place ablation)."""
        return self.digest_on and all(self._digested)

    # -- helpers --------------------------------------------------------------------

    @property
    def undo_path(self) -> str:
        """Where a chunk's undo copy comes from, for the checks line."""
        if self.ahead:
            n = sum(t.numel() for t in self._ahead.values())
            size = f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
            when = (
                "queued at the iteration's first gradient (LETO_UNDO_AHEAD_AT=grad)"
                if self.ahead_at_grad
                else "queued at the iteration's start"
            )
            return f"whole state ({size}) copied during forward and backward, {when} (--undo ahead)"
        rc = self.recheck
        if self.log is not None and rc is not None and self.user is not None and rc.every:
            return "per chunk, before its update (the update recheck restores every chunk from it)"
        if self.log is not None:
            n = sum(t.numel() * t.element_size() for t in (self.log.progress, self.log.slots, self.log.fin))
            return (
                f"none: the fused pass keeps each item's old values in slots as it writes "
                f"them ({n / 2**20:.0f} MiB, resumable item by item); an undo copy only "
                f"for a chunk the update recheck samples; {self._ahead_memory()}"
            )
        note = f" ({self.undo_note})" if self.undo_note else ""
        return f"per chunk, before its update{note}"

    def _ahead_memory(self) -> str:
        """Why the default and not --undo ahead, in memory: the whole-state copy's size,
        the device's free memory now, and what was measured (the checks line)."""
        total = sum(t.numel() * t.element_size() for t in self._alloc_pages.values())
        free = ""
        if self.device.type == "cuda":
            free = f", {torch.cuda.mem_get_info(self.device)[0] / 2**30:.1f} GiB of the device free now"
        return (
            f"--undo ahead would hold a whole-state copy of {total / 2**30:.2f} GiB{free}, "
            f"and was slower on the user path on an H100 (docs/update.md)"
        )

    @property
    def grad_parity_path(self) -> str:
        """Where the gradients' tier-1 parity is taken (the checks line)."""
        cp = self.clip_parity
        if cp is not None and cp.off is None:
            return f"in clip_grad_norm_'s pass over them ({cp.name}), else at the step"
        why = cp.off if cp is not None else self.clip_parity_reason
        return f"at the step ({why})"

    @property
    def update_path(self) -> str:
        """What updates the chunks: the fused pass (its name) or the unfused steps and
        why (as of the last update)."""
        if self.chunk_pass is not None and self.chunk_pass_reason is None:
            return self.chunk_pass.name
        return f"unfused steps ({self.chunk_pass_reason})"

    def code(self, g: GroupView) -> TwoTierCode:
        n = len(g.data)
        if n not in self._codes:
            self._codes[n] = TwoTierCode(n, self.h1, self.h2)
        return self._codes[n]

    def lent_memory(self):
        """Context for forward and backward: their activations live in the RMU's buffers."""
        return self.lender.lend() if self.lender is not None else contextlib.nullcontext()

    def _side(self):
        """Context that runs work on the copy stream after everything queued so far."""
        if self.copy_stream is None:
            return contextlib.nullcontext()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.copy_stream)

    def _side_done(self) -> torch.cuda.Event | None:
        if self.copy_stream is None:
            return None
        return self.copy_stream.record_event()

    def _wait(self, ev: torch.cuda.Event | None) -> None:
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _undo_page_order(self) -> list[int]:
        order, base = [], []
        acc = 0
        for up in self.state.unit_pages:
            base.append(acc)
            acc += up * self.state.max_chunk_units
        for u in range(self.state.max_chunk_units):
            for k, up in enumerate(self.state.unit_pages):
                order += [base[k] + u * up + i for i in range(up)]
        return order

    def _chunk(
        self, gi: int, j: int
    ) -> tuple[tuple[int, int], list[torch.Tensor], list[torch.Tensor]]:
        units = self.state.chunks(gi)[j]
        first, count = self.state.chunk_pages(gi, units)
        g = self.groups[gi]
        # Slices of checked page lists (the group's, the undo buffer's): no per-page
        # checks when a chunk's lists are first built (a promoted trainer's first update).
        pages = (g.data_pages if g.data_pages is not None else g.data)[first : first + count]
        n_units = units[1] - units[0]
        if self.ahead:
            return units, pages, self._ahead_chunk_pages(units)
        undo = self._page_lists.get(("undo order", n_units))
        if undo is None:  # the same for every chunk of n_units
            undo = self._undo_pages.take(self._undo_page_order_for(n_units))
            self._page_lists[("undo order", n_units)] = undo
        return units, pages, undo

    def _ahead_chunk_pages(self, units: tuple[int, int]) -> PageList:
        """A chunk's undo pages in the whole-state copy, in the group order of its pages
        (unit by unit, each allocation's pages of the unit)."""
        key = ("ahead", units)
        pl = self._page_lists.get(key)
        if pl is None:
            order = []
            for u in range(*units):
                for name, up in zip(self.state.set_names, self.state.unit_pages, strict=True):
                    first = self._ahead_first[name] + u * up
                    order += range(first, first + up)
            pl = self._page_lists[key] = self._ahead_pages.take(order)
        return pl

    def ahead_pages_of(self, units: tuple[int, int]) -> list[int]:
        """The pages of the whole-state copy holding a chunk's undo copy (--undo ahead)."""
        out = []
        for name, up in zip(self.state.set_names, self.state.unit_pages, strict=True):
            first = self._ahead_first[name]
            out += range(first + units[0] * up, first + units[1] * up)
        return out

    def undo_runs(self, units: tuple[int, int]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(allocation, live bytes, undo bytes) of a chunk, one contiguous run per
        allocation (the chunk's pages of one allocation are adjacent in its mapping):
        the undo copy is allocation-major in the per-chunk buffer, or at the chunk's own
        offsets in the whole-state copy (--undo ahead)."""
        pb = self.state.page_bytes
        u0, u1 = units
        base, out = 0, []
        for name, up in zip(self.state.set_names, self.state.unit_pages, strict=True):
            n, lo = (u1 - u0) * up * pb, u0 * up * pb
            live = self._alloc_pages[name][lo : lo + n]
            if self.ahead:
                saved = self._ahead[name][lo : lo + n]
            else:
                saved = self._undo_flat[base * pb : base * pb + n]
            out.append((name, live, saved))
            base += up * self.state.max_chunk_units
        return out

    def _runs_copy(self, units: tuple[int, int], to_undo: bool, hook_it: int | None = None) -> None:
        """Copy a chunk between its pages and its undo copy (``undo_runs``)."""
        for k, (_, live, saved) in enumerate(self.undo_runs(units)):
            if hook_it is not None and k == 1:
                point("update.undo", hook_it)  # a crash here leaves the undo copy half done
            (saved if to_undo else live).copy_(live if to_undo else saved)

    def take_ahead(self, iteration: int, hook: bool = True) -> None:
        """--undo ahead: the whole retained state into its mirror, on the copy stream
        beside forward and backward; ``update`` waits for it before writing a chunk.
        ``iteration``: the one whose update it serves."""
        with leto_range("undo ahead"), self._side():
            for k, (name, live) in enumerate(self._alloc_pages.items()):
                if hook and k == 1:
                    # A crash here leaves the copy half done, in the compute phase: the
                    # iteration is redone and copies again.
                    point("update.undo", iteration)
                self._ahead[name].copy_(live, non_blocking=True)
        self._ahead_done = self._side_done()
        self._ahead_of = iteration

    def _pages(self, key, tensors: list[torch.Tensor]) -> PageList:
        """The codec's checked page list for a fixed set of this process's pages, built
        once: the checks cost ~4 µs a page in Python, ~1.5 ms for a 64-unit chunk, and
        the chunks, buffers and groups of a trainer never move while it lives."""
        pl = self._page_lists.get(key)
        if pl is None:
            pl = as_pages(tensors, None, str(key), None)
            self._page_lists[key] = pl
        return pl

    def _undo_page_order_for(self, n_units: int) -> list[int]:
        # A short last chunk uses the same layout, cut to its units.
        return self._undo_order[: n_units * self.state.unit]

    def _write(self, state: MarkerState) -> MarkerState:
        with self._span("marker"):
            return self.marker.write(state)

    @contextlib.contextmanager
    def _span(self, name: str):
        """Time a step when profiling (benchmarks): device work is waited for. Always a
        named range in a torch.profiler trace (``leto.ranges``)."""
        if self.profile is None:
            with leto_range(name):
                yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profile[name] += time.perf_counter() - t0

    def _copy(
        self, dst: torch.Tensor, src: torch.Tensor, hook: str | None = None, it: int = 0
    ) -> None:
        """Copy adjacent pages (a parity buffer, a group's host parity) in at most two
        copies, whatever H1: the steady iteration's launches do not grow with the pages.
        With a ``hook``, the crash point sits after the first half of the pages, as the
        page-by-page copy had it (a crash there leaves the copy half done)."""
        if hook is None:
            dst.copy_(src, non_blocking=True)  # async only between the GPU and page-locked memory
            return
        pb = self.state.page_bytes
        cut = dst.numel() // pb // 2 * pb
        if cut:
            dst[:cut].copy_(src[:cut], non_blocking=True)
        point(hook, it, dest=[dst])
        if tripwire.armed():  # faultkit kernel-abort: the rest lands partially
            tripwire.land([dst[cut:]], [src[cut:]])
        dst[cut:].copy_(src[cut:], non_blocking=True)

    def _host_tier(self, g: GroupView, tier: int) -> torch.Tensor:
        """Group ``g``'s host tier-1 (``tier=1``), tier-2 (2) or both (0) pages, flat."""
        pb = self.state.page_bytes
        n1, n2 = len(g.tier1), len(g.tier2)
        a, b = {0: (0, n1 + n2), 1: (0, n1), 2: (n1, n1 + n2)}[tier]
        return self._host_parity[g.gid][a * pb : b * pb]

    # -- the iteration --------------------------------------------------------------

    def begin(self, iteration: int, zero_grads: bool = True) -> None:
        """``zero_grads`` False: the gradients land by copy this iteration (the trainer's
        ``leto.trainer.grad_landing``): the buffer is not zeroed."""
        self._write(MarkerState(iteration, Phase.COMPUTE))
        if zero_grads:
            self.state.grad.zero_()
        if self.ahead:
            # Nothing writes the state between here and the update (the scrub's repairs
            # and ZeRO-1's gather come before): the copy is every chunk's undo copy.
            # Queued here, it ran alone, not beside forward and backward (on an H100,
            # 2026-12-05: under 0.1 ms of its 8.75 overlapped); where the trainer hooks
            # the gradients (LETO_UNDO_AHEAD_AT=grad) it is queued at the first one
            # instead (``ahead_at_first_grad``).
            if self.ahead_at_grad:
                self._ahead_pending = iteration
            else:
                self.take_ahead(iteration)

    def ahead_at_first_grad(self) -> None:
        """--undo ahead: a gradient of the iteration has landed (a hook in backward, or
        the update itself when none did): the copy its update waits for is queued now,
        once an iteration, on the copy stream after everything queued so far."""
        t, self._ahead_pending = self._ahead_pending, None
        if t is not None:
            self.take_ahead(t)

    def protect_grads(self, iteration: int, loss: float | torch.Tensor = float("nan")) -> None:
        """``loss``: a float, or a device tensor (on a GPU with stream-ordered marker
        writes the marker copies it from the device: the host does not wait for it)."""
        if isinstance(loss, torch.Tensor):
            if self.marker.stream_writes is not None and loss.device == self.device:
                self.marker.device_loss = (iteration, loss.detach().reshape(()).double())
                loss = float("nan")
            else:
                loss = float(loss.detach())
        if self.lender is not None:
            self.lender.reclaim()  # no activation may still live in the buffers
        # Taken in the script's clip_grad_norm_ where the gradients were not written since
        # (leto.update.grad_clip); checked against a fresh encode now and then.
        cp = self.clip_parity
        ahead = cp.parity(iteration) if cp is not None else None
        audit = ahead is not None and cp.audit_due()
        if ahead is not None:
            cp.used += 1
        for gi, g in enumerate(self.grad_groups):
            code = self.code(g)
            t1 = self.gradparity[: self.h1]
            t2 = self.gradparity[self.h1 :]
            with self._span("grad parity encode"):
                if ahead is not None and not audit:
                    for dst, src in zip(t1, ahead[gi], strict=True):
                        dst.copy_(src)
                else:
                    code.tier1.encode(
                        self._pages(("grad", g.gid), g.data_pages or g.data),
                        out=self._pages("gp1", t1),
                        group=g.gid,
                    )
                    if audit:
                        cp.audit(gi, t1)
                code.tier2.encode(self._pages("gp1", t1), out=self._pages("gp2", t2), group=g.gid)
            with self._span("grad parity to host"):
                self._copy(self._host_tier(g, 0), self._gp_flat, "grad_parity", iteration)
        self._write(MarkerState(iteration, Phase.GRADS_PROTECTED, loss=loss))

    def clip(self) -> torch.Tensor:
        """The clipping coefficient, computed per parameter as clip_grad_norm_ does (1
        under the script's own optimizer: the script clipped, or not, already)."""
        if self.user is not None:
            return torch.ones((), dtype=torch.float32, device=self.device)
        grads = [
            self.state.grad[s.offset : s.offset + s.numel].view(s.shape) for s in self.state.slots
        ]
        return clip_coefficient(grads, self.cfg.adamw.max_grad_norm, self.cfg.adamw.clip_foreach)

    def sync(self, iteration: int, group=None) -> float:
        """Global norm at the global synchronization; returns the clipping coefficient."""
        if self.user is not None:
            # The script clipped: the coefficient is 1, and nothing here waits for the
            # device, so the host queues the update while backward still runs. The
            # collective stays the barrier, in stream order: no update kernel of any
            # rank runs before every rank's gradients are protected.
            if group is not None:
                import torch.distributed as dist

                dist.all_reduce(torch.ones((), device=self.device), group=group)
            point("sync", iteration)
            self._write(self.marker.state.but(phase=Phase.SYNCED, clip=1.0))
            return 1.0
        coef = self.clip()
        if group is not None:
            import torch.distributed as dist

            # Replicated gradients give every rank the same coefficient; the collective
            # is the barrier after which no rank is still computing this iteration.
            dist.all_reduce(coef, op=dist.ReduceOp.MAX, group=group)
        point("sync", iteration)
        self._write(self.marker.state.but(phase=Phase.SYNCED, clip=float(coef)))
        return float(coef)

    def finish(self, m: MarkerState) -> None:
        """Finish the update of ``m.iteration`` after a crash (job-wide rule "finish").

        A rank that had only protected its gradients computes the clipping coefficient
        locally: gradients are replicated, so the local norm is the global one, and the
        other ranks need not join a collective they may already be past.
        """
        if m.phase is Phase.GRADS_PROTECTED:
            m = self._write(m.but(phase=Phase.SYNCED, clip=float(self.clip())))
        if self.ahead:
            # The crashed trainer's copy may be half done or have lost pages; the state
            # now (an in-flight chunk reverted, lost pages rebuilt) is the old state of
            # every chunk still to update. Committed chunks' copies are never read again.
            self.take_ahead(m.iteration, hook=False)
        self.update(m.iteration, resume=m if m.phase is Phase.UPDATE else None)

    def update(self, iteration: int, resume: MarkerState | None = None) -> None:
        m = resume if resume is not None else self.marker.state
        self._digested = [False] * len(self.groups)
        if self.ahead:
            if self._ahead_pending == iteration:
                self.ahead_at_first_grad()  # no gradient landed (no backward): now
            if self._ahead_of != iteration:
                raise RuntimeError(
                    f"update({iteration}) under --undo ahead without the state copied for "
                    f"it (begin or finish copies it; the copy serves {self._ahead_of})"
                )
            # No chunk is written (and no UPDATE marker, which vouches for the copy
            # at recovery) before the whole-state copy has landed.
            self._wait(self._ahead_done)
        self._resume_chunk = None
        if self.log is not None:
            if m.phase is Phase.UPDATE and m.step is Step.START:
                self._resume_chunk = (m.group, m.chunk)  # perhaps cut short item by item
            elif m.phase is not Phase.UPDATE:
                # No progress word of an earlier update (or an earlier life of the job's
                # iterations, after a checkpoint) may name a chunk of this one.
                self.log.progress.zero_()
        if m.phase is not Phase.UPDATE:
            m = m.but(
                iteration=iteration,
                phase=Phase.UPDATE,
                step=Step.LOAD,
                auth=Auth.HOST,
                group=0,
                chunk=0,
            )
        # The coefficient as clip_grad_norm_ holds it: a float32 tensor (stored exactly
        # in the marker's float64). Not made for the script's optimizer (which clipped
        # already): a blocking copy to the device would stall the host here.
        clip = None
        self._fused = None  # the chunk pass, when it takes this update
        if self.user is None:
            clip = torch.tensor(m.clip, dtype=torch.float32, device=self.device)
        elif self.chunk_pass is not None:
            if self.hparams is None:
                raise RuntimeError("the updater has no hyperparameters for this iteration")
            step = self.user_step if self.user_step is not None else iteration + 1
            why = self.chunk_pass.prepare(self.hparams, step, self.user_skip)
            self._fused = self.chunk_pass if why is None else None
            self.chunk_pass_reason = why
        for gi in range(m.group, len(self.groups)):
            start = m if gi == m.group else m.but(step=Step.LOAD, auth=Auth.HOST, group=gi, chunk=0)
            if self.cfg.transactions:
                self._update_group(iteration, gi, start, clip)
            else:
                self._update_group_in_place(iteration, gi, start, clip)
        # A parity buffer lost in a crash is written again before any later update reads
        # it (each group's update fills its buffers first): only the update resumed
        # after the crash had to avoid it.
        self._stale.clear()
        self._write(m.but(phase=Phase.DONE))

    def _update_group(self, it: int, gi: int, m: MarkerState, clip: torch.Tensor) -> None:
        g = self.groups[gi]
        code = self.code(g)
        base = m.but(step=Step.LOAD, auth=Auth.HOST, group=gi, chunk=0)
        first_buf = start_buffer(gi)
        if m.step is Step.LOAD:
            with self._span("parity to device"):
                if self._prefetched == gi:
                    point("update.load", it)
                    self._wait(self._prefetch_done)
                else:
                    self._copy(self._buf_flat[first_buf], self._host_tier(g, 1), "update.load", it)
            m = self._write(base.but(step=Step.START, auth=first_buf, chunk=0))
        self._prefetched = None
        if gi + 1 < len(self.groups) and m.step is Step.START and m.chunk == 0:
            # The next group's host tier 1 is authoritative and untouched until its own
            # store; its start buffer is outside this group's pair.
            nxt = self.groups[gi + 1]
            with self._span("parity prefetch"), self._side():
                self._copy(self._buf_flat[start_buffer(gi + 1)], self._host_tier(nxt, 1))
            self._prefetch_done = self._side_done()
            self._prefetched = gi + 1
        n_chunks = len(self.state.chunks(gi))
        while (
            m.step in (Step.START, Step.UNDO_DONE, Step.UPDATE_DONE, Step.PARITY_DONE)
            and m.chunk < n_chunks
        ):
            j, x = m.chunk, m.auth
            y = scratch_buffer(gi, x)
            units, pages, undo = self._chunk(gi, j)
            fresh_undo = False
            scratch_event, scratch_copied = None, False
            if m.step is Step.START and self._resumable(it, gi, j):
                # No undo copy and no UNDO_DONE: a crash in the pass is resumed item by
                # item from the item log (recovery: rmu_recovery).
                with leto_range("scratch parity copy"), self._side():
                    self._copy(self._buf_flat[y], self._buf_flat[x])
                scratch_event = self._side_done()
                mode = RESUME if self._resume_chunk == (gi, j) else FRESH
                self._resume_chunk = None
                point("update.undo", it)  # where the copy was: a crash leaves the chunk as it was
                with self._span("chunk pass"):
                    self._wait(scratch_event)
                    self._chunk_pass(it, gi, j, units, y, pages, mode)
                point("update.commit", it)
                m = self._write(m.but(step=Step.START, chunk=j + 1, auth=y))
                continue
            if m.step is Step.START and self.ahead and self._fused is not None:
                # The whole-state copy is the chunk's undo copy: no copy, no marker
                # write (recovery reverts a START chunk from it under --undo ahead). The
                # unfused steps still copy (below), into the same place: their parity
                # change reads the old values from the copy, which must be those the
                # chunk holds now, or a page changed since begin would be absorbed.
                fresh_undo = True
                m = m.but(step=Step.UNDO_DONE)
            if m.step is Step.START:
                with self._span("undo copy"):
                    self._runs_copy(units, to_undo=True, hook_it=it)
                fresh_undo = True
                m = self._write(m.but(step=Step.UNDO_DONE))
            if m.step is Step.UNDO_DONE:
                # The scratch buffer starts as a copy of the authoritative parity; that
                # needs nothing from the optimizer, so it runs beside it.
                with leto_range("scratch parity copy"), self._side():
                    self._copy(self._buf_flat[y], self._buf_flat[x])
                scratch_event, scratch_copied = self._side_done(), True
                if self._fused is not None:
                    with self._span("chunk pass"):
                        if not fresh_undo:  # resumed after a crash: start from the undo copy
                            self._runs_copy(units, to_undo=False)
                        self._wait(scratch_event)
                        self._chunk_pass(it, gi, j, units, y, pages)
                    if self._settling(it, gi, j):  # disagreed before the rollback
                        self._settle(it, gi, j, units, (x, y), pages, undo)
                    else:
                        self._recheck(it, gi, j, units)  # (parity has absorbed the pass)
                    m = m.but(step=Step.PARITY_DONE)  # not written: see UPDATE_DONE below
            if m.step is Step.UNDO_DONE:
                with self._span("optimizer"):
                    if not fresh_undo:
                        # Resuming after a crash: the chunk may be half updated, so start
                        # again from the old values in the undo buffer.
                        self._runs_copy(units, to_undo=False)
                    self._optimizer(it, units, clip)
                # Not written: recovery treats UPDATE_DONE and PARITY_DONE exactly as
                # UNDO_DONE (the chunk is reverted from its undo copy and redone, the
                # authoritative parity untouched), so two stream-ordered writes per chunk
                # would buy nothing. A marker holding them is still understood.
                m = m.but(step=Step.UPDATE_DONE)
            if m.step is Step.UPDATE_DONE:
                with self._span("parity update"):
                    if scratch_copied:
                        self._wait(scratch_event)
                    else:  # resumed after the optimizer: copy now
                        self._copy(self._buf_flat[y], self._buf_flat[x])
                    point("update.parity", it)
                    point(SDC_POINT, it, dest=pages)  # a wrong value here, parity agrees
                    if self._settling(it, gi, j):  # disagreed before the rollback
                        self._settle(it, gi, j, units, None, pages, undo)
                    else:
                        self._recheck(it, gi, j, units)  # before parity absorbs the values
                    first, _ = self.state.chunk_pages(gi, units)
                    code.tier1.update(
                        self._pages(y, self.buf[y]),
                        first,
                        self._pages(("undo", gi, j), undo),
                        self._pages(("chunk", gi, j), pages),
                        group=g.gid,
                    )
                m = m.but(step=Step.PARITY_DONE)  # not written either: see UPDATE_DONE
            point("update.commit", it)
            m = self._write(m.but(step=Step.START, chunk=j + 1, auth=y))
        if m.step in (Step.START, Step.STORE):
            if self.digest_on:
                # The group's whole tier-1 parity after its last chunk, read where it is:
                # no state is read again.
                with leto_range("replica digest"):
                    self.digests[gi] = group_digest(self._buf_flat[m.auth])
                self._digested[gi] = True
            if m.step is Step.START:
                m = self._write(m.but(step=Step.STORE))
            with self._span("parity to host"):
                self._copy(self._host_tier(g, 1), self._buf_flat[m.auth], "update.store", it)
            # Host tier 1 is now authoritative; the buffer still holds the same bytes.
            m = self._write(m.but(step=Step.TIER2))
        if m.step is Step.TIER2:
            point("update.tier2", it)
            with self._span("tier-2 refresh"):
                self._refresh_tier2(g, m.auth)

    def _resumable(self, it: int, gi: int, j: int) -> bool:
        """Whether chunk ``j`` of group ``gi`` takes the resumable pass this update: not
        one the update recheck samples or a settlement redoes (they read its undo copy)."""
        if self.log is None or self._fused is None:
            return False
        rc = self.recheck
        if rc is not None and self.user is not None:
            if rc.due(it, self._chunk_base[gi] + j) or rc.must_settle(it, gi, j):
                return False
        return True

    def log_tag(self, it: int, gi: int, j: int) -> int:
        """The progress words' tag of chunk ``j`` of group ``gi`` in iteration ``it``'s
        update (the words are cleared before each update: this tells chunks apart)."""
        tag = ((it % ((1 << 23) - 1) + 1) << 16) | (self._chunk_base[gi] + j)
        assert 0 < tag < TAG_LIMIT
        return tag

    def _chunk_pass(
        self, it: int, gi: int, j: int, units, y: Auth, pages, mode: int | None = None
    ) -> None:
        """The fused pass on the chunk in parts of its pages, one launch each (``parts``:
        a crash point halfway leaves the chunk half updated), its parity change
        accumulated into scratch buffer ``y``; then the parity step's crash point.
        ``mode``: the resumable pass's (FRESH or RESUME), None for the pass after an undo
        copy; the CPU twin of the resumable pass has its crash point inside its first
        part, with a unit half written."""
        code = self.code(self.groups[gi])
        first, _ = self.state.chunk_pages(gi, units)
        part_list = self.parts(resumable=mode is not None)
        scratch = self._pages(y, self.buf[y]).pages
        live = self._pages(("chunk", gi, j), pages).pages

        gid = self.groups[gi].gid

        def parity_update(ys, col0, old, new):  # the CPU twin's
            code.tier1.update(ys, col0, old, new, group=gid)

        def absorb(old, new):
            code.tier1.update(scratch, first, old, new, group=gid)

        inside = mode is not None and self.device.type != "cuda"
        log = dict(log=self.log, tag=self.log_tag(it, gi, j), mode=mode) if mode is not None else {}
        for k, part in enumerate(part_list):
            if k == len(part_list) // 2 and k and not inside:
                point("update.optimizer", it)  # a crash here leaves the chunk half updated
            if inside:
                log["mid"] = (lambda: point("update.optimizer", it)) if k == 0 else None
            self._fused.run(units, part, first, scratch, code.tier1, live, parity_update, **log)
        # The pass (the CUDA kernel and its CPU twin alike) absorbed its values into
        # parity as it computed them: a wrong value emulated here is folded in too
        # (``absorb``), so parity agrees with it, as with a pass that computed it wrong.
        point(SDC_POINT, it, dest=Computed(live, absorb))
        if len(part_list) == 1 and not inside:
            point("update.optimizer", it)
        point("update.parity", it)

    def parts(self, resumable: bool) -> list[tuple[int, int]]:
        """The element ranges of every page the fused pass runs a chunk in, one launch
        each: the first and second half, or for the resumable pass ``rf_parts()`` parts,
        fixed when the updater is made (its item log's slots hold one part's items, at
        the item's place in the part; a recovery runs the same parts)."""
        return self._parts[resumable]

    def _refresh_tier2(self, g: GroupView, x: Auth) -> None:
        """Tier 2 from the tier-1 bytes, computed on the device, then copied to host."""
        if x in self._stale:  # the buffer was lost: stage host tier 1 instead
            if self.device.type == "cuda":
                # Host tier 1 may still be landing from this update's store, a copy
                # queued on the stream and not waited for: the host reads it only after.
                torch.cuda.current_stream(self.device).synchronize()
            src = list(torch.stack(g.tier1).to(self.device))
        else:
            src = self.buf[x]
        t2 = self.gradparity[self.h1 :]  # idle during the update phase
        if src is self.buf[x]:
            src = self._pages(x, src)
        self.code(g).tier2.encode(src, out=self._pages("gp2", t2), group=g.gid)
        self._copy(self._host_tier(g, 2), self._gp_flat[self.h1 * self.state.page_bytes :])

    def _optimizer(self, it: int, units: tuple[int, int], clip: torch.Tensor) -> None:
        """The unfused optimizer step of a chunk (``leto.update.steps``)."""
        steps.optimizer(self, it, units, clip)

    def _recheck(self, it: int, gi: int, j: int, units: tuple[int, int]) -> None:
        """The update recheck of chunk ``j`` of group ``gi``, when it is the sampled one:
        the chunk's state summed, restored from its undo copy, stepped again by the
        script's optimizer, summed again; the comparison is read later."""
        rc = self.recheck
        if rc is None or self.user is None or not rc.due(it, self._chunk_base[gi] + j):
            return
        pb, (u0, u1) = self.state.page_bytes, units
        regions = [
            self._alloc_pages[name][u0 * up * pb : u1 * up * pb]
            for name, up in zip(self.state.set_names, self.state.unit_pages, strict=True)
        ]
        with leto_range("update recheck"):
            first = words_sum(regions)
            self._runs_copy(units, to_undo=False)
            self._user_step(it, units, points=False)
            rc.compared(it, gi, j, first, words_sum(regions))

    def _settling(self, it: int, gi: int, j: int) -> bool:
        rc = self.recheck
        return rc is not None and self.user is not None and rc.must_settle(it, gi, j)

    def _settle(self, it: int, gi: int, j: int, units, fused_bufs, pages, undo) -> None:
        settle.chunk(self, it, gi, j, units, fused_bufs, pages, undo)

    def _user_step(self, it: int, units: tuple[int, int], points: bool = True) -> None:
        """The script's optimizer on a chunk (``leto.update.steps``; a method, so a test can
        make it compute wrongly)."""
        steps.user_step(self, it, units, points)

    def _user_halves(self, units: tuple[int, int]) -> list:
        return steps.user_halves(self, units)

    def _adamw(self, fn, it: int, lr: float, ranges: list, clip: torch.Tensor) -> None:
        steps.adamw(self, fn, it, lr, ranges, clip)

    def _update_group_in_place(self, it: int, gi: int, m: MarkerState, clip: torch.Tensor) -> None:
        """Ablation: no undo, no incremental parity (Fig. 12's 'pool and parity only')."""
        g = self.groups[gi]
        n_chunks = len(self.state.chunks(gi))
        j = m.chunk if m.step is Step.START else 0
        for jj in range(j, n_chunks):
            self._write(m.but(step=Step.START, auth=Auth.HOST, group=gi, chunk=jj))
            units, _, _ = self._chunk(gi, jj)
            self._optimizer(it, units, clip)
        point("update.store", it)
        self.code(g).tier1.encode(g.data, out=self.buf[Auth.A], group=g.gid)
        self._copy(self._host_tier(g, 1), self._buf_flat[Auth.A])
        self._refresh_tier2(g, Auth.A)

    # -- recovery -------------------------------------------------------------------

    def initialize(self, init_fn, iteration: int = -1) -> None:
        """First start of a fresh pool: initialize parameters (``init_fn``: fresh
        weights, or a checkpoint's state ending ``iteration``), protect everything."""
        with torch.no_grad():
            init_fn()
            if self.state.shard is not None:
                self.state.load_shard()
            elif self.state.master:
                self.state.flat["master"].copy_(self.state.flat["param"].float())
        self.client.encode_parity()
        self._write(MarkerState(iteration, Phase.DONE))

    def recover(self, report: dict) -> MarkerState | None:
        """Rebuild this rank's retained state to the state its marker names
        (``leto.update.rmu_recovery``)."""
        return rmu_recovery.recover(self, report)

    def _recover_in_flight(
        self, m: MarkerState, g: GroupView, lost: dict | None, failed: dict
    ) -> MarkerState:
        return rmu_recovery.recover_in_flight(self, m, g, lost, failed)


def decide(markers: list[MarkerState]) -> tuple[str, int]:
    """The job-wide rule. Returns ("finish", t) — every rank still in iteration t has
    protected gradients, so each finishes update t from its marker — or ("redo", t):
    some rank had not protected its gradients, so every rank redoes t from its start."""
    t = min(m.next_iteration() for m in markers)
    behind = [m for m in markers if m.next_iteration() == t]
    if all(m.phase in (Phase.GRADS_PROTECTED, Phase.SYNCED, Phase.UPDATE) for m in behind):
        return "finish", t
    if any(m.phase is Phase.UPDATE and m.iteration == t for m in markers):
        raise RetainedStateLost(
            f"a rank is updating iteration {t} while another has not protected its gradients"
        )
    return "redo", t
