"""Turning caller tensors into the flat byte pages the kernels work on, with checks.

A "page list" is either one tensor whose first dimension counts pages (each page the
contiguous bytes of ``t[i]``) or a sequence of tensors, one per page. Pages are raw
bytes whatever their dtype: every check happens before any byte is read or written,
so a rejected call leaves all pages as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leto.erasure.errors import PageDTypeError, PageShapeError
from leto.erasure.field import SYMBOL_BYTES

PageInput = torch.Tensor | Sequence[torch.Tensor]


def group_name(group: object) -> str:
    return "(unnamed)" if group is None else str(group)


@dataclass(frozen=True)
class PageList:
    """Flat uint8 views (no copies) of a list of equally sized pages."""

    pages: tuple[torch.Tensor, ...]  # build once with as_pages and pass it again: no re-checks
    page_bytes: int
    dtype: torch.dtype
    device: torch.device

    def __len__(self) -> int:
        return len(self.pages)

    # Sub-lists of a checked list need no checks: the same views, so a 5 B-parameter
    # model's ~38,500 pages are checked once per list, not once per chunk using them
    # (~5 µs a page in Python: 0.2-0.4 s of a promoted trainer's first update).
    def __getitem__(self, i: slice) -> PageList:
        if not isinstance(i, slice):
            raise TypeError(f"a PageList is sliced (got {type(i).__name__}); .pages[i] is a page")
        return PageList(self.pages[i], self.page_bytes, self.dtype, self.device)

    def take(self, indices) -> PageList:
        """The pages at ``indices``, in that order."""
        return PageList(
            tuple(self.pages[i] for i in indices), self.page_bytes, self.dtype, self.device
        )

    @staticmethod
    def join(parts: list[PageList], what: str = "pages", group: object = None) -> PageList:
        """One list of ``parts``' pages, in order (checked per part, not per page)."""
        if not parts:
            raise PageShapeError(f"protection group {group_name(group)}: no {what} pages given")
        a = parts[0]
        for k, b in enumerate(parts[1:], 1):
            if (b.page_bytes, b.dtype, b.device) != (a.page_bytes, a.dtype, a.device):
                raise PageShapeError(
                    f"protection group {group_name(group)}: {what} part {k} has "
                    f"{b.page_bytes}-byte {b.dtype} pages on {b.device}, part 0 "
                    f"{a.page_bytes}-byte {a.dtype} pages on {a.device}"
                )
        return PageList(tuple(t for p in parts for t in p.pages), a.page_bytes, a.dtype, a.device)


def _byte_view(t: torch.Tensor, what: str, group: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise PageDTypeError(
            f"protection group {group_name(group)}: {what} is a {type(t).__name__}, not a torch.Tensor"
        )
    if not t.is_contiguous():
        raise PageDTypeError(
            f"protection group {group_name(group)}: {what} is not contiguous; pages are raw "
            "contiguous bytes (call .contiguous() on a copy, or pass the underlying page)"
        )
    return t.reshape(-1).view(torch.uint8)


def as_pages(obj: PageInput, count: int | None, what: str, group: object) -> PageList:
    """Validate and flatten ``obj`` into ``count`` byte pages (any count if None)."""
    if isinstance(obj, PageList):
        if count is not None and len(obj) != count:
            raise PageShapeError(
                f"protection group {group_name(group)}: expected {count} {what} pages, got {len(obj)}"
            )
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.dim() < 1:
            raise PageShapeError(
                f"protection group {group_name(group)}: {what} is a 0-d tensor; expected pages along dim 0"
            )
        if obj.numel() == 0:
            raise PageShapeError(f"protection group {group_name(group)}: {what} pages are empty")
        if count is not None and obj.shape[0] != count:
            raise PageShapeError(
                f"protection group {group_name(group)}: expected {count} {what} pages, got {obj.shape[0]}"
            )
        # One tensor: a single dtype, device and page size by construction, so the
        # per-page checks below are skipped (they cost ~4 µs a page in Python).
        flat = _byte_view(obj, what, group).view(obj.shape[0], -1)
        return PageList(flat.unbind(0), flat.shape[1], obj.dtype, obj.device)
    else:
        raw = list(obj)
    if count is not None and len(raw) != count:
        raise PageShapeError(
            f"protection group {group_name(group)}: expected {count} {what} pages, got {len(raw)}"
        )
    if not raw:
        raise PageShapeError(f"protection group {group_name(group)}: no {what} pages given")
    first = raw[0]
    if not isinstance(first, torch.Tensor):
        raise PageDTypeError(
            f"protection group {group_name(group)}: {what} page 0 is a {type(first).__name__}, not a torch.Tensor"
        )
    views = []
    for i, t in enumerate(raw):
        if not isinstance(t, torch.Tensor):
            raise PageDTypeError(
                f"protection group {group_name(group)}: {what} page {i} is a {type(t).__name__}, not a torch.Tensor"
            )
        if t.dtype != first.dtype:
            raise PageDTypeError(
                f"protection group {group_name(group)}: {what} page {i} has dtype {t.dtype}, "
                f"page 0 has {first.dtype}; all {what} pages of a call must share one dtype"
            )
        if t.device != first.device:
            raise PageDTypeError(
                f"protection group {group_name(group)}: {what} page {i} is on {t.device}, "
                f"page 0 on {first.device}"
            )
        v = _byte_view(t, f"{what} page {i}", group)
        if views and v.numel() != views[0].numel():
            raise PageShapeError(
                f"protection group {group_name(group)}: {what} page {i} has {v.numel()} bytes, "
                f"page 0 has {views[0].numel()}; pages of a group are equally sized"
            )
        views.append(v)
    if views[0].numel() == 0:
        raise PageShapeError(f"protection group {group_name(group)}: {what} pages are empty")
    return PageList(tuple(views), views[0].numel(), first.dtype, first.device)


def parity_page_bytes(page_bytes: int) -> int:
    """Parity pages cover whole symbols: an odd data page gets one extra parity byte."""
    return -(-page_bytes // SYMBOL_BYTES) * SYMBOL_BYTES


def same_device(group: object, *lists: PageList) -> torch.device:
    dev = lists[0].device
    for pl in lists[1:]:
        if pl.device != dev:
            raise PageDTypeError(
                f"protection group {group_name(group)}: pages on {dev} and on {pl.device}; "
                "one call works on one device"
            )
    return dev


def padded(pages: PageList) -> tuple[torch.Tensor, ...]:
    """Whole-symbol views of the pages: odd pages get a zero-padded copy (slow path)."""
    if pages.page_bytes % SYMBOL_BYTES == 0:
        return pages.pages
    out = []
    for p in pages.pages:
        q = torch.zeros(pages.page_bytes + 1, dtype=torch.uint8, device=p.device)
        q[:-1].copy_(p)
        out.append(q)
    return tuple(out)
