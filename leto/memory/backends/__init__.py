"""Page backends: one physical allocation per page, exported as file descriptors.

``api`` holds the two contracts (``PageOwner`` in the state manager, ``PageImporter`` in
trainers); ``host`` implements them with memfd pages (the CPU build's stand-in for HBM,
and all host parity), ``cuda`` with CUDA VMM pages.
"""

from __future__ import annotations

from leto.memory.backends.api import Mapping, PageImporter, PageOwner


def owner_for(device: str, page_bytes: int) -> PageOwner:
    if device == "cpu":
        from leto.memory.backends.host import HostPageOwner

        return HostPageOwner(page_bytes)
    if device.startswith("cuda"):
        from leto.memory.backends.cuda import CudaPageOwner

        return CudaPageOwner(page_bytes, _index(device))
    raise ValueError(f"unknown pool device {device!r}: use cpu or cuda[:N]")


def importer_for(device: str, page_bytes: int) -> PageImporter:
    if device == "cpu":
        from leto.memory.backends.host import HostPageImporter

        return HostPageImporter(page_bytes)
    if device.startswith("cuda"):
        from leto.memory.backends.cuda import CudaPageImporter

        return CudaPageImporter(page_bytes, _index(device))
    raise ValueError(f"unknown pool device {device!r}: use cpu or cuda[:N]")


def _index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


__all__ = ["Mapping", "PageImporter", "PageOwner", "importer_for", "owner_for"]
