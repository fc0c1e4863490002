"""``leto pool``: a running job's pools, inspected (``status``) or scrubbed now
(``scrub``), through the sockets and tokens its ``--log-dir`` names.

Runs in the ``leto`` command's process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.errors import InvalidInput


def _pool_of(log_dir: Path, rank: int) -> tuple[str, str]:
    """(socket directory, token) of ``rank``'s pool, from the file a running ``leto run``
    keeps in its log directory (``leto.launch.agent.POOLS_FILE``)."""
    found = {}
    for f in sorted(log_dir.glob("node*.pools.json")):
        found.update(json.loads(f.read_text())["ranks"])
    if not found:
        raise InvalidInput(
            f"{log_dir} holds no node*.pools.json: give the --log-dir of a running leto run "
            "job (the file is there while the job runs)"
        )
    if str(rank) not in found:
        raise InvalidInput(
            f"--rank {rank}: the job in {log_dir} has ranks {', '.join(sorted(found, key=int))}"
        )
    return found[str(rank)]["socket_dir"], found[str(rank)]["token"]


def cmd_pool_status(args: argparse.Namespace) -> int:
    from leto.memory.client import PoolClient
    from leto.memory.config import ENV_POOL_DIR, ENV_POOL_TOKEN, SOCKET_NAME
    from leto.memory.errors import PoolError

    socket_dir = args.socket_dir or os.environ.get(ENV_POOL_DIR)
    token = os.environ.get(ENV_POOL_TOKEN)
    if args.log_dir and not args.socket_dir:
        try:
            socket_dir, token = _pool_of(Path(args.log_dir), args.rank)
        except (InvalidInput, OSError, ValueError, KeyError) as e:
            print(f"leto pool status: {e}", file=sys.stderr)
            return 2
    if not socket_dir or not token:
        print(
            "leto pool status: give --log-dir DIR, the --log-dir of a running leto run job "
            f"(and --rank R), or the pool's --socket-dir (or {ENV_POOL_DIR}) and its token in "
            f"{ENV_POOL_TOKEN}",
            file=sys.stderr,
        )
        return 2
    try:
        with PoolClient.connect(
            Path(socket_dir) / SOCKET_NAME, token, role="observer", timeout_s=args.timeout_s
        ) as c:
            status = c.status()
    except (PoolError, TimeoutError, OSError) as e:
        print(f"leto pool status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status))
        return 0
    console = Console()
    cfg = status["config"]
    console.print(
        f"pool on [bold]{cfg['device']}[/]  state manager PID {status['server_pid']}  epoch {status['epoch']}  "
        f"owner PID {status['owner_pid']}  page {cfg['page_bytes']} B  D={cfg['data_pages']} H1={cfg['tier1_pages']} H2={cfg['tier2_pages']}"
    )
    t = Table(title="allocations")
    for col in ("name", "kind", "bytes", "pages", "page bytes"):
        t.add_column(col)
    for a in status["allocations"]:
        t.add_row(a["name"], a["kind"], str(a["nbytes"]), str(a["pages"]), str(a["page_bytes"]))
    console.print(t)
    g = Table(title="protection groups")
    for col in ("group", "kind", "data pages", "tier-1", "tier-2", "pending rebuild", "rebuilt"):
        g.add_column(col)
    for grp in status["groups"]:
        pending = ", ".join(f"{k}:{v}" for k, v in grp["pending"].items() if v) or "-"
        g.add_row(
            str(grp["gid"]),
            grp["kind"],
            str(grp["data_pages"]),
            str(grp["tier1"]),
            str(grp["tier2"]),
            pending,
            str(grp["rebuilt"]),
        )
    console.print(g)
    console.print(
        f"failed pages found: {status['failed_pages_total']}  rebuilt: {status['rebuilt_pages_total']}  "
        f"reusable pages replaced: {status['reusable_pages_replaced']}"
    )
    console.print(
        f"page-loss mechanism: device {status['mechanism']['device']}; host {status['mechanism']['host']}"
    )
    return 0


def cmd_pool_scrub(args: argparse.Namespace) -> int:
    """Ask a running job's trainers for a full scrub now, and show what they found."""
    import re
    import uuid

    from leto.integrity.scrub import REQUEST_FILE

    log_dir = Path(args.log_dir)
    ranks = sorted(
        {int(m.group(1)) for p in log_dir.glob("rank*.gen*.active.log")
         if (m := re.match(r"rank(\d+)\.", p.name))}
    )  # fmt: skip
    if not ranks:
        print(
            f"leto pool scrub: {log_dir} holds no trainer logs (rank*.gen*.active.log): give "
            "the --log-dir of a running leto run job; nothing was asked",
            file=sys.stderr,
        )
        return 2
    rid = uuid.uuid4().hex[:12]
    tmp = log_dir / f".{REQUEST_FILE}.{rid}"
    tmp.write_text(json.dumps({"id": rid, "time": time.time()}))
    tmp.rename(log_dir / REQUEST_FILE)  # whole, or not there
    answers: dict[int, dict] = {}
    deadline = time.monotonic() + args.timeout_s
    while len(answers) < len(ranks) and time.monotonic() < deadline:
        for r in ranks:
            f = log_dir / f"scrub.{rid}.rank{r}.json"
            if r not in answers and f.exists():
                answers[r] = json.loads(f.read_text())
        time.sleep(0.1)
    missing = [r for r in ranks if r not in answers]
    if args.json:
        print(json.dumps({"id": rid, "answers": answers, "missing": missing}))
    else:
        t = Table(title=f"leto pool scrub {rid}: {len(answers)} of {len(ranks)} rank(s) answered")
        for col in ("rank", "iteration", "groups", "GiB", "seconds", "found"):
            t.add_column(col)
        for r, a in sorted(answers.items()):
            found = (
                ", ".join(f"{f['tier']} page {f['page']} (repaired)" for f in a["repaired"])
                or "nothing"
                if a["ok"]
                else a["error"]
            )
            gib = f"{a['bytes'] / 2**30:.3f}" if a["ok"] else "-"
            t.add_row(str(r), str(a["iteration"]), str(a.get("groups", "-")), gib,
                      f"{a['seconds']:.3f}" if a["ok"] else "-", found)  # fmt: skip
        Console().print(t)
        if missing:
            print(
                f"leto pool scrub: rank(s) {missing} did not answer within {args.timeout_s} s "
                "(a trainer answers at its next iteration's start)",
                file=sys.stderr,
            )
    if missing:
        return 2
    return 0 if all(a["ok"] for a in answers.values()) else 1



