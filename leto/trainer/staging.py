"""The checkpoint stager: copies a rank's retained state into host buffers made once,
in the background, for ``torch.distributed.checkpoint.async_save`` to write from.

Runs in the trainer (a thread of its own). DCP's ``DefaultStager`` does the same job,
but its life cycle differs between torch releases: torch 2.11's ``async_save`` left
it unusable for a second save (``KeyError: <class 'type'>`` from its cleared copy
table on the H200, every save after the first), 2.13's leaves it to the caller. This
one follows DCP's ``AsyncStager`` protocol and nothing else, so every release drives
it the same way.

* Buffers: one host tensor per state tensor, pinned when the state is on a GPU (12
  bytes a parameter for AdamW), allocated by the first ``stage`` — ``warm`` runs it at
  start, in the background — and reused by every save: the checkpointer keeps one save
  in flight at a time, so a buffer is never staged into while it is being written.
* Order: ``stage`` records an event on the caller's stream; the copies run on a stream
  of their own after it, so they read the state the caller's stream left (the update
  of that iteration) without the host waiting for the GPU.
* ``close`` is the protocol's and does nothing (some releases call it after each save);
  ``shutdown`` is the checkpointer's, once, at the end.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.staging import AsyncStager


class HostStager(AsyncStager):
    """Stages ``dict[str, Tensor]`` states into kept host buffers (see the module)."""

    _synchronize_after_execute = False  # the staging future says when it is done

    def __init__(self, state: dict[str, torch.Tensor]):
        self.cuda = any(v.is_cuda for v in state.values())
        self._device = next((v.device for v in state.values() if v.is_cuda), None)
        self._stream = torch.cuda.Stream(self._device) if self.cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="leto-ckpt-stage")
        self._bufs: dict[str, torch.Tensor] | None = None
        self.last: Future | None = None  # the last stage's future

    def _buffers(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        bufs = self._bufs
        if bufs is not None and bufs.keys() == state.keys():
            if all(bufs[k].shape == v.shape and bufs[k].dtype == v.dtype for k, v in state.items()):
                return bufs
        self._bufs = {
            k: torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=v.is_cuda)
            for k, v in state.items()
        }
        return self._bufs

    def stage(self, state_dict: dict[str, torch.Tensor]) -> Future:
        """Start copying ``state_dict``; the future gives the host copy."""
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))

        def copy() -> dict[str, torch.Tensor]:
            bufs = self._buffers(state_dict)
            if not self.cuda:
                for k, v in state_dict.items():
                    bufs[k].copy_(v)
                return bufs
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                for k, v in state_dict.items():
                    bufs[k].copy_(v, non_blocking=v.is_cuda)
            self._stream.synchronize()
            return bufs

        self.last = self._pool.submit(copy)
        return self.last

    def synchronize_staging(self) -> None:
        if self.last is not None:
            self.last.result()

    def close(self) -> None:
        """The protocol's: nothing (see the module docstring)."""

    def shutdown(self) -> None:
        """Wait for the last copy and release the buffers (the checkpointer, once)."""
        try:
            self.synchronize_staging()
        finally:
            self._pool.shutdown(wait=True)
            self._bufs = None
