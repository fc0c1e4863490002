"""Page-pool CUDA backend timings: create, map, export, import in a second process, scan.

For N pages of 2 MiB on one GPU (default 7168 pages = 14 GiB): the owner's create
(cuMemCreate plus zeroing) and map; exporting one fd per page; the importer's map in a
spawned process, which gets the fds in batches of at most 250 over a Unix socket (Linux
passes at most 253 fds per message); failed_pages() over all pages, healthy and with 16
pages lost; repair of those pages. Wall-clock ms, one run. Prints a table, writes JSON.

    python -m bench.pool_cuda_backend --pages 7168 --json-out out/pool_cuda.json

Not covered: the state manager's protocol and bookkeeping around these calls (this
times the backend alone), and several trainers attaching at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import resource
import socket
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

BATCH = 250
FILL = 0x5A


def raise_fd_limit(need: int) -> int:
    """The importer holds every fd until it maps them; the default soft limit is often 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def importer_side(sock: socket.socket, n: int, page_bytes: int, device_index: int) -> None:
    from leto.memory.backends.cuda import CudaPageImporter

    res: dict = {"fd_limit": raise_fd_limit(n + 256)}
    try:
        t0 = time.perf_counter()
        importer = CudaPageImporter(page_bytes, device_index)
        res["init_ms"] = (time.perf_counter() - t0) * 1e3
        fds: list[int] = []
        t0 = time.perf_counter()
        while len(fds) < n:
            _, got, _, _ = socket.recv_fds(sock, 16, BATCH)
            if not got:
                raise RuntimeError(f"owner closed the socket after {len(fds)} of {n} fds")
            fds += got
        res["recv_ms"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        mapping = importer.map(fds)
        res["map_ms"] = (time.perf_counter() - t0) * 1e3
        # Two reductions read every byte without a 14 GiB temporary.
        lo, hi = int(mapping.tensor.min()), int(mapping.tensor.max())
        res["bytes_as_filled"] = lo == hi == FILL
        t0 = time.perf_counter()
        importer.unmap(mapping)
        res["unmap_ms"] = (time.perf_counter() - t0) * 1e3
    except Exception as e:  # reported to the owner, which prints it
        res["error"] = repr(e)
    sock.sendall(json.dumps(res).encode())
    sock.close()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def run(n: int, page_bytes: int, device_index: int, lost: int) -> dict:
    from leto.memory.backends.cuda import CudaPageOwner, allocation_granularity

    owner, init_ms = timed(lambda: CudaPageOwner(page_bytes, device_index))
    rows: list[tuple[str, float, int]] = [("owner init (context, props)", init_ms, 0)]

    def add(op: str, ms: float, pages: int) -> None:
        rows.append((op, ms, pages))

    handles, ms = timed(lambda: [owner.create() for _ in range(n)])
    add("owner create (cuMemCreate + zero)", ms, n)
    mapping, ms = timed(lambda: owner.map(handles))
    add("owner map (reserve, map, set access)", ms, n)
    mapping.tensor.fill_(FILL)
    torch.cuda.synchronize(device_index)

    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=importer_side, args=(child, n, page_bytes, device_index))
    proc.start()
    child.close()
    export_ms = send_ms = 0.0
    for start in range(0, n, BATCH):  # the owner never holds more than one batch of fds
        fds, ms = timed(lambda s=start: [owner.export_fd(h) for h in handles[s : s + BATCH]])
        export_ms += ms
        t0 = time.perf_counter()
        socket.send_fds(parent, [b"pages"], fds)
        send_ms += (time.perf_counter() - t0) * 1e3
        for fd in fds:
            os.close(fd)
    add("export all fds", export_ms, n)
    add(f"send fds (batches of {BATCH})", send_ms, n)
    parent.settimeout(600)
    reply = b""
    while chunk := parent.recv(1 << 16):
        reply += chunk
    parent.close()
    proc.join(120)
    if not reply:
        raise RuntimeError(f"importer process exited ({proc.exitcode}) without a report")
    child_res = json.loads(reply)
    if "error" in child_res:
        raise RuntimeError(f"importer process failed: {child_res['error']}")
    add("importer init (spawned process)", child_res["init_ms"], 0)
    add("importer map (import, close fd, map)", child_res["map_ms"], n)
    add("importer unmap", child_res["unmap_ms"], n)

    failed, ms = timed(lambda: owner.failed_pages(mapping))
    assert failed == [], failed
    add("failed_pages, none lost", ms, n)
    victims = sorted({(i * n) // lost for i in range(lost)})
    _, ms = timed(lambda: [owner.lose(mapping, i, handles[i]) for i in victims])
    add(f"lose {len(victims)} pages", ms, len(victims))
    failed, ms = timed(lambda: owner.failed_pages(mapping))
    assert failed == victims, (failed, victims)
    add(f"failed_pages, {len(victims)} lost", ms, n)

    def repair() -> None:
        for i in victims:
            handles[i] = owner.create()
            owner.replace(mapping, i, handles[i])

    _, ms = timed(repair)
    add(f"create + replace {len(victims)} pages", ms, len(victims))
    assert owner.failed_pages(mapping) == []
    _, ms = timed(lambda: owner.unmap(mapping))
    add("owner unmap", ms, n)
    _, ms = timed(lambda: [owner.release(h) for h in handles])
    add("owner release all", ms, n)
    return {
        "device": torch.cuda.get_device_name(device_index),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "pages": n,
        "page_bytes": page_bytes,
        "granularity": allocation_granularity(device_index),
        "importer_saw_filled_bytes": child_res["bytes_as_filled"],
        "importer_fd_limit": child_res["fd_limit"],
        "lost_pages": victims,
        "results": [
            {"op": op, "ms": ms, "us_per_page": ms * 1e3 / pages if pages else None}
            for op, ms, pages in rows
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=7168, help="pages in the allocation")
    ap.add_argument("--page-bytes", type=int, default=2 << 20, help="page size (2 MiB)")
    ap.add_argument("--device-index", type=int, default=0, help="CUDA device")
    ap.add_argument("--lost", type=int, default=16, help="pages lost for the scan figure")
    ap.add_argument("--json-out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    res = run(args.pages, args.page_bytes, args.device_index, args.lost)
    res["command"] = "python -m bench.pool_cuda_backend " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    gib = args.pages * args.page_bytes / (1 << 30)
    table = Table(
        title=f"CUDA page backend on {res['device']}: {args.pages} pages of "
        f"{args.page_bytes >> 20} MiB ({gib:.1f} GiB)"
    )
    for col in ("op", "ms", "µs/page"):
        table.add_column(col, justify="right")
    for r in res["results"]:
        per = "" if r["us_per_page"] is None else f"{r['us_per_page']:.1f}"
        table.add_row(r["op"], f"{r['ms']:.1f}", per)
    Console().print(table)
    print(f"importer read back the owner's bytes: {res['importer_saw_filled_bytes']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
