"""Host backend: every page a memfd, mapped MAP_SHARED by the state manager and trainers.

This is the CPU build's stand-in for HBM and the home of all host-side parity. Page
loss is injected with ``madvise(MADV_HWPOISON)`` where the kernel supports it and, on
kernels without CONFIG_MEMORY_FAILURE (these machines), emulated by truncating the
page's memfd to zero bytes: every process's mapping of it then raises SIGBUS on
access, and ``madvise(MADV_POPULATE_READ)`` fails with EFAULT (real poison: EHWPOISON).
The scan accepts both. ``loss_mechanism`` says which one this owner uses.
"""

from __future__ import annotations

import errno
import os
import resource

from leto.memory import host_pages as hp
from leto.memory.backends.api import Mapping, PageImporter, PageOwner
from leto.memory.errors import PoolFdLimit
from leto.memory.mechanisms import Mechanism, host_poison_mechanism

# Regions scanned with one madvise call before bisecting a failed one.
SCAN_REGION_PAGES = 64
_LOST = (errno.EFAULT, hp.EHWPOISON, errno.EIO)


class HostPage:
    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd


def _map_fds(fds: list[int], page_bytes: int) -> Mapping:
    n = len(fds)
    base = hp.reserve(n * page_bytes)
    try:
        for i, fd in enumerate(fds):
            hp.map_fixed(base + i * page_bytes, fd, page_bytes)
    except OSError:
        hp.unmap(base, n * page_bytes)
        raise
    return Mapping(base, n, page_bytes, lambda: hp.tensor_at(base, n * page_bytes))


class HostPageOwner(PageOwner):
    device = "cpu"

    def __init__(self, page_bytes: int):
        hp.check_page_bytes(page_bytes)
        self.page_bytes = page_bytes
        self.loss_mechanism, self.loss_mechanism_why = host_poison_mechanism()

    def create(self) -> HostPage:
        try:
            return HostPage(hp.new_page(self.page_bytes))
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise PoolFdLimit(
                f"a host page is a memfd the state manager keeps open, and its open-file "
                f"limit ({soft}) is reached: this pool cannot hold more {self.page_bytes}-byte "
                "pages. The allocation was not made and nothing retained changed; raise "
                "`ulimit -n` (hard limit) or use larger pages (--page-bytes)"
            ) from None

    def check_exportable(self, handle: HostPage) -> None:
        if handle.fd < 0:
            raise ValueError("page was already released (or lost)")

    def export_fd(self, handle: HostPage) -> int:
        return os.dup(handle.fd)

    def release(self, handle: HostPage) -> None:
        if handle.fd >= 0:
            os.close(handle.fd)
            handle.fd = -1

    def map(self, handles: list[HostPage]) -> Mapping:
        return _map_fds([h.fd for h in handles], self.page_bytes)

    def unmap(self, mapping: Mapping) -> None:
        hp.unmap(mapping.address, mapping.n_pages * mapping.page_bytes)

    def replace(self, mapping: Mapping, index: int, handle: HostPage) -> None:
        hp.map_fixed(mapping.address + index * self.page_bytes, handle.fd, self.page_bytes)

    def failed_pages(self, mapping: Mapping) -> list[int]:
        failed: list[int] = []

        def scan(first: int, count: int) -> None:
            err = hp.populate_read(
                mapping.address + first * self.page_bytes, count * self.page_bytes
            )
            if err == 0:
                return
            if err not in _LOST:
                raise OSError(
                    err, f"scanning pages {first}..{first + count - 1}: {os.strerror(err)}"
                )
            if count == 1:
                failed.append(first)
                return
            half = count // 2
            scan(first, half)
            scan(first + half, count - half)

        for start in range(0, mapping.n_pages, SCAN_REGION_PAGES):
            scan(start, min(SCAN_REGION_PAGES, mapping.n_pages - start))
        return failed

    def lose(self, mapping: Mapping, index: int, handle: HostPage) -> None:
        if self.loss_mechanism is Mechanism.HWPOISON:
            err = hp.hwpoison(mapping.address + index * self.page_bytes, self.page_bytes)
            if err == 0:
                return
            raise OSError(err, f"MADV_HWPOISON failed: {os.strerror(err)}")
        # Emulation: the page's bytes are gone for every process that maps it.
        os.ftruncate(handle.fd, 0)


class HostPageImporter(PageImporter):
    device = "cpu"

    def __init__(self, page_bytes: int):
        hp.check_page_bytes(page_bytes)
        self.page_bytes = page_bytes

    def map(self, fds: list[int]) -> Mapping:
        try:
            return _map_fds(fds, self.page_bytes)
        finally:
            for fd in fds:  # the mapping keeps the page; the fd is not needed any more
                os.close(fd)

    def unmap(self, mapping: Mapping) -> None:
        hp.unmap(mapping.address, mapping.n_pages * mapping.page_bytes)

    def replace(self, mapping: Mapping, index: int, fd: int) -> None:
        try:  # MAP_FIXED swaps the page atomically: the old one is never touched
            hp.map_fixed(mapping.address + index * self.page_bytes, fd, self.page_bytes)
        finally:
            os.close(fd)