def register(sub) -> None:
    """``leto pool status`` and ``leto pool scrub``."""
    pool = sub.add_parser("pool", help="inspect a Resilient Memory Pool").add_subparsers(
        dest="pool_command", required=True
    )
    p = pool.add_parser("status", help="allocations, pages, groups, failed and rebuilt pages")
    p.add_argument(
        "--log-dir",
        default=None,
        help="the --log-dir of a running leto run job: its pools' sockets and tokens are "
        "found there (node*.pools.json, this user only)",
    )
    p.add_argument("--rank", type=int, default=0, help="with --log-dir: the rank whose pool")
    p.add_argument(
        "--socket-dir",
        default=None,
        help="a pool's private socket directory (default: $LETO_POOL_DIR), with its token "
        "in $LETO_POOL_TOKEN",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--timeout-s", type=float, default=10.0, help="give up after this many seconds")
    p.set_defaults(fn=cmd_pool_status)
    p = pool.add_parser(
        "scrub",
        help="a running job's retained state checked against its parity now, every rank "
        "(parity errors repaired; corrupted state is a fatal failure: the checkpoint fallback)",
    )
    p.add_argument("--log-dir", default="leto-run", help="the job's leto run --log-dir")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="wait this long for every rank's answer"
    )
    p.set_defaults(fn=cmd_pool_scrub)
