"""Resilient Memory Pool timings: attach, re-attach, localization, reconstruction.

A real state manager serves this process as the trainer. Steps: first attach of a
pool of N pages (the state manager creates the pages), fill, encode both parity tiers,
detach; re-attach (a new connection and epoch, every page imported and mapped again);
lose L pages of protection group 0 through the fault-injection role; localize (state
manager); re-attach and reconstruct (on the pool's device), then compare the rebuilt
pages with copies taken before the loss, bit for bit.

    python -m bench.pool --device cuda --pages 7168 --json-out out/pool_cuda.json
    python -m bench.pool --device cpu --pages 512

Not covered: a trainer in a *fresh* process (the re-attach here reuses this process's
CUDA context; context creation is measured by the shadow-trainer benchmarks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from leto.memory.client import PoolClient
from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(device: str, pages: int, lost: int, page_bytes: int) -> dict:
    cfg = PoolConfig(device=device, page_bytes=page_bytes, allow_fault_injection=True)
    nbytes = pages * page_bytes
    sm = start_state_manager(cfg)
    rows: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        c = PoolClient.connect(sm.socket_path, sm.token)
        state = c.attach("state", nbytes)
        _sync(device)
        rows["first attach (create + map) ms"] = (time.perf_counter() - t0) * 1e3
        g = torch.Generator(device=state.device).manual_seed(0)
        state.copy_(
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=state.device, generator=g)
        )
        t0 = time.perf_counter()
        c.encode_parity()
        _sync(device)
        rows["encode both tiers, all groups ms"] = (time.perf_counter() - t0) * 1e3
        victims = list(
            range(0, min(pages, cfg.data_pages), max(1, min(pages, cfg.data_pages) // lost))
        )[:lost]
        saved = {i: state[i * page_bytes : (i + 1) * page_bytes].clone() for i in victims}
        c.close()

        t0 = time.perf_counter()
        c = PoolClient.connect(sm.socket_path, sm.token)
        c.attach("state", nbytes)
        _sync(device)
        rows["re-attach (export, fds, import, map) ms"] = (time.perf_counter() - t0) * 1e3
        c.close()

        with PoolClient.connect(sm.socket_path, sm.token, role="faultkit") as f:
            f.inject_loss("data", "state", victims)
        c = PoolClient.connect(sm.socket_path, sm.token)
        t0 = time.perf_counter()
        report = c.localize()
        rows["localize, round trip ms"] = (time.perf_counter() - t0) * 1e3
        rows["localize, in state manager ms"] = report["seconds"] * 1e3
        state = c.attach("state", nbytes)
        t0 = time.perf_counter()
        summary = c.reconstruct(report)
        _sync(device)
        rows[f"reconstruct {lost} pages ms"] = (time.perf_counter() - t0) * 1e3
        exact = all(
            torch.equal(state[i * page_bytes : (i + 1) * page_bytes], saved[i]) for i in victims
        )
        c.close()
    finally:
        sm.stop()
    return {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "date": datetime.date.today().isoformat(),
        "pages": pages,
        "page_bytes": page_bytes,
        "pool_GiB": nbytes / 2**30,
        "lost_pages": lost,
        "found": report["allocations"]["state"]["failed_pages"] == victims,
        "rebuilt": summary["data_pages"],
        "exact": exact,
        "mechanism": report["mechanism"],
        "ms": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="cpu or cuda:N"
    )
    ap.add_argument(
        "--pages",
        type=int,
        default=None,
        help="pool size in pages (default 7168 on cuda = 14 GiB, 512 on cpu)",
    )
    ap.add_argument(
        "--page-bytes",
        type=int,
        default=None,
        help="page size (default 2 MiB on cuda, 64 KiB on cpu)",
    )
    ap.add_argument("--lost", type=int, default=16, help="pages lost in protection group 0")
    ap.add_argument("--json-out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    res = run(
        args.device,
        args.pages or (7168 if cuda else 512),
        args.lost,
        args.page_bytes or ((2 << 20) if cuda else 64 << 10),
    )
    res["command"] = "python -m bench.pool " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:]
    )
    t = Table(
        title=f"pool on {res['device']}: {res['pages']} pages of {res['page_bytes']} B ({res['pool_GiB']:.2f} GiB)"
    )
    t.add_column("step")
    t.add_column("ms", justify="right")
    for k, v in res["ms"].items():
        t.add_row(k, f"{v:.1f}")
    Console().print(t)
    Console().print(
        f"lost pages found: {res['found']}  rebuilt: {res['rebuilt']}  bit-exact: {res['exact']}  mechanism: {res['mechanism']['device']}"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if not (res["found"] and res["exact"]):
        raise SystemExit("pool benchmark: lost pages were not found or not rebuilt exactly")
    return res


if __name__ == "__main__":
    main()
