"""GPU kernel: CUDA C++ (``gf_matmul.cu``) compiled by NVRTC (through CuPy) on first use.

Runs in the process that owns the CUDA tensors (the trainer), on the caller's current
torch stream, with pages addressed through a device-side pointer table, so pages of a
protection group may be scattered over many allocations (one VMM mapping per page).
Nothing but the coefficient matrix (2·R·K bytes) and the pointer table (8 bytes a
page) crosses from the host; the multiplication tables are built on the device.

Its binary is kept under Leto's build dir (``leto.gpu_kernels``), so the compile cost
(15.9 s on an H100) is paid once per machine, by the prebuild ``leto run`` starts where
it can.

Fast path: page length a multiple of 16 bytes and every page 16-byte aligned (one
thread per 8 symbols, uint4 loads); with 8, 4 or 2 output rows a variant that computes
only those rows (a multiply's cost is proportional to the rows computed). Anything else runs the same code with one symbol
per thread (correct, several times slower). Not covered: pages on different GPUs in
one call (the codec rejects them).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from leto.erasure.kernels.api import Coefficients, GFKernel
from nvbit_tools import tripwire

ROWS_PER_BLOCK = 16
THREADS = 256
# Threads per block of the 8-symbol kernel. Smaller blocks put more blocks on each SM
# (more independent barriers) at the price of staging the tables more often;
# bench/codec.py times the choices side by side.
ENV_THREADS = "LETO_CODEC_CUDA_THREADS"
DEFAULT_THREADS = 256
# Pages each thread loads ahead of the one it multiplies (bench/codec.py compares them).
ENV_PREFETCH = "LETO_CODEC_PREFETCH"
DEFAULT_PREFETCH = 1
_POINTER_CACHE = 256  # pointer tables kept per process (8 bytes a page each)


def _load_module():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "the CUDA codec kernel needs CuPy (pip install 'leto[cuda]'); the CPU kernel "
            "was not substituted because the pages are on the GPU"
        ) from e
    from leto import gpu_kernels

    # Compiled once per machine, or by the prebuild leto run starts (leto.gpu_kernels).
    return cupy, gpu_kernels.load("codec", lambda path: cupy.RawModule(path=path))


class CudaKernel(GFKernel):
    name = "cuda"

    def __init__(self) -> None:
        self._cupy, self._module = _load_module()
        names = ("v8", "v8_p4", "v8_p2", "v8_p1", "v1")
        names += tuple(f"{n}_pf2" for n in names if n.startswith("v8"))
        self._fn = {name: self._module.get_function(f"gf_matmul_{name}") for name in names}
        self._build = self._module.get_function("gf_build_tables")
        self._horner = {h: self._module.get_function(f"gf_horner_h{h}") for h in range(1, 5)}
        self.threads = int(os.environ.get(ENV_THREADS, DEFAULT_THREADS))
        self.prefetch = int(os.environ.get(ENV_PREFETCH, DEFAULT_PREFETCH))
        if self.prefetch not in (1, 2):
            raise ValueError(f"{ENV_PREFETCH}={self.prefetch}: choose 1 or 2")
        if self.threads not in (64, 128, 256):
            raise ValueError(f"{ENV_THREADS}={self.threads}: choose 64, 128 or 256")
        self._pointers: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def kernel_info(self) -> dict[str, dict[str, int]]:
        """Registers, spills and shared memory of the compiled kernels (for benchmarks)."""
        return {
            f"gf_matmul_{v}": {
                "registers": f.num_regs,
                "local_bytes": f.local_size_bytes,
                "shared_bytes": f.shared_size_bytes,
            }
            for v, f in self._fn.items()
        }

    def tables(self, coeffs: Coefficients, device: torch.device) -> torch.Tensor:
        """Packed nibble tables for ``coeffs`` on ``device``, built there and cached."""
        key = ("cuda", device.index)
        t = coeffs.derived.get(key)
        if t is None:
            n_rb = -(-coeffs.rows // ROWS_PER_BLOCK)
            padded = np.zeros((n_rb * ROWS_PER_BLOCK, coeffs.cols), dtype=np.uint16)
            padded[: coeffs.rows] = coeffs.matrix
            c = torch.from_numpy(padded).pin_memory().to(device, non_blocking=True)
            t = torch.empty(n_rb * coeffs.cols * 512, dtype=torch.int32, device=device)
            with self._launch_ctx(device):
                blocks = min(4096, -(-t.numel() // THREADS))
                self._build(
                    (blocks,),
                    (THREADS,),
                    (
                        np.uint64(c.data_ptr()),
                        np.uint64(t.data_ptr()),
                        np.int32(coeffs.cols),
                        np.int32(n_rb),
                    ),
                )
            c.record_stream(torch.cuda.current_stream(device))
            coeffs.derived[key] = t
        return t

    def _pointer_table(self, device: torch.device, ptrs: list[int]) -> torch.Tensor:
        """Page addresses on the device; cached, since groups are encoded again and again.

        Copied from pinned memory without blocking the host, so the GPU never idles
        while Python prepares the next call.
        """
        key = (device.index, tuple(ptrs))
        table = self._pointers.get(key)
        if table is None:
            host = torch.tensor(ptrs, dtype=torch.int64).pin_memory()
            table = host.to(device, non_blocking=True)
            self._pointers[key] = table
            if len(self._pointers) > _POINTER_CACHE:
                self._pointers.popitem(last=False)
        else:
            self._pointers.move_to_end(key)
        # The allocator must not hand this memory out again (after eviction) before
        # every kernel that reads it on this stream has finished.
        table.record_stream(torch.cuda.current_stream(device))
        return table

    def _launch_ctx(self, device: torch.device):
        return tripwire.launch_on_torch_stream(device)

    def horner(
        self,
        m: Coefficients,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        *,
        xor_with: Sequence[torch.Tensor] | None = None,
        accumulate: bool = False,
    ) -> bool:
        """The contract for a code's own generator by its Horner scheme
        (``leto.erasure.horner``): ``m`` is ``horner_matrix`` of the inputs' run, one
        output a parity row (at most 4). False, and nothing done, where the pages are
        not whole 16-byte vectors (the caller runs ``matmul``)."""
        device = outputs[0].device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        n_bytes = outputs[0].numel()
        pages = list(inputs) + list(outputs) + (list(xor_with) if xor_with is not None else [])
        ptrs = [p.data_ptr() for p in pages]
        h = len(outputs)
        if h not in self._horner or n_bytes % 16 or any(a % 16 for a in ptrs):
            return False
        tables = self.tables(m, device)
        table = self._pointer_table(device, ptrs)
        k = len(inputs)
        in_ptr = table.data_ptr()
        out_ptr = in_ptr + 8 * k
        in2_ptr = out_ptr + 8 * h if xor_with is not None else 0
        n_items = n_bytes // 16
        blocks = -(-n_items // THREADS)
        tw = tripwire.launch_arg(device, blocks)
        with self._launch_ctx(device):
            self._horner[h](
                (blocks,),
                (THREADS,),
                (
                    np.uint64(in_ptr),
                    np.uint64(in2_ptr),
                    np.uint64(out_ptr),
                    np.uint64(tables.data_ptr()),
                    np.int32(k),
                    np.int64(n_items),
                    np.int32(1 if accumulate else 0),
                    np.uint64(tw),
                ),
            )
        if tw:
            tripwire.fire(device)  # SIGKILL with this kernel in flight
        return True

    def matmul(
        self,
        coeffs: Coefficients,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        *,
        col_offset: int = 0,
        xor_with: Sequence[torch.Tensor] | None = None,
        accumulate: bool = False,
    ) -> None:
        device = outputs[0].device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        tables = self.tables(coeffs, device)
        n_bytes = outputs[0].numel()
        pages = list(inputs) + list(outputs) + (list(xor_with) if xor_with is not None else [])
        ptrs = [p.data_ptr() for p in pages]
        vec = 8 if n_bytes % 16 == 0 and all(a % 16 == 0 for a in ptrs) else 1
        n_items = n_bytes // (2 * vec)
        table = self._pointer_table(device, ptrs)
        k, r = len(inputs), len(outputs)
        in_ptr = table.data_ptr()
        out_ptr = in_ptr + 8 * k
        in2_ptr = out_ptr + 8 * r if xor_with is not None else 0
        n_rb = -(-r // ROWS_PER_BLOCK)
        threads = self.threads if vec == 8 else THREADS
        grid = (-(-n_items // threads), n_rb)
        tw = tripwire.launch_arg(device, grid[0] * grid[1])  # 0 unless faultkit armed it
        name = "v8" if vec == 8 else "v1"
        if vec == 8 and n_rb == 1 and r <= 8:
            # Fewer rows, fewer lookups: the kernel computing the smallest row-pair
            # count that holds them (bench/codec.py --parity-pages times each).
            name = "v8_p1" if r <= 2 else "v8_p2" if r <= 4 else "v8_p4"
        if vec == 8 and self.prefetch == 2:
            name += "_pf2"
        with self._launch_ctx(device):
            self._fn[name](
                grid,
                (threads,),
                (
                    np.uint64(in_ptr),
                    np.uint64(in2_ptr),
                    np.uint64(out_ptr),
                    np.uint64(tables.data_ptr()),
                    np.int32(k),
                    np.int32(coeffs.cols),
                    np.int32(col_offset),
                    np.int64(n_items),
                    np.int32(r),
                    np.int32(1 if accumulate else 0),
                    np.uint64(tw),
                ),
            )
        if tw:
            tripwire.fire(device)  # SIGKILL with this kernel in flight
