"""The fault plan (``LETO_FAULT_PLAN``): its schema, checked before anything starts.

Runs in the agent (``leto run``). A fault plan is a JSON list of entries, one per
injected failure; the fault tool (faultkit) arms them in the trainers and the agent
loses pool pages between fencing and promotion. An entry:

=====================  ========  ==========================================================
key                    type      meaning
=====================  ========  ==========================================================
``generation``         int ≥ 0   the failure's generation (the k-th failure strikes gen. k)
``rank``               int       the rank that fails, 0 ≤ rank < world size
``at``                 str       ``NAME@ITERATION`` or ``NAME@ITERATION#N`` (a fault point:
                                 ``leto.plugins.FAULT_POINTS``)
``mode``               str       how it fails (faultkit's modes; default ``kill``)
``lose_pages``         int ≥ 0   data pages lost in every protection group of every rank
``host_parity_pages``  int ≥ 0   tier-1 host parity pages lost
``inject``             list      explicit losses ``[kind, allocation, [pages...]]``
``when``               str       ``now`` (default) or ``parked``: at the point, the failing
                                 trainer first waits until every rank's shadow of the next
                                 generation has parked (what a failure meets in a job that
                                 has run a while; ignored with shadows off)
=====================  ========  ==========================================================

Page loss needs pools that allow it (``leto run --allow-fault-injection``). Before this
check a guessed key (``"pages": 3``) was ignored and the job "succeeded" with nothing
lost, and page loss without the flag was one warning line: both are refused now, naming
what was wrong and the keys that exist. What the fault tool does with ``mode`` it checks
itself (leto never imports it).
"""

from __future__ import annotations

import difflib
import json
import re

from leto.errors import InvalidInput
from leto.plugins import FAULT_POINTS

KEYS = {
    "generation": int,
    "rank": int,
    "at": str,
    "mode": str,
    "lose_pages": int,
    "host_parity_pages": int,
    "inject": list,
    "when": str,
}
WHEN = ("now", "parked")
REQUIRED = ("generation", "rank", "at")
_AT = re.compile(r"^[A-Za-z_][\w.]*@\d+(#\d+)?$")


def parse(text: str, world_size: int, allow_fault_injection: bool) -> list[dict]:
    """The plan's entries, checked; ``InvalidInput`` names the first problem."""
    where = "LETO_FAULT_PLAN"
    try:
        plan = json.loads(text or "[]")
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{where} is not JSON ({e}); nothing was started") from None
    if not isinstance(plan, list):
        raise InvalidInput(f"{where} must be a JSON list of entries, not {type(plan).__name__}")
    allowed = ", ".join(KEYS)
    for i, f in enumerate(plan):
        at = f"{where} entry {i}"
        if not isinstance(f, dict):
            raise InvalidInput(f"{at} is a {type(f).__name__}, not an object with keys {allowed}")
        unknown = sorted(set(f) - set(KEYS))
        if unknown:
            raise InvalidInput(f"{at}: unknown key(s) {unknown}; the keys are {allowed}")
        missing = [k for k in REQUIRED if k not in f]
        if missing:
            raise InvalidInput(f"{at}: missing {missing} (required: {', '.join(REQUIRED)})")
        for k, v in f.items():
            # bool is an int to Python, never to a plan.
            if not isinstance(v, KEYS[k]) or isinstance(v, bool):
                raise InvalidInput(f"{at}: {k}={v!r} is not a {KEYS[k].__name__}")
        for k in ("generation", "lose_pages", "host_parity_pages"):
            if f.get(k, 0) < 0:
                raise InvalidInput(f"{at}: {k}={f[k]} is negative")
        if not 0 <= f["rank"] < world_size:
            raise InvalidInput(f"{at}: rank {f['rank']} is not in 0..{world_size - 1}")
        if not _AT.match(f["at"]):
            raise InvalidInput(
                f"{at}: at={f['at']!r}: expected NAME@ITERATION or NAME@ITERATION#N "
                "(e.g. update.optimizer@5#1)"
            )
        name = f["at"].split("@")[0]
        if name not in FAULT_POINTS:
            close = difflib.get_close_matches(name, FAULT_POINTS, n=3, cutoff=0.5)
            raise InvalidInput(
                f"{at}: at={f['at']!r}: no fault point is named {name!r}"
                + (f" (did you mean {' or '.join(close)}?)" if close else "")
                + f"; the points are {', '.join(FAULT_POINTS)} — nothing was started"
            )
        if f.get("when", "now") not in WHEN:
            raise InvalidInput(f"{at}: when={f['when']!r}: use {' or '.join(WHEN)}")
        for e in f.get("inject", []):
            ok = (
                isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                and isinstance(e[1], (str, int)) and isinstance(e[2], list)
                and all(isinstance(p, int) and p >= 0 for p in e[2])
            )  # fmt: skip
            if not ok:
                raise InvalidInput(f"{at}: inject entry {e!r} is not [kind, name, [pages...]]")
        loses = f.get("lose_pages", 0) or f.get("host_parity_pages", 0) or f.get("inject")
        if loses and not allow_fault_injection:
            raise InvalidInput(
                f"{at} loses pool pages, and the pools refuse it: pass "
                "--allow-fault-injection to leto run (nothing was started)"
            )
    return plan


def past_the_end(plan: list[dict], end: int) -> list[str]:
    """A line for each entry whose iteration the loop never reaches (``end``: the loop's
    end, exclusive, known once the script's loop starts): said then, not only at the
    job's end as an entry that never fired."""
    said = []
    for f in plan:
        iteration = int(f["at"].split("@")[1].split("#")[0])
        if iteration >= end:
            said.append(
                f"fault-plan entry for generation {f['generation']} (rank {f['rank']} at "
                f"{f['at']}) cannot fire: the loop ends before iteration {iteration} "
                f"(it runs iterations below {end})"
            )
    return said
