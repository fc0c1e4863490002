"""Which fault mechanisms this machine really has, found without injecting anything.

Runs in the caller's process. Host memory poisoning: ``madvise(MADV_HWPOISON)`` needs a
kernel built with CONFIG_MEMORY_FAILURE (visible as ``/proc/sys/vm/memory_failure_*``)
and CAP_SYS_ADMIN; without them faultkit emulates a poisoned page by truncating the
page's memfd, after which every mapping of it raises SIGBUS on access and
``madvise(MADV_POPULATE_READ)`` fails with EFAULT (real poison gives EHWPOISON).
Device page loss uses ``cuMemUnmap`` + ``cuMemRelease`` of a VMM page, which needs a
CUDA device and ``cuda.bindings``; the CPU build loses host pages instead.

Not covered: whether the hardware reports real ECC errors (nothing here reads them).
"""

from __future__ import annotations

import enum
import os
from dataclasses import asdict, dataclass
from pathlib import Path


class Mechanism(str, enum.Enum):
    """How a page is lost: the names the pool's status, faultkit's verdicts and the docs
    use (a ``str`` enum: JSON and comparisons see the text)."""

    HWPOISON = "madvise(MADV_HWPOISON)"
    MEMFD_TRUNCATE = "emulated: memfd truncation (SIGBUS on access, MADV_POPULATE_READ -> EFAULT)"
    CUDA_UNMAP = "cuMemUnmap + cuMemRelease of the VMM page"
    HOST_PAGE_AS_DEVICE = (
        "emulated: host memfd page standing in for HBM (CPU build), lost by truncation"
    )

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Mechanisms:
    host_poison: Mechanism
    host_poison_why: str
    device_page_loss: Mechanism
    device_page_loss_why: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def kernel_has_memory_failure() -> bool:
    return Path("/proc/sys/vm/memory_failure_recovery").exists()


def host_poison_mechanism() -> tuple[Mechanism, str]:
    if not kernel_has_memory_failure():
        return (
            Mechanism.MEMFD_TRUNCATE,
            "kernel built without CONFIG_MEMORY_FAILURE (MADV_HWPOISON -> EINVAL)",
        )
    if os.geteuid() != 0:
        return Mechanism.MEMFD_TRUNCATE, "MADV_HWPOISON needs CAP_SYS_ADMIN; not running as root"
    return Mechanism.HWPOISON, "kernel supports memory-failure handling and we are privileged"


def device_page_loss_mechanism() -> tuple[Mechanism, str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return Mechanism.HOST_PAGE_AS_DEVICE, "torch sees no CUDA device"
        import cuda.bindings.driver  # noqa: F401
    except ImportError as e:
        return Mechanism.HOST_PAGE_AS_DEVICE, f"missing {e.name}"
    return Mechanism.CUDA_UNMAP, "CUDA device and cuda.bindings present"


def probe() -> Mechanisms:
    host, host_why = host_poison_mechanism()
    dev, dev_why = device_page_loss_mechanism()
    return Mechanisms(host, host_why, dev, dev_why)
