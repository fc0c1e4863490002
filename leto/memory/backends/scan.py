"""The loss scan's native loop (``scan.c``): which pages of a mapped range are unmapped.

Runs in the state manager (``CudaPageOwner.failed_pages``, at every localization) and
in its shutdown (``unmap_all``). The C loop calls the driver's
``cuPointerGetAttribute(MAPPED)`` once per page through a function pointer: at ~38,500
pages (a 5 B-parameter pool) the same loop in Python through cuda.bindings was on the
recovery's critical path. Tests pass a stand-in for the driver's function, so the loop
is checked on machines without a GPU.

Not covered: other attributes or a batched driver query (the driver has none for
"mapped").
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from leto.native import build_shared, compiler

SOURCE = Path(__file__).with_name("scan.c")
# CUresult (*)(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)


class ScanError(RuntimeError):
    """The driver answered the query for one page with an unexpected error."""

    def __init__(self, page: int, result: int):
        self.page, self.result = page, result
        super().__init__(f"cuPointerGetAttribute(MAPPED) on page {page} failed: CUresult {result}")


class Scanner:
    """``scanner.unmapped(base, page_bytes, n_pages)`` → indices of the unmapped pages."""

    def __init__(self, query: int | ctypes._CFuncPtr, attribute: int):
        """``query``: the address of (or a ctypes function for) the driver's
        ``cuPointerGetAttribute``; ``attribute``: ``CU_POINTER_ATTRIBUTE_MAPPED``."""
        cc = compiler("CC", ("cc", "gcc"), f"the state manager's loss scan ({SOURCE.name})")
        lib = ctypes.CDLL(str(build_shared(SOURCE, "scan", cc, ["-O2", "-fPIC"], timeout_s=120)))
        fn = self._fn = lib.leto_unmapped_pages
        fn.restype = ctypes.c_int64
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64,
            ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_int),
        ]  # fmt: skip
        self._query = query  # kept alive: C holds its address
        self._address = (
            query if isinstance(query, int) else ctypes.cast(query, ctypes.c_void_p).value
        )
        self._attribute = attribute

    def unmapped(self, base: int, page_bytes: int, n_pages: int) -> list[int]:
        out = (ctypes.c_int64 * max(n_pages, 1))()
        page, code = ctypes.c_int64(-1), ctypes.c_int(0)
        found = self._fn(
            self._address, self._attribute, base, page_bytes, n_pages, out,
            ctypes.byref(page), ctypes.byref(code),
        )  # fmt: skip
        if found < 0:
            raise ScanError(page.value, code.value)
        return out[:found]


def driver_scanner(mapped_attribute: int) -> Scanner:
    """A scanner over libcuda's own ``cuPointerGetAttribute`` (the library cuda.bindings
    loaded: the same soname, so the same handle)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    return Scanner(
        ctypes.cast(libcuda.cuPointerGetAttribute, ctypes.c_void_p).value, mapped_attribute
    )
