"""Contracts of a page backend.

A *page* is one physical allocation of ``page_bytes``: a memfd on the host, a
``cuMemCreate`` handle on a GPU. The state manager *owns* pages (``PageOwner``): it
creates them, keeps them alive across trainer deaths, exports a file descriptor per
page for each attach, maps every allocation into its own address space to find lost
pages, and replaces lost pages by fresh zeroed ones at the same addresses. A trainer
*imports* pages (``PageImporter``): it maps the fds of one allocation contiguously and
sees one flat uint8 tensor, without a copy.

Not covered: protection (parity) and naming; those live in the state manager's table.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the state manager never imports torch: it stays small and starts fast
    import torch


@dataclass
class Mapping:
    """One allocation mapped contiguously in this process.

    ``tensor`` is a flat uint8 view of ``n_pages * page_bytes`` bytes starting at
    ``address``, made on first use (trainers only; the state manager never touches
    contents). It is valid until ``unmap`` (``PageImporter.unmap`` /
    ``PageOwner.unmap``); touching it afterwards is a use-after-free.
    """

    address: int
    n_pages: int
    page_bytes: int
    make_tensor: Callable[[], torch.Tensor]
    extra: dict = field(default_factory=dict)  # backend bookkeeping (handles, buffers)

    @cached_property
    def tensor(self) -> torch.Tensor:
        return self.make_tensor()

    @cached_property
    def pages(self) -> tuple[torch.Tensor, ...]:
        """Every page as a view, made at once: C++'s unbind takes ~1 µs a page, a slice
        from Python ~5 µs, and a 5 B-parameter pool has ~38,500 pages whose views the
        updater's layout needs at every recovery."""
        return self.tensor.view(self.n_pages, self.page_bytes).unbind(0)

    def page(self, i: int) -> torch.Tensor:
        return self.pages[i]


class PageOwner(abc.ABC):
    """State-manager side. ``handle`` objects are backend-specific and never leave it."""

    device: str
    page_bytes: int
    loss_mechanism: str  # what ``lose`` does, in words, for reports

    @abc.abstractmethod
    def create(self) -> object:
        """A new zeroed physical page."""

    def create_many(self, n: int) -> list:
        """``n`` new zeroed pages, or none: those made before a failure are released (a
        backend may zero them together)."""
        pages: list = []
        try:
            for _ in range(n):
                pages.append(self.create())
        except BaseException:
            for h in pages:
                self.release(h)
            raise
        return pages

    @abc.abstractmethod
    def export_fd(self, handle: object) -> int:
        """A new file descriptor for the page; the caller closes it after sending."""

    @abc.abstractmethod
    def check_exportable(self, handle: object) -> None:
        """Raise if ``export_fd(handle)`` would fail because the page is gone (checked
        before a reply starts: fds are opened only as their batch is sent)."""

    @abc.abstractmethod
    def release(self, handle: object) -> None:
        """Free the page (mappings elsewhere may keep the memory alive)."""

    @abc.abstractmethod
    def map(self, handles: list[object]) -> Mapping:
        """Map pages contiguously in the owner (for localization and repair)."""

    @abc.abstractmethod
    def unmap(self, mapping: Mapping) -> None: ...

    @abc.abstractmethod
    def replace(self, mapping: Mapping, index: int, handle: object) -> None:
        """Map a fresh page at page ``index`` of ``mapping`` (the lost one is gone)."""

    @abc.abstractmethod
    def failed_pages(self, mapping: Mapping) -> list[int]:
        """Indices of pages of ``mapping`` that can no longer be read. Never touches
        page contents in a way that could crash the owner."""

    @abc.abstractmethod
    def lose(self, mapping: Mapping, index: int, handle: object) -> None:
        """Fault injection: make page ``index`` unreadable, as a memory error would."""


class PageImporter(abc.ABC):
    """Trainer side."""

    device: str
    page_bytes: int

    def take(self, fd: int) -> object:
        """What ``map`` needs of a page fd as it arrives (a CUDA import: the fd is closed
        at once, so replies of any size fit the open-file limit); the fd itself here."""
        return fd

    @abc.abstractmethod
    def map(self, fds: list) -> Mapping:
        """Import and map the pages contiguously; closes every fd it is given (fds or
        what ``take`` made of them)."""

    @abc.abstractmethod
    def unmap(self, mapping: Mapping) -> None: ...

    @abc.abstractmethod
    def replace(self, mapping: Mapping, index: int, fd: int) -> None:
        """Map the page ``fd`` names at page ``index`` of ``mapping``, in place of the
        page mapped there (which the state manager replaced); closes ``fd``. Addresses,
        and so every tensor viewing the mapping, stay valid."""
