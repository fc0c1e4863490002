"""Trainer side of the Resilient Memory Pool.

Runs in the active (or promoted) trainer. ``PoolClient.connect`` says HELLO and, as a
trainer, becomes the pool's owner under a new epoch (``takeover=True`` fences a live
predecessor). ``attach`` maps an allocation by name and returns an ordinary tensor over
the retained pages, with no copy; shapes come from the caller (e.g. a meta-device
model), so nothing is allocated twice. Recovery order: ``localize`` (before anything
is attached, so no lost page is ever touched), ``attach`` everything, ``reconstruct``
(on the device where the pages live), which also tells the state manager the pages
are rebuilt.

Not covered: when parity is consistent with data (the updater's marker decides which
parity is authoritative; ``reconstruct`` trusts the parity it finds).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leto.erasure import TwoTierCode
from leto.erasure.pages import PageList
from leto.memory import fdlimit
from leto.memory import protocol as P
from leto.memory.backends import Mapping, importer_for
from leto.memory.backends.cuda import pin_host, unpin_host
from leto.memory.backends.host import HostPageImporter
from leto.memory.config import AllocationKind, PoolConfig
from leto.memory.errors import PoolError, PoolProtocolError, PoolTimeout

CONNECT_RETRY_S = 0.02  # between connects to a state manager still starting


@dataclass
class GroupView:
    """A protection group as the trainer sees it: page tensors, no copies."""

    gid: int
    kind: str
    members: list  # [allocation name, first page, count] runs, in group order
    data: list[torch.Tensor]  # on the pool's device (host for records)
    tier1: list[torch.Tensor]  # host memory
    tier2: list[torch.Tensor]  # host memory
    # ``data`` as the codec's checked page list, made from its allocations' mappings at
    # once (rows of one uint8 tensor each: nothing per page to check). None: made by
    # someone else, the codec checks ``data`` itself.
    data_pages: PageList | None = None


class PoolClient:
    def __init__(self, sock: socket.socket, welcome: P.Welcome, role: str):
        self.sock = sock
        self.role = role
        self.epoch = welcome.epoch
        self.server_pid = welcome.server_pid
        self.config = PoolConfig.from_dict(welcome.config)
        self._maps: dict[str, tuple[Mapping, object, P.Allocated]] = {}
        self._parity: list[tuple[object, Mapping]] = []
        self._codes: dict[tuple[int, int, int], TwoTierCode] = {}
        self._sets: dict[tuple[str, ...], P.AllocatedSet] = {}
        self.waited_s = 0.0  # (set by connect: its wait for the state manager to listen)
        self._registered: dict[
            int, int
        ] = {}  # page-locked host ranges (cuMemHostRegister): ptr -> bytes
        # Premapping (a parked shadow): the replacement-log position the mappings here
        # are current at (None: nothing premapped), and each group's tier-1 count.
        self._cursor: int | None = None
        self._tier1: dict[int, int] = {}
        self.remapped = 0  # pages mapped again because localization replaced them
        self._deferred: dict | None = None  # a localization report awaiting its parity scan
        # The last layout and what it was made from: rebuilt only when a mapping or the
        # groups may have changed (an allocation, a remap, a new epoch), not per call —
        # a recovery asked for it once per rebuilt group, each time a request to the
        # state manager and every page's view in Python (324 groups: 15.7 s of a
        # promoted trainer's 18 s resume on the CPU).
        self._layout: tuple[tuple, list[GroupView]] | None = None

    @classmethod
    def connect(
        cls,
        socket_path: str | Path,
        token: str,
        *,
        role: str = "trainer",
        takeover: bool = False,
        timeout_s: float = 10.0,
        starting: bool = False,
    ) -> PoolClient:
        """``starting``: the state manager may not listen yet (a first trainer, started
        beside it): no socket, or a refused connection, is tried again until the
        timeout."""
        fdlimit.raise_limit()  # replies carry an fd per page (a 5 B model: ~40,000)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        waited = False
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))  # what is left of it
            try:
                sock.connect(str(socket_path))
                sock.settimeout(timeout_s)  # each request's own limit from here on
                break
            except TimeoutError:
                sock.close()
                raise PoolTimeout(
                    f"could not connect to the state manager at {socket_path} within "
                    f"{timeout_s} s"
                ) from None
            except (FileNotFoundError, ConnectionRefusedError) as e:
                # Not listening yet: leto run starts trainers while their state managers
                # start (CONNECT_RETRY_S apart, until the timeout).
                sock.close()
                if not starting:
                    raise PoolError(f"no state manager at {socket_path}: {e.strerror}") from None
                if time.monotonic() + CONNECT_RETRY_S > deadline:
                    raise PoolError(
                        f"no state manager at {socket_path} within {timeout_s} s: {e.strerror}"
                    ) from None
                time.sleep(CONNECT_RETRY_S)
                waited = True
            except OSError as e:
                sock.close()
                raise PoolError(f"no state manager at {socket_path}: {e.strerror}") from None
        try:
            welcome, _ = P.request(
                sock, P.Hello(P.PROTOCOL_VERSION, token, role, takeover), P.Welcome
            )
        except BaseException:
            sock.close()
            raise
        client = cls(sock, welcome, role)
        # How long a starting trainer waited for its state manager to listen (0: it
        # already did): the state manager's start on this trainer's way, if above 0.
        client.waited_s = time.monotonic() - t0 if waited else 0.0
        return client

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- allocations ----------------------------------------------------------------

    def attach(
        self,
        name: str,
        nbytes: int | None = None,
        *,
        shape: tuple[int, ...] | torch.Size | None = None,
        dtype: torch.dtype = torch.uint8,
        kind: AllocationKind = AllocationKind.PROTECTED,
    ) -> torch.Tensor:
        """The retained allocation ``name`` as a tensor (created zeroed on first use).

        Give ``shape`` and ``dtype`` (or ``nbytes`` for a flat byte tensor). Attaching
        again to an existing name with another size or kind raises AllocationMismatch.
        """
        if shape is not None:
            numel = 1
            for s in shape:
                numel *= int(s)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes is None:
            raise ValueError(f"attach({name!r}) needs nbytes or shape and dtype")
        if name not in self._maps:
            reply, fds = P.request(
                self.sock, P.Alloc(self.epoch, name, kind.value, int(nbytes)), P.Allocated
            )
            device = "cpu" if kind is AllocationKind.RECORD else self.config.device
            importer = importer_for(device, reply.page_bytes)
            pages = P.recv_fds(self.sock, reply.n_fds, fds, lambda _, fd: importer.take(fd))
            mapping = importer.map(pages)
            self._maps[name] = (mapping, importer, reply)
        mapping, _, info = self._maps[name]
        if info.nbytes != nbytes or info.kind != kind.value:
            raise PoolProtocolError(
                f"{name!r} is attached as {info.kind} of {info.nbytes} bytes, asked {kind.value} of {nbytes}"
            )
        flat = mapping.tensor[:nbytes]
        if shape is None:
            return flat
        return flat.view(dtype).view(tuple(shape))

    def pages_of(self, name: str) -> torch.Tensor:
        """Every page of an attached allocation as one flat uint8 tensor, including the
        slack after ``nbytes`` in its last page (no copy)."""
        if name not in self._maps:
            raise PoolError(f"{name!r} is not attached here")
        return self._maps[name][0].tensor

    def attach_set(
        self, names: list[str], nbytes: list[int], unit_pages: list[int]
    ) -> P.AllocatedSet:
        """Attach protected allocations placed unit by unit (see ``protocol.AllocSet``).

        Afterwards each is available through ``attach(name, nbytes)``; the reply says how
        many units there are, how many fit a group, and the set's first group.
        """
        if all(n in self._maps for n in names):
            return self._sets[tuple(names)]
        reply, fds = P.request(
            self.sock,
            P.AllocSet(self.epoch, list(names), [int(b) for b in nbytes], list(unit_pages)),
            P.AllocatedSet,
        )
        self._map_allocations(reply.allocations, reply.n_fds, fds)
        self._sets[tuple(names)] = reply
        return reply

    def _map_allocations(self, infos: list[dict], n_fds: int, first: list[int]) -> None:
        """Receive the page fds of allocations the state manager described
        (``Table.info``), each imported as it arrives, and map them in order (records
        in host memory, the rest on this pool's device)."""
        importers, per_fd = [], []
        for info in infos:
            kind = AllocationKind(info["kind"])
            device = "cpu" if kind is AllocationKind.RECORD else self.config.device
            importers.append(importer_for(device, info["page_bytes"]))
            per_fd += [importers[-1]] * info["n_pages"]
        if len(per_fd) != n_fds:
            for fd in first:
                os.close(fd)
            raise PoolProtocolError(f"{len(per_fd)} pages described, {n_fds} descriptors announced")
        pages = P.recv_fds(self.sock, n_fds, first, lambda i, fd: per_fd[i].take(fd))
        pos = 0
        for info, importer in zip(infos, importers, strict=True):
            n = info["n_pages"]
            kind = AllocationKind(info["kind"])
            mapping = importer.map(pages[pos : pos + n])
            pos += n
            meta = P.Allocated(
                info["name"], kind.value, info["nbytes"], n, info["page_bytes"], False, n
            )
            self._maps[info["name"]] = (mapping, importer, meta)

    def attach_like(
        self, name: str, like: torch.Tensor, kind: AllocationKind = AllocationKind.PROTECTED
    ) -> torch.Tensor:
        """Attach with the shape and dtype of ``like`` (a meta-device tensor is enough)."""
        return self.attach(name, shape=like.shape, dtype=like.dtype, kind=kind)

    # -- protection -----------------------------------------------------------------

    def parity_mapping(self, gid: int) -> torch.Tensor:
        """A group's tier-1 and tier-2 pages as one host tensor (mapped by ``layout``)."""
        return self._parity[gid][1].tensor

    def layout(self) -> list[GroupView]:
        """Every protection group with its data and parity pages mapped here.

        A group's parity is mapped once per client and reused by later calls, so views
        handed out earlier stay valid (groups are only ever appended; pages replaced
        by localization are picked up by a new client, which localizes before mapping).
        The list is made again only after something here changed (``_layout_key``);
        callers share it and must not modify it.
        """
        if self._layout is not None and self._layout[0] == self._layout_key():
            return self._layout[1]
        views = []
        for g in self._map_parity():
            mapping = self._parity[g["gid"]][1]
            pages = [mapping.page(i) for i in range(g["tier1"] + g["tier2"])]
            runs: list[PageList] = []
            for name, first, count in g["members"]:
                if name not in self._maps:
                    raise PoolError(
                        f"group {g['gid']} holds pages of {name!r}, which is not attached here; "
                        "attach every protected allocation first"
                    )
                m = self._maps[name][0]  # its pages: rows of its one uint8 tensor
                t = m.tensor
                runs.append(
                    PageList(m.pages[first : first + count], m.page_bytes, t.dtype, t.device)
                )
            data_pages = PageList.join(runs, "data", g["gid"])
            data = list(data_pages.pages)
            views.append(
                GroupView(
                    g["gid"],
                    g["kind"],
                    g["members"],
                    data,
                    pages[: g["tier1"]],
                    pages[g["tier1"] :],
                    data_pages,
                )
            )
        self._layout = (self._layout_key(), views)
        return views

    def _layout_key(self) -> tuple:
        """What a layout is made from: the allocations and parity mapped here (groups
        are made only by this client's allocations), the epoch, and the remaps."""
        return (len(self._maps), len(self._parity), self.epoch, self._cursor, self.remapped)

    def _map_parity(self) -> list[dict]:
        """The state manager's groups, each group's parity mapped here (once)."""
        known = len(self._parity)  # groups are only ever appended
        reply, fds = P.request(self.sock, P.Layout(self.epoch, known), P.LayoutReply)
        fds = P.recv_fds(self.sock, reply.n_fds, fds)
        pos = 0
        for g in reply.groups:
            if g["gid"] >= known:
                n = g["tier1"] + g["tier2"]
                group_fds, pos = fds[pos : pos + n], pos + n
                importer = HostPageImporter(g["page_bytes"])
                self._parity.append((importer, importer.map(group_fds)))
            self._tier1[g["gid"]] = g["tier1"]
        if pos != len(fds):
            for fd in fds[pos:]:
                os.close(fd)
            raise PoolProtocolError(f"LAYOUT sent {len(fds)} parity fds, its groups name {pos}")
        return reply.groups

    def _code(self, g: GroupView) -> TwoTierCode:
        key = (len(g.data), len(g.tier1), len(g.tier2))
        if key not in self._codes:
            self._codes[key] = TwoTierCode(*key)
        return self._codes[key]

    def encode_parity(self) -> None:
        """Compute both parity tiers of every group from the data as it is now."""
        for g in self.layout():
            device = g.data[0].device
            t1, t2 = self._code(g).encode(g.data)
            for dst, src in zip(g.tier1 + g.tier2, list(t1) + list(t2), strict=True):
                dst.copy_(src if device.type == "cpu" else src.cpu())

    def localize(self, defer_parity: bool = False) -> dict:
        """Ask the state manager to find and replace lost pages; returns its report.
        Premapped pages that it replaced (now or since they were mapped) are mapped
        again here first, so no view ever reaches a lost page.

        ``defer_parity`` (premapped clients): the report covers the data pages, and the
        host parity scan goes on in the state manager while this process binds its
        retained state; ``settle_localize`` completes the report before anything reads
        or writes parity (reconstruction, the update)."""
        if self._maps and self._cursor is None:
            raise PoolError("localize before attaching: pages mapped here may be the lost ones")
        if defer_parity and self._cursor is None:
            raise PoolError(
                "only a premapped client defers the parity scan: a cold one maps parity "
                "after localizing, and would map pages the scan may still replace"
            )
        reply, _ = P.request(self.sock, P.Localize(self.epoch, defer_parity), P.Localized)
        if self._cursor is not None:
            self._refresh()
        self._deferred = reply.report if reply.report.get("parity") == "deferred" else None
        return reply.report

    @property
    def localizing(self) -> bool:
        """A deferred localization's parity scan is not settled yet."""
        return self._deferred is not None

    def settle_localize(self) -> dict:
        """Wait for a deferred localization's host parity scan, map again the parity
        pages it replaced, and complete its report in place (every group's pending
        pages; ``parity_s``: the scan; ``parity_landed_by``: the request it landed for,
        and ``parity_wait_s``: how long that request waited for it); returns it. A scan
        that failed or ran past the pool's I/O timeout raises (PoolError, PoolTimeout)."""
        report = self._deferred
        if report is None:
            raise PoolError("no deferred localization to settle")
        reply, _ = P.request(self.sock, P.LocalizeParity(self.epoch), P.Localized)
        self._refresh()  # (views over replaced parity pages stay valid: remapped in place)
        part = reply.report
        del report["parity"]
        report.update(
            groups=part["groups"],
            parity_s=part["parity_s"],
            parity_wait_s=part["wait_s"],
            parity_landed_by=part["landed_by"],
            seconds=report["seconds"] + part["parity_s"],
            pages_scanned=report["pages_scanned"] + part["pages_scanned"],
        )
        self._deferred = None
        return report

    # -- premapping (a parked shadow) -----------------------------------------------

    @property
    def premapped(self) -> bool:
        return self._cursor is not None

    @property
    def mapped(self) -> list[str]:
        """Names of the allocations mapped here."""
        return list(self._maps)

    def mapped_bytes(self) -> int:
        """Bytes of the retained allocations mapped here (records aside)."""
        return sum(
            meta.nbytes
            for _, _, meta in self._maps.values()
            if meta.kind != AllocationKind.RECORD.value
        )

    def premap(self) -> int:
        """As a parked shadow: map every allocation not mapped here yet and every
        group's parity, page-lock host parity and records for the GPU, and remap pages
        localization replaced since the last call. Touches no page's contents (the
        trainer owns them). Returns the number of allocations newly mapped."""
        if self.role != P.Role.SHADOW.value:
            raise PoolError(f"premap is for a parked shadow; this client is a {self.role}")
        reply, fds = P.request(self.sock, P.Premap(list(self._maps)), P.Premapped)
        self._map_allocations(reply.allocations, reply.n_fds, fds)
        for st in reply.sets:
            names = tuple(a["name"] for a in st["allocations"])
            if all(n in self._maps for n in names):
                self._sets[names] = P.AllocatedSet(
                    st["allocations"], st["units"], st["units_per_group"], st["first_group"], 0
                )
        if self._cursor is None:
            self._cursor = reply.cursor  # every fd above is current at this position
        else:
            self._refresh()  # pages mapped by earlier calls that were replaced since
        if reply.allocations:
            # Parity only: the trainer may have allocated since the PREMAP reply, so the
            # groups can name allocations the next call maps (issue 17, seen on the H200).
            self._map_parity()
            if self.config.device.startswith("cuda"):
                for gid in range(len(self._parity)):
                    self.register_host(self.parity_mapping(gid))
                for name, (_, _, meta) in self._maps.items():
                    if meta.kind == AllocationKind.RECORD.value:
                        self.register_host(self.pages_of(name))
            # Every mapping's page views (one unbind each, cached; a remap in place
            # keeps them valid): made here, not by the layout at promotion (≈ 0.1 s
            # for ≈ 600 mappings at 5 B parameters on the H200).
            for m in [m for m, _, _ in self._maps.values()] + [m for _, m in self._parity]:
                m.pages  # noqa: B018 - a cached property, computed for its cache
        return len(reply.allocations)

    def takeover(self) -> None:
        """A premapped shadow becomes the pool's trainer (a new epoch; a live owner is
        fenced). Then ``localize``, which remaps what it replaced."""
        welcome, _ = P.request(self.sock, P.Takeover(), P.Welcome)
        self.epoch, self.role = welcome.epoch, P.Role.TRAINER.value

    def _refresh(self) -> None:
        """Map again every page mapped here that the state manager replaced after the
        cursor (a page host memory pinned for the GPU is unpinned around it: pinned,
        the GPU would go on reading the old page)."""
        reply, fds = P.request(self.sock, P.Replaced(self.epoch, self._cursor), P.ReplacedReply)
        fds = P.recv_fds(self.sock, reply.n_fds, fds)
        # By mapping: a pinned one is unpinned once, every replaced page of it mapped
        # again, then pinned again. Pinning it between two replacements would fault in
        # a lost page not replaced yet (page-locking fails: error 1, seen on the
        # H200 when a protection group lost several host parity pages).
        todo: dict[int, tuple[object, Mapping, list[tuple[int, int]]]] = {}
        for page, fd in zip(reply.pages, fds, strict=True):
            if page["target"] == "data" and page["name"] in self._maps:
                mapping, importer, _ = self._maps[page["name"]]
                index = page["page"]
            elif page["target"] != "data" and page["group"] < len(self._parity):
                importer, mapping = self._parity[page["group"]]
                index = page["page"] + (
                    self._tier1[page["group"]] if page["target"] == "tier2" else 0
                )
            else:
                os.close(fd)  # not mapped here: nothing to redo
                continue
            todo.setdefault(id(mapping), (importer, mapping, []))[2].append((index, fd))
        for importer, mapping, pages in todo.values():
            nbytes = self._registered.pop(mapping.address, None)
            if nbytes is not None:
                unpin_host(self._cuda_index(), mapping.address)
            for index, fd in pages:
                importer.replace(mapping, index, fd)
                self.remapped += 1
            if nbytes is not None:
                self.register_host(mapping.tensor[:nbytes])
        self._cursor = reply.cursor

    def reconstruct(self, report: dict, only: set[int] | None = None) -> dict:
        """Rebuild every page the report marks, on the device where it lives.

        Raises ``TooManyErasures`` (a FatalFailure naming the group and counts) when a
        group lost more than its parity covers; nothing of that group is written then.
        """
        t0 = time.perf_counter()
        marked = {
            k: v for k, v in report.get("groups", {}).items() if only is None or int(k) in only
        }
        if not marked:
            return {
                "groups": 0,
                "data_pages": 0,
                "tier1_pages": 0,
                "tier2_pages": 0,
                "seconds": 0.0,
            }
        views = {g.gid: g for g in self.layout()}  # (made once, not per call)
        totals = {"data": 0, "tier1": 0, "tier2": 0}
        for gid_text, lost in marked.items():
            g = views[int(gid_text)]
            device = g.data[0].device
            # Host parity staged where the data lives, page by page (not stacked on the
            # host first: a host copy of every parity page before the transfer).
            t1, t2 = _staged(g.tier1, device), _staged(g.tier2, device)
            self._code(g).reconstruct(
                g.data_pages if g.data_pages is not None else g.data,  # checked once
                t1,
                t2,
                lost_data=lost["data"],
                lost_tier1=lost["tier1"],
                lost_tier2=lost["tier2"],
                group=g.gid,
            )
            for tier, staged, host in (("tier1", t1, g.tier1), ("tier2", t2, g.tier2)):
                for j in lost[tier]:
                    host[j].copy_(staged[j])
            for t in totals:
                totals[t] += len(lost[t])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.mark_rebuilt([int(k) for k in marked])
        return {
            "groups": len(marked),
            "data_pages": totals["data"],
            "tier1_pages": totals["tier1"],
            "tier2_pages": totals["tier2"],
            "seconds": time.perf_counter() - t0,
        }

    def mark_rebuilt(self, gids: list[int]) -> None:
        """Tell the state manager these groups' pending pages are rebuilt."""
        P.request(self.sock, P.MarkRebuilt(self.epoch, list(gids)), P.Ok)

    # -- other requests -------------------------------------------------------------

    def status(self) -> dict:
        reply, _ = P.request(self.sock, P.Status(), P.StatusReply)
        return reply.status

    def inject_loss(self, target: str, name: str | int, pages: list[int]) -> None:
        """Fault injection (role faultkit, pool started with allow_fault_injection)."""
        P.request(self.sock, P.InjectLoss(target, str(name), list(pages)), P.Ok)

    def shutdown(self) -> None:
        P.request(self.sock, P.Shutdown(), P.Ok)

    def _cuda_index(self) -> int:
        _, _, index = self.config.device.partition(":")
        return int(index or 0)

    def register_host(self, t: torch.Tensor) -> None:
        """Page-lock host memory of this pool (parity, records) for asynchronous,
        stream-ordered copies to and from the GPU. Undone by ``close`` before unmapping,
        so no registration outlives the mapping it pins."""
        nbytes = t.numel() * t.element_size()
        if self._registered.get(t.data_ptr(), -1) >= nbytes:
            return  # premapped: registered (whole pages) while the shadow was parked
        err = pin_host(self._cuda_index(), t.data_ptr(), nbytes)
        if err != 0:
            raise PoolError(
                f"page-locking {nbytes} bytes of host memory at {t.data_ptr():#x} "
                f"(cuMemHostRegister) failed: CUresult {err}"
            )
        self._registered[t.data_ptr()] = nbytes

    def close(self) -> None:
        """Unmap everything this trainer mapped; retained memory stays with the pool."""
        if self._registered:
            torch.cuda.synchronize()  # no copy may still target memory about to be unmapped
            for ptr in self._registered:
                unpin_host(self._cuda_index(), ptr)
            self._registered = {}
        for mapping, importer, _ in self._maps.values():
            importer.unmap(mapping)
        for importer, mapping in self._parity:
            importer.unmap(mapping)
        self._maps.clear()
        self._parity = []
        self.sock.close()


def _staged(pages: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``torch.stack(pages)`` made on ``device``: each host page copied into its row."""
    out = torch.empty((len(pages), *pages[0].shape), dtype=pages[0].dtype, device=device)
    for row, page in zip(out, pages, strict=True):
        row.copy_(page, non_blocking=True)
    return out
