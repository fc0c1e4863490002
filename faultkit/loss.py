"""Losing pool pages on purpose: the one implementation faultkit and ``leto run``'s
fault plans share.

Runs in a faultkit-role client of a rank's state manager, while no trainer runs. The
mechanism is the pool's (``cuMemUnmap`` of a VMM page, ``MADV_HWPOISON`` or the memfd
truncation emulation on host pages) and is reported by its status.
"""

from __future__ import annotations

import random


def lose_pages(client, pages: int, host_parity_pages: int, rng: random.Random) -> dict:
    """``pages`` data pages in *each* protection group of the model state (spread over
    parameters and moments), ``host_parity_pages`` tier-1 pages of the first group, and
    one gradient page. Returns the counts lost, and under ``"short"`` the [group, pages
    it holds] of every group that held fewer pages than asked."""
    lost = {"device": 0, "host": 0, "short": []}
    status = client.status()
    sets = [g for g in status["groups"] if g["kind"] == "set"]
    tier1 = max((g["tier1"] for g in sets), default=0)
    for g in sets:
        slots = [(name, first + i) for name, first, count in g["members"] for i in range(count)]
        if pages > len(slots):
            # A group smaller than what was asked (a small model's last group): all of
            # it is lost, and the verdict says so — with H1 or fewer pages it stays
            # recoverable even when more than H1 were asked.
            lost["short"].append([g["gid"], len(slots)])
        by_name: dict[str, list[int]] = {}
        for name, page in rng.sample(slots, min(pages, len(slots))):
            by_name.setdefault(name, []).append(page)
        for name, chosen in by_name.items():  # one request an allocation, not a page
            client.inject_loss("data", name, chosen)
            lost["device"] += len(chosen)
    if sets and host_parity_pages:
        n = min(host_parity_pages, tier1)
        client.inject_loss("tier1", sets[0]["gid"], list(range(n)))
        lost["host"] += n
    client.inject_loss("data", "grad", [0])
    lost["device"] += 1
    return lost
