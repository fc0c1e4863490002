"""Allocations and protection groups, as the state manager keeps them.

Runs in the state-manager process only. Pages of protected allocations are packed into
protection groups of D data pages in allocation order (page p of the pool's protected
space is page p % D of group p // D); each group owns H1 tier-1 and H2 tier-2 parity
pages in host memory. A record (the progress marker) gets a group of its own with
``record_parity_pages`` parity pages. Reusable buffers are in no group.

Lost pages are replaced by fresh zeroed pages as soon as they are found and stay
*pending* until a trainer reports them rebuilt, so a trainer that dies in the middle of
a reconstruction leaves the marks for its successor.

Not covered: socket handling and authentication (``server``), parity arithmetic (the
trainer does it on the device where the pages live).
"""

from __future__ import annotations

import functools
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from leto.memory.backends import Mapping, PageOwner
from leto.memory.config import AllocationKind, PoolConfig
from leto.memory.errors import AllocationMismatch, PoolProtocolError, PoolTimeout

NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-/\[\]]{1,200}$")
TIERS = ("data", "tier1", "tier2")


@dataclass
class Allocation:
    name: str
    kind: AllocationKind
    nbytes: int
    owner: PageOwner
    pages: list
    mapping: Mapping
    slots: list[tuple[int, int]] = field(default_factory=list)  # (group, index) per page


@dataclass
class Group:
    gid: int
    kind: str  # "state", "set" (closed to other allocations) or "record"
    capacity: int
    page_bytes: int
    members: list[tuple[str, int]]
    parity: dict[str, list]  # "tier1"/"tier2" -> host page handles
    parity_maps: dict[str, Mapping]
    pending: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in TIERS})
    rebuilt: int = 0

    def member_runs(self) -> list[list]:
        """Members as [name, first_page, count] runs (compact on the wire)."""
        runs: list[list] = []
        for name, page in self.members:
            if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == page:
                runs[-1][2] += 1
            else:
                runs.append([name, page, 1])
        return runs


def _create(owner: PageOwner, n: int) -> list:
    """``n`` fresh pages, or none: those made before a failure are released (a pool of
    memfd pages holds an open file per page, and the limit can end an allocation)."""
    return owner.create_many(n)


def _timed(fn, *args):
    return fn(*args), time.perf_counter()


