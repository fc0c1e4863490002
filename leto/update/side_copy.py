"""How ``--undo ahead``'s whole-state copy is queued on the copy stream (issue 59).

Runs in a trainer (``leto.update.rmu.Updater.take_ahead``). The copy (the retained state,
~13 GB at 1 B parameters) is meant to run beside forward and backward. ``Tensor.copy_``
(``cudaMemcpyAsync``, device to device) runs it as kernels on the SMs at the full memory
bandwidth: on an H100 (2026-12-05) it took 8.75 ms and overlapped other work for under
0.1 ms, so it only moved its time from the update to the compute phase.

``LETO_AHEAD_COPY`` picks the mechanism:

* ``sm`` (default): ``Tensor.copy_``;
* ``engines``: ``cuMemcpyBatchAsync`` (CUDA ≥ 12.8, cuda-python's ``cuda.bindings``)
  with ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``, the driver's hint to run the copy
  on the copy engines beside the SMs' work. The hint is advisory; where the call is not
  there (an older driver or cuda-python, a CPU tensor) the copy is ``Tensor.copy_`` and
  ``note`` says so (the checks line).

Either way the copy is stream-ordered on the stream current at the call (the bytes are
the same: the crash tests and certify compare them).
"""

from __future__ import annotations

import os

import torch

ENV = "LETO_AHEAD_COPY"
MECHANISMS = ("sm", "engines")


class SideCopy:
    """Queues device-to-device copies by the mechanism ``LETO_AHEAD_COPY`` names."""

    def __init__(self, device: torch.device, mechanism: str | None = None):
        asked = mechanism or os.environ.get(ENV, "sm")
        if asked not in MECHANISMS:
            raise ValueError(
                f"{ENV}={asked!r}: not a copy mechanism (one of {', '.join(MECHANISMS)})"
            )
        self.asked = asked
        self.mechanism = "sm"
        self.note: str | None = None  # why the mechanism asked for is not the one used
        self._d = None
        if asked == "engines":
            why = self._engines(device)
            if why is None:
                self.mechanism = "engines"
            else:
                self.note = f"{ENV}=engines not taken ({why}): the copy runs on the SMs"

    def _engines(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "not a CUDA device"
        try:
            from cuda.bindings import driver as d
        except ImportError:
            return "cuda-python's cuda.bindings is not installed"
        if not hasattr(d, "cuMemcpyBatchAsync"):
            return "this cuda-python has no cuMemcpyBatchAsync"
        err, version = d.cuDriverGetVersion()
        if err != d.CUresult.CUDA_SUCCESS or version < 12080:
            return f"the CUDA driver ({version}) is older than 12.8"
        self._d = d
        a = d.CUmemcpyAttributes()
        a.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        a.flags = d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        loc = d.CUmemLocation()
        loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = device.index if device.index is not None else torch.cuda.current_device()
        a.srcLocHint = loc
        a.dstLocHint = loc
        self._attrs = a
        return None

    def said(self) -> str:
        """The mechanism in words (the checks line)."""
        if self.mechanism == "engines":
            return "on the copy engines (cuMemcpyBatchAsync, overlap hint)"
        return "on the SMs (copy_)"

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for each (dst, src) of equal bytes, on the current stream."""
        if not pairs:
            return
        if self.mechanism == "sm":
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return
        d = self._d
        dsts, srcs, sizes = [], [], []
        for dst, src in pairs:
            n = src.numel() * src.element_size()
            if n != dst.numel() * dst.element_size():
                raise ValueError(f"copy of {n} bytes into {dst.numel() * dst.element_size()}")
            if not (dst.is_contiguous() and src.is_contiguous()):
                raise ValueError("the copy engines' path copies contiguous tensors only")
            dsts.append(d.CUdeviceptr(dst.data_ptr()))
            srcs.append(d.CUdeviceptr(src.data_ptr()))
            sizes.append(n)
        stream = d.CUstream(torch.cuda.current_stream(pairs[0][1].device).cuda_stream)
        out = d.cuMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [self._attrs], [0], 1, stream)
        if out[0] != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: {out[0]}")
