"""Thin libc layer for host pages: memfd pages mapped contiguously, scanned with madvise.

Used by both sides of the host backend (state manager and trainer). Python's ``mmap``
module cannot map at a chosen address, so ranges are reserved and filled through libc
(``mmap`` with MAP_FIXED over a PROT_NONE reservation), which is how one allocation made
of many separate memfd pages appears as one contiguous tensor.

Not covered: huge pages (pages are ordinary shared memory; page_bytes must be a
multiple of the OS page size).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

PROT_NONE = 0
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_READ = 22  # Linux 5.14+: fault pages in for reading, report failures
MADV_HWPOISON = 100
EHWPOISON = 133
OS_PAGE = mmap.PAGESIZE


def _check(ret: int | None, what: str) -> int:
    if ret is None or ret == MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def reserve(n_bytes: int) -> int:
    """Reserve (not commit) a contiguous range of address space."""
    return _check(
        _libc.mmap(
            None, n_bytes, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0
        ),
        f"reserving {n_bytes} bytes of address space",
    )


def map_fixed(address: int, fd: int, n_bytes: int) -> None:
    """Map ``fd`` (shared, read-write) exactly at ``address``, replacing what was there."""
    got = _check(
        _libc.mmap(
            address, n_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd, 0
        ),
        f"mapping fd {fd} at {address:#x}",
    )
    if got != address:
        raise OSError(errno.EFAULT, f"kernel mapped fd {fd} at {got:#x}, asked {address:#x}")


def unmap(address: int, n_bytes: int) -> None:
    if _libc.munmap(address, n_bytes) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unmapping {n_bytes} bytes at {address:#x}: {os.strerror(e)}")


def populate_read(address: int, n_bytes: int) -> int:
    """0 if every page of the range can be read, else the errno (EFAULT, EHWPOISON).

    Never raises SIGBUS: the kernel reports the failure instead of delivering it.
    """
    if _libc.madvise(address, n_bytes, MADV_POPULATE_READ) == 0:
        return 0
    return ctypes.get_errno()


def hwpoison(address: int, n_bytes: int) -> int:
    """Real poisoning (needs CONFIG_MEMORY_FAILURE and CAP_SYS_ADMIN); 0 or errno."""
    if _libc.madvise(address, n_bytes, MADV_HWPOISON) == 0:
        return 0
    return ctypes.get_errno()


def tensor_at(address: int, n_bytes: int):
    """A flat uint8 tensor over mapped memory, without a copy."""
    import torch  # trainers only

    buf = (ctypes.c_uint8 * n_bytes).from_address(address)
    return torch.frombuffer(buf, dtype=torch.uint8)


def new_page(page_bytes: int, name: str = "leto-page") -> int:
    """A zeroed memfd of ``page_bytes`` (its own physical allocation)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, page_bytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def check_page_bytes(page_bytes: int) -> None:
    if page_bytes <= 0 or page_bytes % OS_PAGE:
        raise ValueError(
            f"page_bytes={page_bytes} must be a positive multiple of the OS page size {OS_PAGE}"
        )