class Table:
    def __init__(
        self,
        config: PoolConfig,
        device_owner: PageOwner,
        parity_owner: PageOwner,
        record_owner: PageOwner,
    ):
        self.config = config
        self.device_owner = device_owner
        self.parity_owner = parity_owner
        self.record_owner = record_owner
        self.allocations: dict[str, Allocation] = {}
        self.groups: list[Group] = []
        self._scan_pool: ThreadPoolExecutor | None = None  # localization's parity scans
        # A running parity scan (started, [(group, tier, owner)], futures) and what the
        # last one found (for a deferred localization's LOCALIZE_PARITY).
        self._parity_scan: tuple | None = None
        self.parity_result: dict | None = None
        self.failed_total = 0
        self.reusable_replaced = 0
        # Every page localization replaced, in order: ("data", name, page) or
        # (tier, gid, page). A premapped shadow remaps those after its cursor.
        self.replaced: list[tuple[str, str | int, int]] = []
        self.sets: dict[
            tuple[str, ...], tuple[int, int, int]
        ] = {}  # names -> units, per group, first

    # -- allocation -----------------------------------------------------------------

    def alloc(self, name: str, kind_name: str, nbytes: int) -> tuple[Allocation, bool]:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise PoolProtocolError(f"allocation name {name!r} must match {NAME_RE.pattern}")
        try:
            kind = AllocationKind(kind_name)
        except ValueError:
            raise PoolProtocolError(
                f"allocation kind {kind_name!r}: use one of {[k.value for k in AllocationKind]}"
            ) from None
        if nbytes <= 0 or nbytes > 1 << 46:
            raise PoolProtocolError(f"allocation {name!r}: nbytes={nbytes} out of range")
        existing = self.allocations.get(name)
        if existing is not None:
            if existing.kind != kind or existing.nbytes != nbytes:
                raise AllocationMismatch(
                    f"allocation {name!r} exists as {existing.kind.value} of {existing.nbytes} bytes; "
                    f"asked {kind.value} of {nbytes}. It was kept unchanged; use another name or the same size"
                )
            return existing, False
        owner = self.record_owner if kind is AllocationKind.RECORD else self.device_owner
        n_pages = -(-nbytes // owner.page_bytes)
        pages = _create(owner, n_pages)
        try:
            mapping = owner.map(pages)
        except BaseException:
            for h in pages:
                owner.release(h)
            raise
        a = Allocation(name, kind, nbytes, owner, pages, mapping)
        if kind is AllocationKind.PROTECTED:
            self._place_state_pages(a)
        elif kind is AllocationKind.RECORD:
            g = self._new_group(
                "record", n_pages, owner.page_bytes, self.config.record_parity_pages, 1
            )
            for i in range(n_pages):
                a.slots.append((g.gid, len(g.members)))
                g.members.append((name, i))
        self.allocations[name] = a
        return a, True

    def _new_group(self, kind: str, capacity: int, page_bytes: int, h1: int, h2: int) -> Group:
        parity, maps = {}, {}
        for tier, count in (("tier1", h1), ("tier2", h2)):
            owner = self.parity_owner if kind != "record" else self.record_owner
            handles = _create(owner, count)
            parity[tier] = handles
            maps[tier] = owner.map(handles)
        g = Group(len(self.groups), kind, capacity, page_bytes, [], parity, maps)
        self.groups.append(g)
        return g

    def _place_state_pages(self, a: Allocation) -> None:
        # Fresh pages are zero, and a zero page adds nothing to parity, so appending
        # pages to a partly filled group leaves its parity valid.
        for i in range(len(a.pages)):
            g = next((g for g in reversed(self.groups) if g.kind in ("state", "set")), None)
            if g is not None and g.kind == "set":
                g = None  # groups of an allocation set take no other pages
            if g is None or len(g.members) >= g.capacity:
                g = self._new_group(
                    "state",
                    self.config.data_pages,
                    self.config.page_bytes,
                    self.config.tier1_pages,
                    self.config.tier2_pages,
                )
            a.slots.append((g.gid, len(g.members)))
            g.members.append((a.name, i))

    def alloc_set(
        self, names: list, nbytes: list, unit_pages: list
    ) -> tuple[list[Allocation], int, int, int]:
        """Allocate protected allocations together, unit by unit (see protocol.AllocSet).

        Returns (allocations, units, units_per_group, first_group). Re-attaching the
        same set returns the existing allocations; a partial or different set is refused.
        """
        if not (isinstance(names, list) and len(names) == len(nbytes) == len(unit_pages) and names):
            raise PoolProtocolError(
                "ALLOC_SET needs equally long, non-empty names, nbytes and unit_pages"
            )
        for n, b, u in zip(names, nbytes, unit_pages, strict=True):
            if not isinstance(n, str) or not NAME_RE.match(n):
                raise PoolProtocolError(f"allocation name {n!r} must match {NAME_RE.pattern}")
            if not isinstance(b, int) or isinstance(b, bool) or not 0 < b <= 1 << 46:
                raise PoolProtocolError(f"allocation {n!r}: nbytes={b!r} out of range")
            if not isinstance(u, int) or isinstance(u, bool) or u < 1:
                raise PoolProtocolError(
                    f"allocation {n!r}: unit_pages={u!r} must be a positive integer"
                )
        if len(set(names)) != len(names):
            raise PoolProtocolError(f"ALLOC_SET names {names} repeat a name")
        pb = self.device_owner.page_bytes
        unit = sum(unit_pages)
        per_group = self.config.data_pages // unit
        if per_group < 1:
            raise PoolProtocolError(
                f"a unit of {unit} pages does not fit a protection group of {self.config.data_pages}"
            )
        units = max(-(-b // (u * pb)) for b, u in zip(nbytes, unit_pages, strict=True))
        existing = [self.allocations.get(n) for n in names]
        if any(existing):
            ok = all(
                a is not None
                and a.kind is AllocationKind.PROTECTED
                and a.nbytes == b
                and len(a.pages) == units * u
                for a, b, u in zip(existing, nbytes, unit_pages, strict=True)
            )
            if not ok:
                raise AllocationMismatch(
                    f"allocation set {names} differs from what exists under those names; it was kept "
                    "unchanged: attach the same set with the same sizes"
                )
            first = existing[0].slots[0][0]
            return existing, units, per_group, first
        created: list[Allocation] = []
        try:
            for n, b, u in zip(names, nbytes, unit_pages, strict=True):
                pages = _create(self.device_owner, units * u)
                created.append(
                    Allocation(
                        n,
                        AllocationKind.PROTECTED,
                        b,
                        self.device_owner,
                        pages,
                        self.device_owner.map(pages),
                    )
                )
        except BaseException:
            for a in created:
                a.owner.unmap(a.mapping)
                for h in a.pages:
                    a.owner.release(h)
            raise
        first_group = len(self.groups)
        for u_index in range(units):
            if u_index % per_group == 0:
                g = self._new_group(
                    "set", per_group * unit, pb, self.config.tier1_pages, self.config.tier2_pages
                )
            for a, u in zip(created, unit_pages, strict=True):
                for i in range(u_index * u, (u_index + 1) * u):
                    a.slots.append((g.gid, len(g.members)))
                    g.members.append((a.name, i))
        for a in created:
            self.allocations[a.name] = a
        self.sets[tuple(names)] = (units, per_group, first_group)
        return created, units, per_group, first_group

    def export(self, a: Allocation) -> list:
        """An opener per page of ``a`` (``protocol.send`` opens each as its batch goes
        out: a 5 B-parameter pool's ~40,000 fds at once would pass the open-file limit).
        Every page is checked alive now, while the reply can still be an error."""
        for h in a.pages:
            a.owner.check_exportable(h)
        return [functools.partial(a.owner.export_fd, h) for h in a.pages]

    def layout(self, known: int = 0) -> tuple[list[dict], list]:
        """Every group, with openers for the parity page fds of groups ``known`` on."""
        groups, fds = [], []
        for g in self.groups:
            groups.append(
                {
                    "gid": g.gid,
                    "kind": g.kind,
                    "members": g.member_runs(),
                    "tier1": len(g.parity["tier1"]),
                    "tier2": len(g.parity["tier2"]),
                    "page_bytes": g.page_bytes,
                }
            )
            if g.gid < known:
                continue
            owner = self.parity_owner if g.kind != "record" else self.record_owner
            for h in g.parity["tier1"] + g.parity["tier2"]:
                owner.check_exportable(h)
                fds.append(functools.partial(owner.export_fd, h))  # opened as sent
        return groups, fds

    # -- failures -------------------------------------------------------------------

    def localize(self, defer_parity: bool = False) -> dict:
        """Find lost pages, replace them by fresh zeroed pages, report them by group.

        ``defer_parity``: report the data pages now and leave the host parity scan
        running (a premapped trainer maps and binds its retained state meanwhile);
        ``settle_parity`` finishes it. Until then nothing that could hand out or count
        parity pages is served (the server settles first), and the report says
        ``"parity": "deferred"``."""
        try:  # a scan an earlier localization left running lands first
            self.settle_parity()
        except PoolTimeout:
            raise
        except Exception:
            pass  # it failed: this localization scans every page again
        t0 = time.perf_counter()
        scanned = 0
        allocations: dict[str, dict] = {}
        for a in self.allocations.values():
            failed = a.owner.failed_pages(a.mapping)
            scanned += len(a.pages)
            if not failed:
                continue
            allocations[a.name] = {"kind": a.kind.value, "failed_pages": failed}
            if a.kind is AllocationKind.REUSABLE:
                self._replace(a.owner, a.pages, a.mapping, failed, ("data", a.name))
                self.reusable_replaced += len(failed)  # contents need not survive
                continue

            def pending(i: int, a: Allocation = a) -> None:
                gid, idx = a.slots[i]
                self.groups[gid].pending["data"].add(idx)

            self._replace(a.owner, a.pages, a.mapping, failed, ("data", a.name), pending)
        data_s = time.perf_counter() - t0
        self._start_parity_scan()
        report = {
            "mechanism": {
                "device": self.device_owner.loss_mechanism,
                "host": self.parity_owner.loss_mechanism,
            },
            "data_s": data_s,
            "pages_scanned": scanned,
            "allocations": allocations,
        }
        if defer_parity:
            return {**report, "seconds": data_s, "groups": self._pending(), "parity": "deferred"}
        parity = self.settle_parity()
        self.parity_result = None  # reported here
        return {
            **report,
            # scanning and replacing: data pages (the device), then parity (the host)
            "seconds": data_s + parity["parity_s"],
            "parity_s": parity["parity_s"],
            "pages_scanned": scanned + parity["pages_scanned"],
            "groups": parity["groups"],
        }

    def _start_parity_scan(self) -> None:
        # Host parity is scanned on several threads: the host backend's scan
        # (MADV_POPULATE_READ) walks every 4 KiB page-table entry of the parity — ~7 GB
        # at 5 B parameters, 0.43 s on one thread on the H200's host — and releases the
        # GIL. Replacements stay on this thread, in group order (``settle_parity``).
        scans = [
            (g, tier, self.parity_owner if g.kind != "record" else self.record_owner)
            for g in self.groups
            for tier in ("tier1", "tier2")
        ]
        pool = self._scanner()
        started = time.perf_counter()
        self.parity_result = None  # what an earlier scan found was reported (or is moot)
        futures = [
            pool.submit(_timed, owner.failed_pages, g.parity_maps[tier]) for g, tier, owner in scans
        ]
        self._parity_scan = (started, scans, futures)

    @property
    def parity_scan_pending(self) -> bool:
        return self._parity_scan is not None

    def settle_parity(self, timeout_s: float | None = None, by: str = "LOCALIZE") -> dict | None:
        """Wait for a running host parity scan, replace the lost pages it found (marked
        pending in their groups) and return (and keep, as ``parity_result``) what it
        found and which request ``by`` it landed for; None if no scan is running. A scan
        not done within ``timeout_s`` (the pool's I/O timeout by default) raises
        ``PoolTimeout`` and stays pending; a scan that failed is dropped after raising,
        its error kept as ``parity_result`` (the next localization scans everything
        again: lost pages stay lost)."""
        if self._parity_scan is None:
            return None
        timeout_s = self.config.io_timeout_s if timeout_s is None else timeout_s
        started, scans, futures = self._parity_scan
        t0 = time.perf_counter()
        wait(futures, timeout=timeout_s)
        if not all(f.done() for f in futures):
            raise PoolTimeout(
                f"the host parity scan of {len(scans)} parity mappings did not finish within "
                f"{timeout_s} s; it goes on, nothing was replaced yet"
            )
        self._parity_scan = None
        try:
            found = [f.result() for f in futures]
        except Exception as e:
            # Kept, so the trainer's LOCALIZE_PARITY is refused with it even when
            # another request landed the scan (and never answered with older results).
            self.parity_result = {"error": f"the host parity scan failed: {e}"}
            raise
        scanned, t_replace = 0, time.perf_counter()
        done = max((at for _, at in found), default=started)
        for (g, tier, owner), (failed, _) in zip(scans, found, strict=True):
            scanned += len(g.parity[tier])
            if failed:
                self._replace(owner, g.parity[tier], g.parity_maps[tier], failed, (tier, g.gid),
                              g.pending[tier].add)  # fmt: skip
        now = time.perf_counter()
        self.parity_result = {
            # the scan (from its start to its last thread's end) and the replacements
            "parity_s": done - started + (now - t_replace),
            "wait_s": now - t0,  # how long this call waited (and replaced)
            # The request it landed for: LOCALIZE_PARITY when the trainer's binding
            # overlapped the whole scan, another one when that request could not wait.
            "landed_by": by,
            "pages_scanned": scanned,
            "groups": self._pending(),
        }
        return self.parity_result

    def _pending(self) -> dict:
        return {
            str(g.gid): {t: sorted(g.pending[t]) for t in TIERS}
            for g in self.groups
            if any(g.pending[t] for t in TIERS)
        }

    def _scanner(self) -> ThreadPoolExecutor:
        if self._scan_pool is None:  # made once: localization is on the recovery path
            n = max(1, min(8, len(os.sched_getaffinity(0))))
            self._scan_pool = ThreadPoolExecutor(n, thread_name_prefix="leto-scan")
        return self._scan_pool

    def _replace(
        self, owner: PageOwner, handles: list, mapping: Mapping, failed: list[int], key: tuple,
        pending=None,
    ) -> None:  # fmt: skip
        """Put a fresh zeroed page in place of each ``failed`` one; ``pending(i)`` marks
        page ``i`` to be rebuilt the moment it is in place. A failure part way (no memory
        for a fresh page, a driver error mapping it) leaves the pages replaced before it
        marked — zeroes in place of retained state are never left unknown: the next
        localization finds the rest, the report names them all — and no page leaked."""
        for i in failed:
            fresh = owner.create()
            try:
                owner.replace(mapping, i, fresh)
            except BaseException:
                owner.release(fresh)  # not in the mapping: nothing else holds it
                raise
            old, handles[i] = handles[i], fresh
            self.failed_total += 1
            self.replaced.append((*key, i))
            if pending is not None:
                pending(i)
            owner.release(old)

    # -- premapping (parked shadows) ------------------------------------------------

    @staticmethod
    def info(a: Allocation) -> dict:
        """What a client needs to map ``a`` from its page fds."""
        return {
            "name": a.name,
            "kind": a.kind.value,
            "nbytes": a.nbytes,
            "n_pages": len(a.pages),
            "page_bytes": a.owner.page_bytes,
        }

    def premap(self, known: list) -> tuple[list[dict], list[dict], int, list[int]]:
        """The allocations not in ``known`` with their page fds, every allocation set,
        and the replacement-log position these fds are current at."""
        infos, fds = [], []
        for a in self.allocations.values():
            if a.name not in known:
                infos.append(self.info(a))
                fds += self.export(a)
        sets = [
            {
                "allocations": [self.info(self.allocations[n]) for n in names],
                "units": u,
                "units_per_group": g,
                "first_group": f,
            }
            for names, (u, g, f) in self.sets.items()
        ]
        return infos, sets, len(self.replaced), fds

    def replaced_since(self, since: int) -> tuple[list[dict], list[int]]:
        """Each page replaced after log position ``since`` (once), with an fd of the
        page now in its place."""
        if not isinstance(since, int) or not 0 <= since <= len(self.replaced):
            raise PoolProtocolError(
                f"replacement cursor {since!r} is not in 0..{len(self.replaced)}"
            )
        pages, fds = [], []
        for key in dict.fromkeys(self.replaced[since:]):  # distinct, in order
            target, owner_key, i = key
            if target == "data":
                a = self.allocations[owner_key]
                pages.append({"target": "data", "name": owner_key, "page": i})
                fds.append(a.owner.export_fd(a.pages[i]))
            else:
                g = self.groups[owner_key]
                owner = self.parity_owner if g.kind != "record" else self.record_owner
                pages.append({"target": target, "group": owner_key, "page": i})
                fds.append(owner.export_fd(g.parity[target][i]))
        return pages, fds

    def mark_rebuilt(self, gids: list) -> None:
        for gid in gids:
            if not isinstance(gid, int) or not 0 <= gid < len(self.groups):
                raise PoolProtocolError(f"group {gid!r} does not exist (0..{len(self.groups) - 1})")
        for gid in gids:
            g = self.groups[gid]
            g.rebuilt += sum(len(g.pending[t]) for t in TIERS)
            g.pending = {t: set() for t in TIERS}

    def inject(self, target: str, name: str, pages: list) -> None:
        """Fault injection: lose pages as a memory error would (allowed by config only)."""
        if target == "data":
            a = self.allocations.get(name)
            if a is None:
                raise PoolProtocolError(f"no allocation named {name!r}")
            owner, handles, mapping = a.owner, a.pages, a.mapping
        elif target in ("tier1", "tier2"):
            if not name.isdigit() or int(name) >= len(self.groups):
                raise PoolProtocolError(f"no group {name!r}")
            g = self.groups[int(name)]
            owner = self.parity_owner if g.kind != "record" else self.record_owner
            handles, mapping = g.parity[target], g.parity_maps[target]
        else:
            raise PoolProtocolError(f"inject target {target!r}: use data, tier1 or tier2")
        bad = [
            p
            for p in pages
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < len(handles)
        ]
        if bad or len(set(pages)) != len(pages):
            raise PoolProtocolError(
                f"pages {pages!r} must be distinct indices in 0..{len(handles) - 1}"
            )
        for p in pages:
            owner.lose(mapping, p, handles[p])

    # -- visibility and lifecycle ---------------------------------------------------

    def status(self) -> dict:
        return {
            "allocations": [
                {
                    "name": a.name,
                    "kind": a.kind.value,
                    "nbytes": a.nbytes,
                    "pages": len(a.pages),
                    "page_bytes": a.owner.page_bytes,
                }
                for a in self.allocations.values()
            ],
            "groups": [
                {
                    "gid": g.gid,
                    "kind": g.kind,
                    "data_pages": len(g.members),
                    "members": g.member_runs(),
                    "tier1": len(g.parity["tier1"]),
                    "tier2": len(g.parity["tier2"]),
                    "pending": {t: sorted(g.pending[t]) for t in TIERS},
                    "rebuilt": g.rebuilt,
                }
                for g in self.groups
            ],
            "failed_pages_total": self.failed_total,
            "rebuilt_pages_total": sum(g.rebuilt for g in self.groups),
            "reusable_pages_replaced": self.reusable_replaced,
            "mechanism": {
                "device": self.device_owner.loss_mechanism,
                "host": self.parity_owner.loss_mechanism,
            },
        }

    def close(self) -> None:
        if self._scan_pool is not None:  # no scan may read a mapping unmapped below
            self._scan_pool.shutdown(wait=True)
            self._scan_pool, self._parity_scan = None, None
        for a in self.allocations.values():
            a.owner.unmap(a.mapping)
            for h in a.pages:
                a.owner.release(h)
        for g in self.groups:
            owner = self.parity_owner if g.kind != "record" else self.record_owner
            for tier in ("tier1", "tier2"):
                owner.unmap(g.parity_maps[tier])
                for h in g.parity[tier]:
                    owner.release(h)
        self.allocations.clear()
        self.groups.clear()
