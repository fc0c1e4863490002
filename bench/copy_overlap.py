"""How a whole-state copy on the GPU runs beside compute-bound work — an in-process
benchmark of one component (issue 59: which mechanism lets ``--undo ahead``'s copy hide
behind forward and backward), never a figure of the product.

A chain of bf16 matrix multiplies (forward/backward's compute-bound part) runs on the
current stream; a copy of ``--gib`` GiB (the retained state's size at ~1 B) is queued on
a side stream just before it, by each mechanism in turn:

* ``torch``: ``Tensor.copy_`` (``cudaMemcpyAsync`` device to device), as ``take_ahead``
  does today;
* ``batch-overlap/P``: ``cuMemcpyBatchAsync`` of P parts with
  ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`` (the driver's hint to overlap the copy
  with work on the SMs; advisory — cuda-python's documentation names Tegra);
* ``kernel-N``: a Triton copy kernel of N programs (grid-stride), using at most N SMs.

With ``--to-host``, the copy is the checkpoint stager's instead: device to host buffers
page-locked by the driver in 64 MiB pieces, one ``copy_`` a piece (``stager``:
``leto.trainer.staging``'s own buffers and pieces), as a save's staging runs beside the
next forward and backward.

For each: the compute alone, the copy alone, and both together (the compute's slowdown,
the copy's time beside it). Bytes are checked after each copy (``torch.equal``). What it
found on an H100 (no mechanism hides the copy): docs/benchmarks.md#h100-2026-12-06.

    python -m bench.copy_overlap --gib 12 --json-out out/copy_overlap.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

GiB = 1 << 30


def _triton_copy():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        start = pid * BLOCK
        while start < n:
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
            start += step

    return copy


def _batch_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, pieces: int):
    """cuMemcpyBatchAsync of ``pieces`` equal parts, every one hinted to overlap compute."""
    from cuda.bindings import driver as d

    n = src.numel() * src.element_size()
    part = -(-n // pieces)
    dsts, srcs, sizes = [], [], []
    for k in range(pieces):
        lo = k * part
        if lo >= n:
            break
        dsts.append(d.CUdeviceptr(dst.data_ptr() + lo))
        srcs.append(d.CUdeviceptr(src.data_ptr() + lo))
        sizes.append(min(part, n - lo))
    a = d.CUmemcpyAttributes()
    a.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    a.flags = d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    loc = d.CUmemLocation()
    loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = src.device.index or 0
    a.srcLocHint = loc
    a.dstLocHint = loc
    h = d.CUstream(stream.cuda_stream)
    out = d.cuMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [a], [0], 1, h)
    err = out[0]  # (CUDA 12.8's bindings also return the failing copy's index)
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyBatchAsync: {err}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=12.0, help="the copy's size")
    ap.add_argument("--matmuls", type=int, default=120, help="the compute chain's length")
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--programs", default="8,16,33,66", help="kernel-N variants")
    ap.add_argument("--to-host", action="store_true", help="the stager's device-to-host copy")
    ap.add_argument(
        "--pool-source", action="store_true",
        help="--to-host from the pool's memory (cuMemCreate pages mapped contiguously, as "
        "the retained state is), not from torch's allocator",
    )  # fmt: skip
    ap.add_argument(
        "--main-d2h", action="store_true",
        help="the compute stream copies 32 bytes to the host every 10 multiplies, as the "
        "trainer's marker writes do",
    )  # fmt: skip
    ap.add_argument(
        "--threaded", action="store_true",
        help="the copy queued from another thread, as the stager does, while this one "
        "queues the compute",
    )  # fmt: skip
    ap.add_argument("--json-out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = int(args.gib * GiB) // 8
    src = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, device=dev)
    if args.pool_source:
        from leto.memory.backends.cuda import CudaPageOwner

        page = 2 << 20
        owner = CudaPageOwner(page, dev.index or 0)
        pages = owner.create_many(-(-n * 8 // page))
        pool = owner.map(pages).tensor.view(torch.int64)[:n]
        pool.copy_(src)
        src = pool
        print(f"source: {len(pages)} pool pages of 2 MiB, mapped contiguously")
    host = None
    if args.to_host:
        from leto.trainer.staging import HostBuffers, _pieces

        host = HostBuffers({"x": (src.shape, src.dtype, True)}, dev)
        dst = host.tensors["x"]
        print(f"host buffers: {host.nbytes() / GiB:.1f} GiB, {host.refused} piece(s) refused")
    else:
        dst = torch.empty_like(src)
    a = torch.randn(args.dim, args.dim, dtype=torch.bfloat16, device=dev)
    b = torch.randn(args.dim, args.dim, dtype=torch.bfloat16, device=dev)
    c = torch.empty_like(a)
    side = torch.cuda.Stream(dev)
    main_s = torch.cuda.current_stream(dev)
    kern = None
    try:
        kern = _triton_copy()
    except Exception as e:  # (no Triton: the kernel variants are skipped, and said)
        print(f"Triton copy kernel unavailable: {e}")

    flag_d, flag_h = torch.zeros(8, device=dev), torch.zeros(8, pin_memory=True)

    def compute():
        for k in range(args.matmuls):
            torch.mm(a, b, out=c)
            if args.main_d2h and k % 10 == 0:  # a marker write's small copy to the host
                flag_h.copy_(flag_d, non_blocking=True)

    if host is not None:

        def stager():
            for a_, b_ in _pieces(src, dst):
                b_.copy_(a_, non_blocking=True)

        def paced():  # two pieces queued at a time (tried: as slow beside --main-d2h)
            queued = []
            for a_, b_ in _pieces(src, dst):
                if len(queued) >= 2:
                    queued.pop(0).synchronize()
                b_.copy_(a_, non_blocking=True)
                queued.append(torch.cuda.Event())
                queued[-1].record(side)

        methods = {"stager": stager, "paced-2": paced}
    else:
        methods = {"torch": lambda: dst.copy_(src, non_blocking=True)}
    for pieces in () if host is not None else (1, 8):
        methods[f"batch-overlap/{pieces}"] = lambda p=pieces: _batch_copy(dst, src, side, p)
    if kern is not None and host is None:
        for p in (int(x) for x in args.programs.split(",")):
            methods[f"kernel-{p}"] = lambda p=p: kern[(p,)](src, dst, n, BLOCK=4096, num_warps=8)

    def timed(run_copy, with_compute: bool) -> tuple[float | None, float | None]:
        torch.cuda.synchronize(dev)
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

        def queue_copy():
            with torch.cuda.stream(side):
                e[2].record(side)
                run_copy()
                e[3].record(side)

        th = None
        if run_copy is not None:
            side.wait_stream(main_s)
            if args.threaded:
                import threading

                th = threading.Thread(target=queue_copy)
                th.start()
            else:
                queue_copy()
        if with_compute:
            e[0].record(main_s)
            compute()
            e[1].record(main_s)
        if th is not None:
            th.join()
        torch.cuda.synchronize(dev)
        comp = e[0].elapsed_time(e[1]) if with_compute else None
        cp = e[2].elapsed_time(e[3]) if run_copy is not None else None
        return comp, cp

    timed(None, True)  # warm-up: cuBLAS, clocks
    rows = []
    base = min(timed(None, True)[0] for _ in range(3))
    print(f"compute alone: {base:.1f} ms ({args.matmuls} bf16 {args.dim}^3 matmuls)")
    for name, fn in methods.items():
        try:
            timed(fn, False)  # warm-up (Triton compiles)
        except Exception as e:
            print(f"{name}: failed: {type(e).__name__}: {e}")
            rows.append({"method": name, "error": f"{type(e).__name__}: {e}"})
            continue
        alone = min(timed(fn, False)[1] for _ in range(2))
        dst.zero_()
        both = [timed(fn, True) for _ in range(2)]
        comp, cp = min(both)
        exact = torch.equal(dst, src.cpu()) if host is not None else torch.equal(dst, src)
        row = {
            "method": name,
            "copy_alone_ms": alone,
            "copy_alone_gbps": (1 if host is not None else 2) * n * 8 / alone / 1e6,
            "compute_beside_ms": comp,
            "compute_slowdown_ms": comp - base,
            "copy_beside_ms": cp,
            "bytes_equal": exact,
        }
        rows.append(row)
        print(f"{name:>16}: copy alone {alone:7.1f} ms ({row['copy_alone_gbps']:5.0f} GB/s{'' if host is not None else ' r+w'}); "
              f"beside compute: compute {comp:7.1f} ms (+{comp - base:5.1f}), copy {cp:7.1f} ms; "
              f"bytes equal {exact}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d"),
                       "gib": args.gib, "compute_alone_ms": base, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
