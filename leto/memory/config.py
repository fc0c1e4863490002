"""Configuration of a Resilient Memory Pool (frozen; the CLI maps onto it one to one)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

MiB = 1 << 20

ENV_POOL_DIR = "LETO_POOL_DIR"  # private directory holding the state manager's socket
ENV_POOL_TOKEN = "LETO_POOL_TOKEN"  # job token every peer must present (never on argv)
SOCKET_NAME = "pool.sock"


class AllocationKind(enum.Enum):
    PROTECTED = "protected"  # model parameters, optimizer state, gradients: in protection groups
    REUSABLE = "reusable"  # activation-like buffers: contents need not survive a failure
    RECORD = "record"  # small parity-protected host records (the progress marker)


@dataclass(frozen=True)
class PoolConfig:
    device: str = "cpu"  # "cpu" (memfd pages stand in for HBM) or "cuda:N" (CUDA VMM)
    page_bytes: int | None = None  # default: 2 MiB on CUDA (the VMM granularity), 64 KiB on CPU
    data_pages: int = 1024  # D: data pages per protection group
    tier1_pages: int = 16  # H1: tier-1 parity pages per group (host memory)
    tier2_pages: int = 1  # H2: tier-2 parity pages over the tier-1 pages (host memory)
    record_page_bytes: int = 4096  # page size of records (host)
    record_parity_pages: int = 1  # tier-1 parity pages of each record's own group
    allow_fault_injection: bool = False  # accept INJECT_LOSS (faultkit, tests)
    io_timeout_s: float = 10.0  # any single blocking socket operation
    fence_timeout_s: float = 10.0  # waiting for a fenced trainer to die

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}: use cpu or cuda[:N]")
        if self.page_bytes is None:
            default = 2 * MiB if self.device.startswith("cuda") else 64 * 1024
            object.__setattr__(self, "page_bytes", default)
        for name in (
            "page_bytes",
            "data_pages",
            "tier1_pages",
            "tier2_pages",
            "record_page_bytes",
            "record_parity_pages",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.page_bytes % 4096 or self.record_page_bytes % 4096:
            raise ValueError("page_bytes and record_page_bytes must be multiples of 4096")
        if (
            self.data_pages + self.tier1_pages > 65535
            or self.tier1_pages + self.tier2_pages > 65535
        ):
            raise ValueError("a protection group needs D + H1 <= 65535 (GF(2^16))")

    @classmethod
    def for_cuda(cls, index: int = 0, **kw) -> PoolConfig:
        return cls(device=f"cuda:{index}", **kw)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PoolConfig:
        return cls(**d)
