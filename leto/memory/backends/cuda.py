"""CUDA backend: every page one ``cuMemCreate`` allocation of HBM, shared as a POSIX fd.

``CudaPageOwner`` runs in the state-manager process: it creates the pages (so they
outlive any trainer), exports one fd per page per attach, maps each allocation to find
and repair lost pages, and injects page loss the way the paper emulates an HBM page
failure (``cuMemUnmap`` + ``cuMemRelease`` of the page in the owner). ``CudaPageImporter``
runs in a trainer: it imports the fds and maps them contiguously, so the trainer sees one
flat uint8 tensor on ``cuda:N`` with no copy.

Everything goes through the driver API (``cuda.bindings.driver``, from cuda-python),
imported lazily so that CPU machines can import this module; torch is imported only when
a trainer asks for ``Mapping.tensor``, so the state manager runs without it. All calls use
the device's primary context, the one PyTorch uses, so torch kernels see the ranges.

Not covered: real ECC errors (a page is "lost" only when its mapping is gone), access to
a mapping from other GPUs (granted to this device only), and Windows handle types.
"""

from __future__ import annotations

import functools
import os
import resource
from types import SimpleNamespace

from leto.memory.backends.api import Mapping, PageImporter, PageOwner
from leto.memory.mechanisms import Mechanism


class CudaError(RuntimeError):
    """A driver call failed; ``result`` is its CUresult, the message names it."""

    def __init__(self, result, what: str):
        self.result = result
        super().__init__(f"{what}: {_error_name(result)}")


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError(
            "the CUDA page backend needs cuda-python (cuda.bindings.driver): "
            "pip install -e '.[cuda]'"
        ) from e
    return driver


def visible_gpus() -> int | None:
    """How many GPUs the driver shows this process (``CUDA_VISIBLE_DEVICES`` applied),
    without torch and without a CUDA context (``cuInit`` only); None without cuda-python.
    No driver, or a driver that finds none: 0."""
    try:
        d = _driver()
    except ImportError:
        return None
    try:
        (err,) = d.cuInit(0)
        if err != d.CUresult.CUDA_SUCCESS:
            return 0  # e.g. CUDA_ERROR_NO_DEVICE
        err, n = d.cuDeviceGetCount()
    except Exception:  # (cuda-python without a libcuda to load raises on the first call)
        return 0
    return int(n) if err == d.CUresult.CUDA_SUCCESS else 0


def _error_name(result) -> str:
    _, name = _driver().cuGetErrorName(result)
    return name.decode() if name else f"CUresult {int(result)}"


def _call(what: str, fn, *args):
    """Run a driver call; raise with the error's name, else return its value(s)."""
    err, *out = fn(*args)
    if err != _driver().CUresult.CUDA_SUCCESS:
        raise CudaError(err, what)
    return out[0] if len(out) == 1 else tuple(out) if out else None


