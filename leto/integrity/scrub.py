"""Scrubbing: the retained state checked against both parity tiers, between iterations.

Runs in the trainer. Parity repairs pages it is *told* are lost; nothing else notices a
page whose bytes changed silently (a bit flip ECC missed, a stray write). The scrubber
re-encodes the state groups' device pages and compares the result with host tier 1
(``leto.erasure.locate``: the syndromes name the page and symbol of each error), and
tier 1 with tier 2. It may run only where no group update is in flight — at an
iteration's start (the previous update done), after a recovery finished, before a
checkpoint — where host tier 1 is the parity of the device pages and tier 2 that of
tier 1 (gradients are not scrubbed: they are recomputed every iteration).

What it does with what it finds:

* an error in host parity (tier 1 or 2): repaired in place, exactly — parity is never
  an input to training, so nothing read the wrong bytes; reported;
* an error in a device page (parameters, optimizer state): ``CorruptState``, a fatal
  failure naming the allocation, page and symbols. It is *not* patched in place: the
  corrupted value may already have been read by a forward pass or an update since it
  changed, and an update carries the error's syndrome along unchanged (incremental
  parity), so XORing it out would produce a value no fault-free run has. The checkpoint
  fallback replays from the newest checkpoint instead — verified by a full scrub before
  it was saved, so it predates the corruption — which ends bit-exact;
* errors the code cannot locate: ``Unlocatable``, fatal likewise (nothing changed).

Cost: the background budget (``LETO_SCRUB_MIB`` of data per iteration) accrues, and
each time it covers the next group that whole group is checked — whole pages, where
the codec runs at full speed (on the H200 a 64 MiB range cut as thin slices of 1,024
pages took 24.7 ms where a whole 2 GiB group encodes in 4.75 ms) — so a full pass takes state / budget iterations. On CUDA the check is launched
on a side stream while the forward pass runs (it only reads) and its verdict — one
flag — is read at the next step (on the CPU the same way, computed at once); only a
group whose flag is set is decoded, synchronously.

Not covered: corruption inside the window between a full scrub and the checkpoint
snapshot that follows it (microseconds, same thread), record groups (the marker and
loop records carry their own CRCs), gradient pages.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from leto import rank_log
from leto.erasure.locate import SymbolError, Unlocatable, locate, syndromes
from leto.errors import FatalFailure

# In a job's log directory: ``leto pool scrub`` asks every trainer for a full scrub (a
# JSON {"id": ...}); each answers in scrub.<id>.rank<r>.json at its next iteration.
REQUEST_FILE = "scrub.request"
ENV_SCRUB_MIB = "LETO_SCRUB_MIB"  # data MiB checked per iteration (0: no background scrub)
DEFAULT_SCRUB_MIB = 64.0


@dataclass(frozen=True)
class Finding:
    """One page with errors: where, how many symbols, and what was done."""

    group: int
    tier: str  # "data", "tier1", "tier2", or "unlocated" (found, not located: fatal)
    page: int  # index within the group's data pages or the tier's parity pages
    allocation: str | None  # data pages: the allocation (param, exp_avg, ...)
    allocation_page: int | None  # ... and the page within it
    symbols: int
    first_byte: int
    repaired: bool


class CorruptState(FatalFailure):
    """Device pages of retained state changed silently: the checkpoint fallback."""

    def __init__(self, findings: list[Finding], when: str):
        self.findings = findings
        pages = "; ".join(
            f"group {f.group} {f.allocation} page {f.allocation_page} "
            f"({f.symbols} symbol(s) from byte {f.first_byte})"
            for f in findings
            if f.tier == "data"
        )
        super().__init__(
            f"silent corruption of retained state found by the scrub ({when}): {pages}. "
            "Not repaired in place: the changed values may already have been read by "
            "training. Falling back to the newest checkpoint (verified when saved)."
        )


def scrub_budget_bytes() -> int:
    mib = float(os.environ.get(ENV_SCRUB_MIB, DEFAULT_SCRUB_MIB))
    return int(mib * 2**20)


class Scrubber:
    def __init__(self, up, budget_bytes: int | None = None, log=None):
        """``log``: a file each finding is appended to (one JSON line, with the time)."""
        self.up = up
        self.log = log
        self.groups = up.groups  # the allocation set's groups (parameters, optimizer state)
        self.page_bytes = up.state.page_bytes
        self.budget = scrub_budget_bytes() if budget_bytes is None else budget_bytes
        self.cursor = 0  # the state group the background check takes next
        self.passes = 0  # complete background passes
        self.pass_s: float | None = None  # wall time of the last complete pass
        self._pass_t0 = time.time()
        self.findings: list[Finding] = []  # everything found and repaired so far
        self.checked_bytes = 0
        self.transient = 0  # flagged ranges consistent on the re-check (overwritten)
        self._credit = 0  # data bytes of budget accrued, not yet spent on a group
        self._pending: list = []  # CUDA: (group index, lo, hi, flag, event) of the last step
        # A recovery's rebuilt groups, checked beside the first forward and backward and
        # read before the first update (``verify_later``): (when, [(gi, lo, hi, flag, ev)]).
        self._verifying: tuple[str, list] | None = None
        self._side = torch.cuda.Stream(up.device) if up.device.type == "cuda" else None

    # -- one range ----------------------------------------------------------------------

    def check(self, gi: int, lo: int = 0, hi: int | None = None, when: str = "scrub"):
        """Check bytes ``lo:hi`` of every page of state group ``gi`` against both tiers;
        repair parity, raise ``CorruptState`` for device pages. Returns the findings."""
        hi = self.page_bytes if hi is None else hi
        g = self.groups[gi]
        code = self.up.code(g)
        dev = self.up.device
        data = [p[lo:hi] for p in g.data]
        t1 = [p[lo:hi] for p in g.tier1]
        t2 = [p[lo:hi] for p in g.tier2]
        t1_dev = [p.to(dev) for p in t1] if dev.type != "cpu" else t1
        found: list[Finding] = []
        try:
            errors = locate(
                code.tier1, *syndromes(code.tier1, data, t1_dev, group=g.gid), group=g.gid
            )
        except Unlocatable as e:
            bad = Finding(g.gid, "unlocated", -1, None, None, len(e.symbols),
                          lo + 2 * e.symbols[0], False)  # fmt: skip
            self._note([bad], when)
            raise
        n = len(g.data)
        bad_data = _by_page([e for e in errors if e.column < n])
        bad_t1 = _by_page([e for e in errors if e.column >= n], offset=n)
        for page, errs in bad_data.items():
            name, k = _allocation_page(g.members, page)
            found.append(Finding(g.gid, "data", page, name, k, len(errs),
                                 lo + 2 * errs[0].symbol, False))  # fmt: skip
        if bad_data:
            self._note(found, when)
            raise CorruptState(found, when)
        for page, errs in bad_t1.items():
            for e in errs:
                e.apply(t1[page])  # host memory, in place
            found.append(Finding(g.gid, "tier1", page, None, None, len(errs),
                                 lo + 2 * errs[0].symbol, True))  # fmt: skip
        # Tier 2 over (now verified) tier 1: with H2 = 1 it only detects, and the fix is
        # to encode it again from tier 1. Computed on the copy of tier 1 staged above
        # where it matches the host's (no tier-1 page repaired): on a GPU by the device's
        # codec, not the host's (a recovery verifies its rebuilt groups here, on its
        # critical path).
        pos, _ = syndromes(code.tier2, t1 if bad_t1 else t1_dev, t2, group=g.gid)
        if len(pos):
            code.tier2.encode(t1, out=t2, group=g.gid)
            found.append(Finding(g.gid, "tier2", -1, None, None, len(pos),
                                 lo + 2 * int(pos[0]), True))  # fmt: skip
        self._note(found, when)
        self.checked_bytes += (hi - lo) * len(g.data)
        return found

    def _note(self, found: list[Finding], when: str) -> None:
        if not found:
            return
        self.findings += found
        for f in found:
            what = "repaired" if f.repaired else "NOT repaired (fatal)"
            rank_log.tell(
                None,
                f"scrub ({when}): group {f.group} {f.tier} page {f.page} "
                f"{f.allocation or ''} {f.symbols} symbol(s) from byte {f.first_byte}: {what}",
            )
        if self.log is not None:
            with open(self.log, "a") as fh:
                for f in found:
                    fh.write(json.dumps({**asdict(f), "when": when, "time": time.time()}) + "\n")

    # -- passes -------------------------------------------------------------------------

    def full(self, groups: list[int] | None = None, when: str = "full scrub") -> dict:
        """Check whole groups now (every state group by default); a summary.

        Every group's flag is launched first (the background check's pass over whole
        pages: the group's own page list, no host wait), then read together; only a
        group flagged is checked again by ``check``, which locates and repairs. Checking
        each group by ``check`` at once cost a host round trip and a page list of ~1,000
        slices a group: a full scrub of 13 GB at 1.1 B took 120–170 ms on an H100."""
        self.settle_verified()
        t0 = time.time()
        gis = list(range(len(self.groups)) if groups is None else groups)
        launched = [self._launch(gi, 0, self.page_bytes) for gi in gis]
        found = []
        for gi, lo, hi, flag, ev in launched:
            if ev is not None:
                ev.synchronize()
            if bool(flag.item()):
                found += self.check(gi, lo, hi, when=when)
        return {
            "groups": len(gis),
            "bytes": sum(len(self.groups[gi].data) for gi in gis) * self.page_bytes,
            "seconds": time.time() - t0,
            "repaired": [asdict(f) for f in found],
        }

    def step(self) -> None:
        """Background checks worth ``budget`` data bytes per call, a whole group at a
        time (the codec is efficient on whole pages, not on thin slices of a thousand
        pages): the budget accrues, and once it covers the next group that group is
        checked — several in one call when the budget is large, at most one pass. Call
        at an iteration's start."""
        if self.budget <= 0 or not self.groups:
            return
        pending, self._pending = self._pending, []
        for gi, lo, hi, flag, ev in pending:  # the flags of the last step's checks
            if ev is not None:
                ev.synchronize()  # long done: a whole forward/backward/update ran since
            if bool(flag.item()) and not self.check(gi, lo, hi):
                # Consistent by now: an update rewrote what differed (tier 2 is encoded
                # again every iteration) before anything read it.
                self.transient += 1
        sizes = [len(g.data) * self.page_bytes for g in self.groups]
        self._credit = min(self._credit + self.budget, max(sizes) + self.budget)
        while self._credit >= sizes[self.cursor]:
            gi = self.cursor
            self._credit -= sizes[gi]
            self._pending.append(self._launch(gi, 0, self.page_bytes))
            self.cursor = (gi + 1) % len(self.groups)
            if self.cursor == 0:
                self.passes += 1
                now = time.time()
                self.pass_s, self._pass_t0 = now - self._pass_t0, now
                break

    def verify_later(self, groups: list[int], when: str) -> dict:
        """A recovery's check of its rebuilt groups, off its critical path: launched now
        (on CUDA on the side stream, beside the first forward and backward, which only
        read the pages), its flags read by ``settle_verified`` before the first update
        writes a page — or before a checkpoint, a full scrub or the end of training.
        Until then nothing the training keeps depends on the rebuilt bytes: a group
        found wrong is then what the check at once would have found (``CorruptState``,
        the checkpoint fallback; parity repaired before the update reads it)."""
        self.settle_verified()
        t0 = time.time()
        self._verifying = (when, [self._launch(gi, 0, self.page_bytes) for gi in groups])
        return {
            "groups": len(groups),
            "bytes": sum(len(self.groups[gi].data) for gi in groups) * self.page_bytes,
            "seconds": time.time() - t0,  # the launch: the check itself runs beside
        }

    def settle_verified(self) -> list[Finding]:
        """Read the flags ``verify_later`` left (waiting for them), and check again at
        once every group flagged: a finding in a device page raises ``CorruptState``."""
        if self._verifying is None:
            return []
        (when, launched), self._verifying = self._verifying, None
        found: list[Finding] = []
        for gi, lo, hi, flag, ev in launched:
            if ev is not None:
                ev.synchronize()
            if bool(flag.item()):
                found += self.check(gi, lo, hi, when=when)
        return found

    def _launch(self, gi: int, lo: int, hi: int) -> tuple:
        """Re-encode the range — on CUDA on the side stream (it only reads the pages the
        forward pass reads too) — and leave one flag: does it differ from host tier 1, or
        tier 2 from tier 1 (encoded on the device from the copied tier-1 range)? The
        caller keeps it; the next step reads it (on the CPU too, so CI runs the same
        path)."""
        g = self.groups[gi]
        code = self.up.code(g)
        side = contextlib.nullcontext()
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.up.device))  # after the update
            side = torch.cuda.stream(self._side)
        with side:
            # The codec's checked page list of this range, built once per range (the
            # checks cost ~4 µs a page on the host, every iteration otherwise).
            key = ("scrub", gi, lo, hi)
            data = (
                g.data_pages  # whole pages: the group's own list, checked when it was mapped
                if g.data_pages is not None and (lo, hi) == (0, self.page_bytes)
                else self.up._page_lists.get(key)
                or self.up._pages(key, [p[lo:hi] for p in g.data])
            )
            fresh = code.tier1.encode(data, group=g.gid)
            t1 = [p[lo:hi].to(self.up.device, non_blocking=True) for p in g.tier1]
            for j, p in enumerate(t1):
                fresh[j] ^= p
            fresh2 = code.tier2.encode(t1, group=g.gid)
            for j, p in enumerate(g.tier2):
                fresh2[j] ^= p[lo:hi].to(self.up.device, non_blocking=True)
            bad = fresh.any() | fresh2.any()
            if self._side is None:
                flag, ev = bad, None
            else:
                flag = torch.empty((), dtype=torch.bool, pin_memory=True)
                flag.copy_(bad, non_blocking=True)
                ev = self._side.record_event()
        self.checked_bytes += (hi - lo) * len(g.data)
        return gi, lo, hi, flag, ev

    def before_update(self) -> None:
        """The update writes the pages the side stream may still be reading. A
        recovery's verification is read first."""
        self.settle_verified()
        if self._pending and self._pending[-1][4] is not None:
            torch.cuda.current_stream(self.up.device).wait_event(self._pending[-1][4])

    def report(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "passes": self.passes,
            "pass_s": self.pass_s,
            "checked_bytes": self.checked_bytes,
            "transient": self.transient,
            "findings": [asdict(f) for f in self.findings],
        }


def _by_page(errors: list[SymbolError], offset: int = 0) -> dict[int, list[SymbolError]]:
    out: dict[int, list[SymbolError]] = {}
    for e in errors:
        out.setdefault(e.column - offset, []).append(e)
    return out


def _allocation_page(members: list, page: int) -> tuple[str | None, int | None]:
    """The allocation and its page behind data page ``page`` of a group."""
    at = 0
    for name, first, count in members:
        if page < at + count:
            return name, first + page - at
        at += count
    return None, None
