"""What gloo carries for CUDA tensors, tried: every collective ``leto.trainer.shared_gpu``
names, carried or not, between ranks sharing one GPU over gloo (as ``leto run
--ranks-per-gpu`` places them), each result checked value by value, then compared with
that module's table. Issue 47: the table was read from torch's source; this is where a
GPU says whether it is right.

Runs in its own processes: each collective gets a fresh set of ``--world-size`` ranks
(spawned, a process group of its own), so one that crashes a process (a CUDA address
handed to a TCP socket) or leaves the others waiting (gloo's timeout, ``--timeout-s``)
costs only its own row. Prints a table (collective, carried?, the table's word, what
happened) and writes ``--json``; the exit code is 1 where the table and the GPU disagree.

    python -m bench.gloo_cuda --json out/gloo_cuda.json                # on a GPU
    python -m bench.gloo_cuda --device cpu                             # the harness, on the CPU

On the CPU gloo carries everything but PREMUL_SUM, so the table's other rows read as
disagreements there: the CPU run checks the harness, not the table.

Not covered: speed (every CUDA collective over gloo goes through host memory and TCP),
complex and sparse tensors, groups other than the whole world.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from leto.trainer import shared_gpu

# Each probe: name -> the function a rank runs (rank, world, device) -> None, raising
# AssertionError when the values are wrong. Names in shared_gpu.LACKS are expected to fail.


def _x(rank: int, world: int, device):
    import torch

    return torch.arange(2 * world, dtype=torch.float32, device=device) + 10 * rank


def _sum(world: int, device):
    import torch

    return sum(_x(r, world, device) for r in range(world)).to(torch.float32)


def _check(got, want, what: str) -> None:
    import torch

    assert torch.equal(got.cpu(), want.cpu()), f"{what}: got {got.tolist()}, want {want.tolist()}"


def _all_reduce(op_name: str):
    def run(rank, world, device):
        import torch.distributed as dist

        t = _x(rank, world, device)
        op = getattr(dist.ReduceOp, op_name)
        dist.all_reduce(t, op=op)
        want = {"SUM": _sum(world, device), "AVG": _sum(world, device) / world,
                "MAX": _x(world - 1, world, device)}[op_name]  # fmt: skip
        _check(t, want, f"all_reduce {op_name}")

    return run


def _broadcast(rank, world, device):
    import torch.distributed as dist

    t = _x(rank, world, device)
    dist.broadcast(t, src=0)
    _check(t, _x(0, world, device), "broadcast")


def _reduce(rank, world, device):
    import torch.distributed as dist

    t = _x(rank, world, device)
    dist.reduce(t, dst=0)
    if rank == 0:
        _check(t, _sum(world, device), "reduce")


def _all_gather(rank, world, device):
    import torch
    import torch.distributed as dist

    out = [torch.empty(2 * world, device=device) for _ in range(world)]
    dist.all_gather(out, _x(rank, world, device))
    for r in range(world):
        _check(out[r], _x(r, world, device), "all_gather")


def _all_gather_into_tensor(rank, world, device):
    import torch
    import torch.distributed as dist

    out = torch.empty(2 * world * world, device=device)
    dist.all_gather_into_tensor(out, _x(rank, world, device))
    _check(out, torch.cat([_x(r, world, device) for r in range(world)]), "all_gather_into_tensor")


def _reduce_scatter_tensor(op_name: str):
    def run(rank, world, device):
        import torch
        import torch.distributed as dist

        out = torch.empty(2, device=device)
        op = dist._make_nccl_premul_sum(1.0 / world) if op_name == "PREMUL_SUM" else (
            getattr(dist.ReduceOp, op_name))  # fmt: skip
        dist.reduce_scatter_tensor(out, _x(rank, world, device), op=op)
        want = _sum(world, device)[2 * rank : 2 * rank + 2]
        _check(out, want if op_name == "SUM" else want / world, f"reduce_scatter_tensor {op_name}")

    return run


def _reduce_scatter(rank, world, device):
    import torch
    import torch.distributed as dist

    out = torch.empty(2, device=device)
    dist.reduce_scatter(out, list(_x(rank, world, device).chunk(world)))
    _check(out, _sum(world, device)[2 * rank : 2 * rank + 2], "reduce_scatter")


def _all_to_all_single(rank, world, device):
    import torch
    import torch.distributed as dist

    out = torch.empty(2 * world, device=device)
    dist.all_to_all_single(out, _x(rank, world, device))
    want = torch.cat([_x(r, world, device)[2 * rank : 2 * rank + 2] for r in range(world)])
    _check(out, want, "all_to_all_single")


def _all_to_all(rank, world, device):
    import torch
    import torch.distributed as dist

    out = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_to_all(out, [c.contiguous() for c in _x(rank, world, device).chunk(world)])
    for r in range(world):
        _check(out[r], _x(r, world, device)[2 * rank : 2 * rank + 2], "all_to_all")


def _send_recv(rank, world, device):
    import torch.distributed as dist

    if rank == 0:
        for r in range(1, world):
            dist.send(_x(0, world, device), dst=r)
    else:
        t = _x(rank, world, device)
        dist.recv(t, src=0)
        _check(t, _x(0, world, device), "send/recv")


def _all_reduce_coalesced(rank, world, device):
    import torch.distributed as dist

    a, b = _x(rank, world, device), 2 * _x(rank, world, device)
    dist.all_reduce_coalesced([a, b])
    _check(a, _sum(world, device), "all_reduce_coalesced")
    _check(b, 2 * _sum(world, device), "all_reduce_coalesced")


def _all_gather_into_tensor_coalesced(rank, world, device):
    import torch
    import torch.distributed as dist

    pg = dist.distributed_c10d._get_default_group()
    ins = [_x(rank, world, device), 2 * _x(rank, world, device)]
    outs = [torch.empty(2 * world * world, device=device) for _ in ins]
    pg.allgather_into_tensor_coalesced(outs, ins).wait()
    for k, o in enumerate(outs):
        want = torch.cat([(k + 1) * _x(r, world, device) for r in range(world)])
        _check(o, want, "all_gather_into_tensor_coalesced")


PROBES = {
    "all_reduce SUM": _all_reduce("SUM"),
    "all_reduce AVG": _all_reduce("AVG"),
    "all_reduce MAX": _all_reduce("MAX"),
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor SUM": _reduce_scatter_tensor("SUM"),
    "reduce_scatter_tensor AVG": _reduce_scatter_tensor("AVG"),
    "all_to_all_single": _all_to_all_single,
    "reduce_scatter": _reduce_scatter,  # the list form (carried on an H200, torch 2.11)
    # shared_gpu.LACKS, by the names it gives them:
    "PREMUL_SUM": _reduce_scatter_tensor("PREMUL_SUM"),
    "send/recv": _send_recv,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "all_gather_into_tensor_coalesced": _all_gather_into_tensor_coalesced,
    "all_to_all": _all_to_all,
}


def _member(name: str, rank: int, world: int, port: int, device: str, timeout_s: float, q):
    """One rank of one probe (a spawned process): its process group, the collective,
    what happened on the queue."""
    import os
    import warnings

    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced's deprecation
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    try:
        PROBES[name](rank, world, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        q.put((rank, None))
    except Exception as e:  # noqa: BLE001 - what the collective raised is the finding
        q.put((rank, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - a broken group may not tear down
            pass


def probe(name: str, world: int, device: str, timeout_s: float) -> dict:
    """Run one collective on ``world`` fresh ranks; what happened."""
    from leto.job.store import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_member, args=(name, r, world, port, device, timeout_s, q))
        for r in range(world)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, timeout_s + 60 - (time.perf_counter() - t0)))
    errors, codes = {}, {}
    while not q.empty():
        rank, err = q.get()
        errors[rank] = err
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            codes[r] = "still running at the time limit, killed"
        elif p.exitcode != 0 and r not in errors:
            codes[r] = f"died (exit code {p.exitcode})"
    what = sorted({e for e in errors.values() if e} | set(codes.values()))
    carried = not what and len(errors) == world
    return {
        "carried": carried,
        "table_says_carried": name not in shared_gpu.LACKS,
        "what": "; ".join(what) or ("ok" if carried else "no result"),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cuda: every rank on cuda:0"
    )
    ap.add_argument("--world-size", type=int, default=2, help="ranks sharing the device")
    ap.add_argument("--only", default="", help="comma-separated collectives (default: all)")
    ap.add_argument("--parallel", type=int, default=4, help="probes run at once")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="gloo's timeout in a probe")
    ap.add_argument("--json", dest="json_path", help="write the results here")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(PROBES)
    if bad := [n for n in names if n not in PROBES]:
        ap.error(f"--only: {bad} not among {list(PROBES)}")
    if args.world_size < 2:
        ap.error(f"--world-size {args.world_size}: 2 or more (a collective needs peers)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error(
                "--device cuda: torch sees no CUDA device here (--device cpu checks the harness)"
            )
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        rows = dict(zip(names, pool.map(
            lambda n: probe(n, args.world_size, args.device, args.timeout_s), names), strict=True))  # fmt: skip
    res = _report(rows, args)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(res, indent=2))
    return 0 if not res["disagree"] else 1


def _report(rows: dict, args) -> dict:
    import torch
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        title=f"gloo on {args.device}, {args.world_size} ranks sharing it (torch {torch.__version__})"
    )
    for c in ("collective", "carried", "leto.trainer.shared_gpu says", "what happened", "s"):
        t.add_column(c)
    for name, r in rows.items():
        agree = r["carried"] == r["table_says_carried"]
        t.add_row(
            name,
            "yes" if r["carried"] else "[red]no[/]",
            ("carried" if r["table_says_carried"] else "lacks")
            + ("" if agree else " [bold red](disagrees)[/]"),
            escape(r["what"]),  # gloo's messages hold [file:line], not markup
            f"{r['seconds']:.1f}",
        )
    Console(width=150).print(t)
    disagree = [n for n, r in rows.items() if r["carried"] != r["table_says_carried"]]
    print(f"gloo_cuda: {len(rows) - len(disagree)} of {len(rows)} as leto.trainer.shared_gpu says"
          + (f"; disagree: {', '.join(disagree)}" if disagree else ""))  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "device": args.device,
        "world_size": args.world_size,
        "probes": rows,
        "disagree": disagree,
    }


if __name__ == "__main__":
    sys.exit(main())
