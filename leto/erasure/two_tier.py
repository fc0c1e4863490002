"""``TwoTierCode``: tier-1 parity over the data pages, tier-2 parity over tier 1 (§4.1).

Tier-1 parity (H1 pages) protects the D device pages of a protection group; tier-2
parity (H2 pages) protects the tier-1 pages, which live in host memory and can be lost
to host memory errors themselves. Both tiers use the same Reed–Solomon
construction (``field.rs_generator``), so with H2 = 1 tier 2 is the XOR of the tier-1
pages.

Reconstruction rebuilds lost tier-1 pages from tier 2 first (16 pages read instead of
1024), then lost data pages from tier 1; it succeeds whenever the lost pages are within
what the two codes can decode together, which includes the paper's rule (≤ H1 data
pages and ≤ H2 tier-1 pages) and more: a lost tier-1 page also counts as an ordinary
tier-1 erasure when tier 2 cannot help. Not covered: when parity is consistent with
data (that is the updater's marker), and where pages live.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from leto.erasure.codec import ReedSolomon
from leto.erasure.errors import PageRangeError, PageShapeError, TooManyErasures
from leto.erasure.pages import PageInput, as_pages, group_name, parity_page_bytes


@dataclass(frozen=True)
class RebuildReport:
    """What ``TwoTierCode.reconstruct`` rebuilt, by tier."""

    data_pages: tuple[int, ...]
    tier1_pages: tuple[int, ...]
    tier2_pages: tuple[int, ...]
    tier1_from_tier2: tuple[int, ...]  # tier-1 pages rebuilt from tier 2 (the cheap way)


class TwoTierCode:
    def __init__(
        self,
        data_pages: int = 1024,
        tier1_pages: int = 16,
        tier2_pages: int = 1,
        *,
        kernel: str | None = None,
    ):
        self.tier1 = ReedSolomon(data_pages, tier1_pages, kernel=kernel)
        self.tier2 = ReedSolomon(tier1_pages, tier2_pages, kernel=kernel)

    @property
    def data_pages(self) -> int:
        return self.tier1.data_pages

    @property
    def tier1_pages(self) -> int:
        return self.tier1.parity_pages

    @property
    def tier2_pages(self) -> int:
        return self.tier2.parity_pages

    def __repr__(self) -> str:
        return f"TwoTierCode(D={self.data_pages}, H1={self.tier1_pages}, H2={self.tier2_pages})"

    def encode(self, data: PageInput, *, group: object = None):
        """(tier1, tier2) parity tensors for ``data`` on the data's device."""
        t1 = self.tier1.encode(data, group=group)
        t2 = self.tier2.encode(t1, group=group)
        return t1, t2

    def refresh_tier2(self, tier1: PageInput, tier2: PageInput, *, group: object = None) -> None:
        """Re-encode tier 2 from tier 1 (after tier 1 changed): reads H1 pages only."""
        self.tier2.encode(tier1, out=tier2, group=group)

    def update(
        self,
        tier1: PageInput,
        tier2: PageInput,
        first_page: int,
        old: PageInput,
        new: PageInput,
        *,
        group: object = None,
    ) -> None:
        """Incremental update of both tiers for a run of changed data pages."""
        self.tier1.update(tier1, first_page, old, new, group=group)
        self.refresh_tier2(tier1, tier2, group=group)

    def verify(
        self, data: PageInput, tier1: PageInput, tier2: PageInput, *, group: object = None
    ) -> bool:
        return self.tier1.verify(data, tier1, group=group) and self.tier2.verify(
            tier1, tier2, group=group
        )

    def reconstruct(
        self,
        data: PageInput,
        tier1: PageInput,
        tier2: PageInput,
        *,
        lost_data: Iterable[int] = (),
        lost_tier1: Iterable[int] = (),
        lost_tier2: Iterable[int] = (),
        group: object = None,
    ) -> RebuildReport:
        """Rebuild lost pages of every tier in place; ``TooManyErasures`` writes nothing."""
        D, H1, H2 = self.data_pages, self.tier1_pages, self.tier2_pages
        ld = self._indices(lost_data, D, "data", group)
        l1 = self._indices(lost_tier1, H1, "tier-1", group)
        l2 = self._indices(lost_tier2, H2, "tier-2", group)
        # Validate every argument before the first write so a refusal changes nothing.
        d = as_pages(data, D, "data", group)
        p1 = as_pages(tier1, H1, "tier-1", group)
        p2 = as_pages(tier2, H2, "tier-2", group)
        want = parity_page_bytes(d.page_bytes)
        if p1.page_bytes != want or p2.page_bytes != want:
            raise PageShapeError(
                f"protection group {group_name(group)}: tier-1 pages are {p1.page_bytes} bytes and "
                f"tier-2 pages {p2.page_bytes}, expected {want} for data pages of {d.page_bytes}; "
                "nothing was rebuilt"
            )

        # Tier 2 can rebuild lost tier-1 pages when tier 1 ∪ tier 2 has ≤ H2 erasures.
        via_t2 = len(l1) > 0 and len(l1) + len(l2) <= H2
        t1_left = () if via_t2 else l1
        if len(ld) + len(t1_left) > H1:
            raise TooManyErasures(
                group,
                len(ld) + len(l1),
                H1 + (H2 if l1 else 0),
                f"{len(ld)} data pages, {len(l1)} tier-1 and {len(l2)} tier-2 pages lost; "
                f"tier 1 tolerates {H1} erasures, tier 2 rebuilds at most {H2} tier-1 pages "
                "and only while tier 2 itself is intact enough",
            )
        if via_t2:
            self.tier2.reconstruct(tier1, tier2, list(l1) + [H1 + j for j in l2], group=group)
        self.tier1.reconstruct(data, tier1, list(ld) + [D + j for j in t1_left], group=group)
        if l2 and not via_t2:
            self.tier2.reconstruct(tier1, tier2, [H1 + j for j in l2], group=group)
        return RebuildReport(ld, l1, l2, l1 if via_t2 else ())

    @staticmethod
    def _indices(pages: Iterable[int], limit: int, what: str, group: object) -> tuple[int, ...]:
        items = [int(i) for i in pages]
        for i in items:
            if i < 0 or i >= limit:
                raise PageRangeError(
                    f"protection group {group_name(group)}: lost {what} page {i} outside 0..{limit - 1}; nothing was rebuilt"
                )
        if len(set(items)) != len(items):
            raise PageRangeError(
                f"protection group {group_name(group)}: lost {what} pages {items} name a page twice"
            )
        return tuple(sorted(items))