class _Device:
    """Driver state for one device: its primary context, allocation and access props."""

    def __init__(self, index: int):
        d = self.d = _driver()
        self.index = index
        _call("cuInit", d.cuInit, 0)
        dev = _call(f"cuDeviceGet({index})", d.cuDeviceGet, index)
        self.ctx = _call("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain, dev)
        self.make_current()
        loc = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop = self.prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type, prop.location.id = loc, index
        self.fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.requestedHandleTypes = self.fd_type
        access = d.CUmemAccessDesc()
        access.location.type, access.location.id = loc, index
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = [access]
        self.mapped_attr = d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MAPPED
        self._scanner = None  # the native loss scan, built at its first use
        minimum = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(
            _call("cuMemGetAllocationGranularity", d.cuMemGetAllocationGranularity, prop, minimum)
        )

    def use_pages_of(self, page_bytes: int) -> None:
        # cuMemCreate and cuMemMap reject other sizes with a bare INVALID_VALUE.
        if page_bytes <= 0 or page_bytes % self.granularity:
            raise ValueError(
                f"page_bytes {page_bytes} is not a positive multiple of cuda:{self.index}'s "
                f"VMM allocation granularity {self.granularity} bytes"
            )
        self.page_bytes = page_bytes

    def make_current(self) -> None:
        # The current context is per thread; a caller on another thread needs it set again.
        _call("cuCtxSetCurrent", self.d.cuCtxSetCurrent, self.ctx)

    def map_pages(self, handles: list, what: str) -> Mapping:
        """Reserve a range, map ``handles`` contiguously in it, read-write for this device."""
        d, pb, n = self.d, self.page_bytes, len(handles)
        self.make_current()
        # Alignment 0: the allocation granularity. The page size is any multiple of it
        # (use_pages_of), and the driver takes only a power of two here.
        base = int(_call(f"{what}: reserving {n} pages", d.cuMemAddressReserve, n * pb, 0, 0, 0))
        mapped = 0
        try:
            for i, h in enumerate(handles):
                _call(f"{what}: mapping page {i}", d.cuMemMap, base + i * pb, pb, 0, h, 0)
                mapped += 1
            _call(f"{what}: cuMemSetAccess", d.cuMemSetAccess, base, n * pb, self.access, 1)
        except BaseException:
            for i in range(mapped):
                d.cuMemUnmap(base + i * pb, pb)
            d.cuMemAddressFree(base, n * pb)
            raise
        return Mapping(base, n, pb, lambda: _tensor_at(base, n * pb, self.index))

    def scanner(self):
        """The native loss scan (``scan.py``), built on first use."""
        from leto.memory.backends.scan import driver_scanner

        if self._scanner is None:
            self._scanner = driver_scanner(int(self.mapped_attr))
        return self._scanner

    def unmapped(self, mapping: Mapping) -> list[int]:
        """Indices of ``mapping``'s pages with nothing mapped, by one native loop over
        the driver (``scan.py``): never reads a page."""
        from leto.memory.backends.scan import ScanError

        scanner = self.scanner()
        self.make_current()
        try:
            return scanner.unmapped(mapping.address, mapping.page_bytes, mapping.n_pages)
        except ScanError as e:
            what = f"cuPointerGetAttribute(MAPPED) on page {e.page}"
            raise CudaError(self.d.CUresult(e.result), what) from None

    def is_mapped(self, address: int) -> bool:
        """Asks the driver's page tables only: never reads the page, so a lost one is safe."""
        d = self.d
        err, mapped = d.cuPointerGetAttribute(self.mapped_attr, address)
        # An address inside our reservation with nothing mapped answers INVALID_VALUE.
        if err == d.CUresult.CUDA_ERROR_INVALID_VALUE:
            return False
        if err != d.CUresult.CUDA_SUCCESS:
            raise CudaError(err, f"cuPointerGetAttribute(MAPPED, {address:#x})")
        return bool(mapped)

    def unmap_all(self, mapping: Mapping) -> None:
        d, pb = self.d, mapping.page_bytes
        self.make_current()
        # Work still queued on the range would fault once its pages are gone.
        _call("synchronizing before unmap", d.cuCtxSynchronize)
        lost = set(self.unmapped(mapping))  # a lost page is already unmapped
        for i in range(mapping.n_pages):
            if i not in lost:
                _call(f"unmapping page {i}", d.cuMemUnmap, mapping.address + i * pb, pb)
        _call("cuMemAddressFree", d.cuMemAddressFree, mapping.address, mapping.n_pages * pb)
        mapping.extra.clear()


@functools.cache
def _device(index: int) -> _Device:
    return _Device(index)


def pin_host(device_index: int, address: int, n_bytes: int) -> int:
    """Page-lock host memory (a pool's parity or records) for stream-ordered copies
    with ``cuda:device_index``, through the driver (``cuMemHostRegister``); returns the
    CUresult, 0 when pinned. Not the runtime's ``cudaHostRegister``: its failure stays
    the runtime's last error, which torch's next kernel-launch check raises as its own
    (``AcceleratorError: CUDA error: invalid argument``, from a kernel that did nothing
    wrong: a promoted shadow on the H200, after a premapping tick had met a lost host
    page and rightly given up its head start)."""
    dev = _device(device_index)
    dev.make_current()
    (err,) = dev.d.cuMemHostRegister(address, n_bytes, 0)
    return int(err)


def unpin_host(device_index: int, address: int) -> int:
    """Undo ``pin_host``; returns the CUresult."""
    dev = _device(device_index)
    dev.make_current()
    (err,) = dev.d.cuMemHostUnregister(address)
    return int(err)


def _tensor_at(address: int, n_bytes: int, index: int):
    import torch  # trainers only: the state manager never imports torch

    # torch views (never copies) memory lent through __cuda_array_interface__; stream None:
    # no producer work to wait for. The namespace owns nothing: unmap() ends the memory.
    cai = dict(shape=(n_bytes,), typestr="|u1", data=(address, False), version=3, stream=None)
    tensor = torch.as_tensor(SimpleNamespace(__cuda_array_interface__=cai), device=f"cuda:{index}")
    if tensor.data_ptr() != address:
        raise RuntimeError("torch copied the mapped range instead of viewing it")
    return tensor


def allocation_granularity(device_index: int = 0) -> int:
    """Minimum size step of an fd-exportable VMM page on this device (2 MiB on an H200)."""
    return _Device(device_index).granularity


ZERO_BATCH = 256  # new pages zeroed together (CudaPageOwner.create_many): 512 MiB of 2 MiB


class CudaPage:
    """One ``cuMemCreate`` allocation; ``handle`` is None once released. ``fd`` is its
    exported POSIX fd, kept open so each attach only dups it."""

    __slots__ = ("handle", "fd")

    def __init__(self, handle):
        self.handle = handle
        self.fd: int | None = None


def _live(page: CudaPage):
    if page.handle is None:
        raise ValueError("page was already released (or lost)")
    return page.handle


class _OnDevice:
    def __init__(self, page_bytes: int, device_index: int = 0):
        self._dev = _Device(device_index)
        self._dev.use_pages_of(page_bytes)
        self.page_bytes = page_bytes
        self.device = f"cuda:{device_index}"

    def unmap(self, mapping: Mapping) -> None:
        self._dev.unmap_all(mapping)


class CudaPageOwner(_OnDevice, PageOwner):
    loss_mechanism = Mechanism.CUDA_UNMAP

    def __init__(self, page_bytes: int, device_index: int = 0):
        super().__init__(page_bytes, device_index)
        # Built now: a state manager without a C compiler fails as it starts, not in
        # the middle of a recovery's localization.
        self._dev.scanner()
        self._cached = 0  # exported fds kept open (export_fd)

    def create(self) -> CudaPage:
        return self.create_many(1)[0]

    def create_many(self, n: int) -> list[CudaPage]:
        # cuMemCreate hands back whatever the HBM last held, and parity assumes zeroed
        # pages. Zeroed together, a batch at a time: one mapping, memset and wait per
        # batch, not per page (a 1 B-parameter job's first allocation is ~8,800 pages).
        d = self._dev.d
        self._dev.make_current()
        handles: list = []
        try:
            for _ in range(n):
                handles.append(_call("cuMemCreate", d.cuMemCreate, self.page_bytes, self._dev.prop, 0))
            for i in range(0, n, ZERO_BATCH):
                self._zero_batch(handles[i : i + ZERO_BATCH])
        except BaseException:
            for h in handles:
                d.cuMemRelease(h)
            raise
        return [CudaPage(h) for h in handles]

    def _zero_batch(self, handles: list) -> None:
        d, pb, n = self._dev.d, self.page_bytes, len(handles)
        base = int(_call(f"reserving {n} pages to zero", d.cuMemAddressReserve, n * pb, 0, 0, 0))
        mapped, zeroed = 0, False
        try:
            for h in handles:
                _call("mapping a new page to zero it", d.cuMemMap, base + mapped * pb, pb, 0, h, 0)
                mapped += 1
            _call("cuMemSetAccess on new pages", d.cuMemSetAccess, base, n * pb, self._dev.access, 1)
            _call("zeroing new pages", d.cuMemsetD8, base, 0, n * pb)
            _call("waiting for the zeroing", d.cuCtxSynchronize)  # before the unmaps below
            zeroed = True
        finally:
            # Every page unmapped again: a mapping left here would keep a page's memory
            # after its loss is injected (unmap + release in the owner's pool mapping).
            failed = [(f"unmapping zeroed page {i}", err) for i in range(mapped)
                      if (err := d.cuMemUnmap(base + i * pb, pb)[0]) != d.CUresult.CUDA_SUCCESS]
            (err,) = d.cuMemAddressFree(base, n * pb)
            if err != d.CUresult.CUDA_SUCCESS:
                failed.append(("freeing the zeroing range", err))
            if zeroed and failed:  # (else the first error is already on its way out)
                what, err = failed[0]
                raise CudaError(err, f"{what} ({len(failed)} cleanup call(s) failed)")

    def check_exportable(self, handle: CudaPage) -> None:
        _live(handle)

    def export_fd(self, handle: CudaPage) -> int:
        # Exported once and dup'ed after: a recovering trainer attaches every page, and
        # 7,371 exports took ~0.4 s of a 1 B-parameter model's recovery on the H200.
        # Kept while they take at most a quarter of the open-file limit: replies need
        # room for an fd per page besides (a 5 B-parameter pool: ~40,000 pages).
        if handle.fd is None:
            self._dev.make_current()
            export, what = self._dev.d.cuMemExportToShareableHandle, "exporting a page as an fd"
            fd = int(_call(what, export, _live(handle), self._dev.fd_type, 0))
            if self._cached >= resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4:
                return fd  # the caller's to close, like a dup
            handle.fd = fd
            self._cached += 1
        _live(handle)
        return os.dup(handle.fd)

    def release(self, handle: CudaPage) -> None:
        if handle.fd is not None:
            # The fd references the memory too: a lost page must not survive through it.
            os.close(handle.fd)
            handle.fd = None
            self._cached -= 1
        if handle.handle is not None:
            self._dev.make_current()
            _call("cuMemRelease", self._dev.d.cuMemRelease, handle.handle)
            handle.handle = None

    def map(self, handles: list[CudaPage]) -> Mapping:
        return self._dev.map_pages([_live(h) for h in handles], "owner map")

    def replace(self, mapping: Mapping, index: int, handle: CudaPage) -> None:
        d, pb = self._dev.d, self.page_bytes
        addr = mapping.address + index * pb
        self._dev.make_current()
        if self._dev.is_mapped(addr):
            raise ValueError(f"page {index} is still mapped; only a lost page can be replaced")
        _call(f"mapping a fresh page at {index}", d.cuMemMap, addr, pb, 0, _live(handle), 0)
        _call(f"cuMemSetAccess on page {index}", d.cuMemSetAccess, addr, pb, self._dev.access, 1)

    def failed_pages(self, mapping: Mapping) -> list[int]:
        return self._dev.unmapped(mapping)

    def lose(self, mapping: Mapping, index: int, handle: CudaPage) -> None:
        d, pb = self._dev.d, self.page_bytes
        self._dev.make_current()
        _call("synchronizing before a page loss", d.cuCtxSynchronize)
        _call(f"unmapping page {index}", d.cuMemUnmap, mapping.address + index * pb, pb)
        # Other processes' mappings keep the memory; the owner's copy of it is gone.
        self.release(handle)


class CudaPageImporter(_OnDevice, PageImporter):
    def take(self, fd: int) -> object:
        self._dev.make_current()
        try:
            what = f"importing a page (fd {fd})"
            return _call(what, self._dev.d.cuMemImportFromShareableHandle, fd, self._dev.fd_type)
        finally:
            os.close(fd)  # the imported handle holds the memory; fds are scarce

    def map(self, fds: list) -> Mapping:
        """``fds``: page fds, or handles ``take`` imported already."""
        d = self._dev.d
        self._dev.make_current()
        handles, done = [], 0
        try:
            for fd in fds:
                handles.append(self.take(fd) if isinstance(fd, int) else fd)
                done += 1
        except BaseException:
            for h in handles:
                d.cuMemRelease(h)
            for fd in fds[done + 1 :]:  # (take closed the one that failed)
                if isinstance(fd, int):
                    os.close(fd)
                else:
                    d.cuMemRelease(fd)
            raise
        try:
            return self._dev.map_pages(handles, "importer map")
        finally:
            # cuMemRelease frees only once every mapping of the memory is unmapped too, so
            # the mapping alone keeps the pages; holding the handles would only leak them.
            for i, h in enumerate(handles):
                _call(f"releasing imported handle {i}", d.cuMemRelease, h)

    def replace(self, mapping: Mapping, index: int, fd: int) -> None:
        d, pb = self._dev.d, self.page_bytes
        addr = mapping.address + index * pb
        self._dev.make_current()
        try:
            handle = _call(
                f"importing page {index} (fd {fd})",
                d.cuMemImportFromShareableHandle,
                fd,
                self._dev.fd_type,
            )
        finally:
            os.close(fd)
        try:
            _call("synchronizing before a remap", d.cuCtxSynchronize)
            if self._dev.is_mapped(addr):
                _call(f"unmapping page {index}", d.cuMemUnmap, addr, pb)
            _call(f"mapping page {index} again", d.cuMemMap, addr, pb, 0, handle, 0)
            _call(
                f"cuMemSetAccess on page {index}", d.cuMemSetAccess, addr, pb, self._dev.access, 1
            )
        finally:
            _call(f"releasing imported handle of page {index}", d.cuMemRelease, handle)
