"""Codec throughput: encode, update (chunks of 1/4/16/64 pages), reconstruct 16 pages.

Each figure sits beside its memory-traffic floor: the bytes the operation must move
divided by the copy bandwidth measured in the same run on the same device (a plain
tensor copy), so "x floor" says how far the kernel is from being memory-bound.
Figures are GB/s of *data pages* covered (1 GB = 1e9 bytes). Prints a table, writes JSON.

    python -m bench.codec --device cuda --json-out out/codec_cuda.json
    python -m bench.codec --device cpu --page-bytes 4096   # CPU: small pages

Not covered: PCIe transfers of parity to host (that is the updater's benchmark).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from leto.erasure import ReedSolomon
from leto.erasure.pages import as_pages


def timer(device: torch.device, fn, reps: int, trials: int = 3) -> tuple[float, float]:
    """Median over ``trials`` of the mean seconds per call (after one warm-up).

    On CUDA the time is taken with events on the stream; the host's time to issue the
    calls is returned beside it, so a host-bound figure can be told apart.
    """
    fn()
    results, host = [], []
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            host.append((time.perf_counter() - t0) / reps)
            torch.cuda.synchronize(device)
            results.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            results.append((time.perf_counter() - t0) / reps)
            host.append(results[-1])
    return sorted(results)[len(results) // 2], sorted(host)[len(host) // 2]


def copy_bandwidth(device: torch.device, n_bytes: int, reps: int) -> float:
    """Bytes read + written per second by a plain device copy (the traffic ceiling)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t, _ = timer(device, lambda: dst.copy_(src), reps)
    return 2 * n_bytes / t


def pool_pages(device: torch.device, n_pages: int, S: int):
    """``n_pages`` pages of ``S`` bytes served by a Resilient Memory Pool (CUDA VMM: one
    physical allocation per page, as the updater's state lives), as an (n, S) tensor."""
    from leto.memory.client import PoolClient
    from leto.memory.config import PoolConfig
    from leto.memory.launch import start_state_manager

    sm = start_state_manager(PoolConfig.for_cuda(device.index or 0, page_bytes=S))
    client = PoolClient.connect(sm.socket_path, sm.token)
    flat = client.attach("bench", n_pages * S)
    return sm, client, flat.view(n_pages, S)


def run(
    device: torch.device,
    D: int,
    H: int,
    S: int,
    reps: int,
    lost: int,
    chunks: list[int],
    pool: bool = False,
) -> dict:
    rs = ReedSolomon(D, H)
    g = torch.Generator(device=device).manual_seed(0)
    sm = None
    if pool:
        # Data pages and the update's new pages from the pool (VMM pages), as in training.
        sm, _client, pages_ = pool_pages(device, D + max(chunks), S)
        data, spare = pages_[:D], pages_[D:]
        data.copy_(torch.randint(0, 256, (D, S), dtype=torch.uint8, device=device, generator=g))
    else:
        data = torch.randint(0, 256, (D, S), dtype=torch.uint8, device=device, generator=g)
    parity = rs.encode(data)
    bw = copy_bandwidth(device, min(D * S, 1 << 30), reps)
    rows = []

    def add(op, timing, data_bytes, traffic_bytes):
        seconds, host = timing
        floor = traffic_bytes / bw
        rows.append(
            {
                "op": op,
                "ms": seconds * 1e3,
                "host_ms": host * 1e3,
                "data_GBps": data_bytes / seconds / 1e9,
                "floor_ms": floor * 1e3,
                "x_floor": seconds / floor,
            }
        )

    t = timer(device, lambda: rs.encode(data, out=parity), reps)
    add(f"encode D={D}", t, D * S, (D + H) * S)
    for c in chunks:
        new = torch.randint(0, 256, (c, S), dtype=torch.uint8, device=device, generator=g)
        if pool:
            spare[:c].copy_(new)
            new = spare[:c]
        old = data[:c]
        t = timer(device, lambda old=old, new=new: rs.update(parity, 0, old, new), reps)
        add(f"update {c} pages", t, c * S, (2 * c + 2 * H) * S)
    if device.type == "cuda":
        from leto.erasure.kernels import by_name

        kernel = by_name("cuda")
        chosen = kernel.threads
        pages = as_pages(data, D, "data", None)  # pre-validated pages: no per-call checks
        for threads in (64, 128, 256):
            kernel.threads = threads
            t = timer(device, lambda: rs.encode(pages, out=parity), reps)
            add(f"encode D={D} prebuilt pages, {threads} threads/block", t, D * S, (D + H) * S)
        kernel.threads = chosen
    erased = list(range(0, D, D // lost))[:lost]
    t = timer(device, lambda: rs.reconstruct(data, parity, erased), reps)
    add(f"reconstruct {lost} of {D}", t, D * S, (D + lost) * S)
    if sm is not None:
        del data, spare, pages_
        _client.close()
        sm.stop()
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "D": D,
        "H": H,
        "page_bytes": S,
        "copy_GBps": bw / 1e9,
        "results": rows,
        "kernels": by_name_info(device),
    }


def by_name_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"cpu": "numpy 8-bit split tables"}
    from leto.erasure.kernels import by_name

    k = by_name("cuda")
    return {"threads_per_block": k.threads, **k.kernel_info()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    ap.add_argument(
        "--data-pages", type=int, default=1024, help="D, data pages per protection group"
    )
    ap.add_argument("--parity-pages", type=int, default=16, help="H1, tier-1 parity pages")
    ap.add_argument(
        "--page-bytes",
        type=int,
        default=None,
        help="page size (default 2 MiB on cuda, 4 KiB on cpu)",
    )
    ap.add_argument(
        "--reps", type=int, default=None, help="timed repetitions (default 20 cuda, 2 cpu)"
    )
    ap.add_argument("--lost", type=int, default=16, help="pages lost for the reconstruct figure")
    ap.add_argument("--chunks", default="1,4,16,64", help="update chunk sizes in pages")
    ap.add_argument(
        "--pool",
        action="store_true",
        help="CUDA: data and new pages from a memory pool (VMM, one allocation per page), "
        "as the updater's state lives, instead of one torch tensor",
    )
    ap.add_argument("--json-out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    S = args.page_bytes or ((2 << 20) if device.type == "cuda" else 4096)
    reps = args.reps or (20 if device.type == "cuda" else 2)
    res = run(
        device,
        args.data_pages,
        args.parity_pages,
        S,
        reps,
        args.lost,
        [int(c) for c in args.chunks.split(",")],
        pool=args.pool,
    )
    res["pages"] = "pool (VMM)" if args.pool else "torch tensor"
    res["prefetch"] = os.environ.get("LETO_CODEC_PREFETCH", "1")
    res["command"] = "python -m bench.codec " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:]
    )
    table = Table(
        title=f"codec on {res['device']}  D={res['D']} H={res['H']} S={S} B  copy "
        f"{res['copy_GBps']:.0f} GB/s, pages: {res['pages']}, prefetch {res['prefetch']}"
    )
    for col in ("op", "ms", "host ms/call", "GB/s of data", "floor ms", "x floor"):
        table.add_column(col, justify="right")
    for r in res["results"]:
        table.add_row(
            escape(r["op"]),
            f"{r['ms']:.3f}",
            f"{r['host_ms']:.3f}",
            f"{r['data_GBps']:.3g}",
            f"{r['floor_ms']:.3f}",
            f"{r['x_floor']:.1f}",
        )
    Console().print(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
