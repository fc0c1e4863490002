"""In-process benchmark of one component: the fused chunk pass over a 1.1 B-parameter
state, three ways — the pass alone (in place, no crash consistency: the floor), the
per-chunk undo copy then the pass (``leto run``'s default until now), and the resumable
pass (``chunk_pass.cu``'s ``chunk_pass_rf_h*``: slots and progress words in place of the
undo copy). Also checks that the resumable pass gives the in-place pass's bytes
(parameters, moments and scratch parity).

    python -m bench.resumable_pass [--params 1.1e9] [--repeats 5]

CUDA only. Not the user path: docs/benchmarks.md labels it as a component figure.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from leto.erasure.codec import ReedSolomon
from leto.erasure.kernels import by_name
from leto.update import chunk_pass as cp

PAGE = 2 << 20
UE = PAGE // 4  # elements of a page
CHUNK_UNITS = 64
H = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1.1e9)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n_units = -(-int(args.params) // UE)
    n_chunks = -(-n_units // CHUNK_UNITS)
    total = n_units * UE
    gen = torch.Generator(device=dev).manual_seed(3)
    p = torch.randn(total, device=dev, generator=gen)
    g = torch.randn(total, device=dev, generator=gen) * 1e-2
    m = torch.randn(total, device=dev, generator=gen) * 1e-3
    v = torch.rand(total, device=dev, generator=gen) * 1e-6
    undo = torch.empty(3 * CHUNK_UNITS * UE, device=dev)
    n_items = UE // 4
    progress = torch.zeros(n_items, dtype=torch.int64, device=dev)
    slots = torch.zeros(2 * (3 * 8 + H) * n_items * 4, dtype=torch.int32, device=dev)  # any build, any parts
    fin = torch.zeros(H * n_items * 4, dtype=torch.int32, device=dev)
    scratch = torch.zeros(H, UE, dtype=torch.int32, device=dev)
    ptrs = torch.tensor([scratch[r].data_ptr() for r in range(H)], dtype=torch.int64, device=dev)
    seg = np.array([(0, total, 3e-4, 0.9, 0.95, 0.1, 1e-8, 10.0, 1, 0)], dtype=cp.SEG)
    seg_t = torch.from_numpy(seg.view(np.uint8)).to(dev)
    code = ReedSolomon(3 * CHUNK_UNITS * 4, H)
    cuda = by_name("cuda")
    tables = [
        cuda.tables(code.horner_coefficients(0, 3 * min(CHUNK_UNITS, n_units - c * CHUNK_UNITS)), dev)
        for c in range(n_chunks)
    ]
    mod = cp._module()
    rs = mod.get_function(f"chunk_pass_rs_h{H}")
    rf = mod.get_function(f"chunk_pass_rf_h{H}")
    half = n_items // 2
    blocks = -(-half // cp.THREADS)
    # Builds of the same source with another fence (LETO_RF_FENCE: 0 __threadfence, 2
    # none — a diagnosis, not crash-consistent), by NVRTC with the module's options.
    import cupy

    from leto import gpu_kernels

    source, opts, _ = gpu_kernels._spec("chunk_pass")
    built, regs = {}, {}
    # (fence, units a step, hints)
    for f, g_, hint in ((1, 4, 2), (2, 2, 2)):
        m_ = cupy.RawModule(code=source, options=(*opts, f"-DLETO_RF_FENCE={f}", f"-DLETO_RF_UNITS={g_}",
                                                  f"-DLETO_RF_HINTS={hint}"))
        built[f, g_, hint] = fn_ = m_.get_function(f"chunk_pass_rf_h{H}")
        regs[f"fence {f}, {g_} units, hints {hint}"] = (
            f"{fn_.num_regs} registers, {fn_.local_size_bytes} bytes local")

    def head(u0, u1, lo, hi):
        return (np.uint64(p.data_ptr()), np.uint64(m.data_ptr()), np.uint64(v.data_ptr()),
                np.uint64(g.data_ptr()), np.int64(UE), np.int32(u0), np.int32(u1),
                np.int64(lo), np.int64(hi), np.uint64(seg_t.data_ptr()), np.int32(1))  # fmt: skip

    def in_place(c, copy):
        u0, u1 = c * CHUNK_UNITS, min((c + 1) * CHUNK_UNITS, n_units)
        if copy:
            n = (u1 - u0) * UE
            for k, t in enumerate((p, m, v)):
                undo[k * CHUNK_UNITS * UE : k * CHUNK_UNITS * UE + n].copy_(t[u0 * UE : u1 * UE])
        for lo, hi in ((0, half), (half, n_items)):
            rs((blocks,), (cp.THREADS,), (*head(u0, u1, lo, hi), np.uint64(tables[c].data_ptr()),
                                          np.uint64(ptrs.data_ptr()), np.uint64(0)))  # fmt: skip

    def resumable(c, mode=0, fn=None, parts=cp.RF_PARTS, threads=cp.THREADS):
        # The chunk's items in ``parts`` launches, one after the other, every launch's
        # slots at the item's place in it (the updater's ItemLog).
        u0, u1 = c * CHUNK_UNITS, min((c + 1) * CHUNK_UNITS, n_units)
        for lo, hi in cp.parts(n_items, parts):
            b = -(-(hi - lo) // threads)
            (fn or rf)((b,), (threads,), (*head(u0, u1, lo, hi), np.uint64(tables[c].data_ptr()),
                                          np.uint64(ptrs.data_ptr()), np.uint64(0),
                                          np.uint64(progress.data_ptr()),
                                          np.uint64(slots.data_ptr()), np.uint64(fin.data_ptr()),
                                          np.int64(n_items), np.int64(hi - lo),
                                          np.uint64(c + 1), np.int32(mode)))  # fmt: skip

    variants = {
        "pass in place (floor)": lambda c: in_place(c, False),
        "undo copy + pass": lambda c: in_place(c, True),
        f"resumable pass (default build, {cp.RF_PARTS} parts)": resumable,
        "resumable, 1 part": lambda c: resumable(c, parts=1),
        "resumable, 4 parts": lambda c: resumable(c, parts=4),
        "resumable, 4 units a step, 2 parts": lambda c: resumable(c, fn=built[1, 4, 2], parts=2),
        "resumable, no fence (diagnosis), 2 parts": lambda c: resumable(c, fn=built[2, 2, 2], parts=2),
    }

    stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    out = {}
    with stream:
        # Bytes: both passes from the same state give the same parameters, moments, parity.
        keep = [t.clone() for t in (p, m, v)]
        scratch.zero_()
        in_place(0, False)
        want = [t[: CHUNK_UNITS * UE].clone() for t in (p, m, v)] + [scratch.clone()]
        for t, k in zip((p, m, v), keep, strict=True):
            t.copy_(k)
        scratch.zero_()
        resumable(0)
        got = [t[: CHUNK_UNITS * UE].clone() for t in (p, m, v)] + [scratch.clone()]
        same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want, got, strict=True))
        out["bit-identical (chunk 0: param, exp_avg, exp_avg_sq, parity)"] = same
        del keep, want, got
        for name, fn in variants.items():
            times = []
            for _ in range(args.repeats + 1):
                progress.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for c in range(n_chunks):
                    fn(c)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            times = sorted(times[1:])
            out[name] = {"median ms": times[len(times) // 2], "min ms": times[0], "max ms": times[-1]}
    out["registers"] = regs
    out["state"] = f"{n_units} units of {PAGE >> 20} MiB, {n_chunks} chunks of {CHUNK_UNITS} units, H1={H}"
    out["device"] = torch.cuda.get_device_name()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
