"""In-process component benchmark (not the user path): one 64-unit chunk of 2 MiB pages
through the fused chunk pass, with the undo copy made beforehand (what ``main`` does)
against the pass writing the undo copy itself (issue 46 item 2). Prints GPU ms per chunk
(CUDA events, the median of ``--reps``) and checks every variant's bytes against the
plain pass's.

    python -m bench.undo_in_pass
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch

from leto.update.chunk_pass import SEG, THREADS, _module
from nvbit_tools import tripwire


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=64)
    ap.add_argument("--page-bytes", type=int, default=2 << 20)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    ue = a.page_bytes // 4
    n = a.units * ue
    gen = torch.Generator(device=dev).manual_seed(0)
    init = {
        "p": torch.randn(n, device=dev, generator=gen),
        "m": torch.randn(n, device=dev, generator=gen) * 1e-3,
        "v": torch.rand(n, device=dev, generator=gen) * 1e-6,
    }
    g = torch.randn(n, device=dev, generator=gen) * 1e-2
    seg = np.array([(0, n, 3e-4, 0.9, 0.95, 0.1, 1e-8, 5.0, 1, 0)], dtype=SEG)
    seg_t = torch.from_numpy(seg.view(np.uint8)).to(dev)
    cols = 3 * a.units
    tables = torch.randint(0, 2**31, (cols * 512,), device=dev, dtype=torch.int64).to(torch.int32)
    scratch = [torch.zeros(ue, device=dev, dtype=torch.int32) for _ in range(4)]
    ptrs = torch.tensor([s.data_ptr() for s in scratch], dtype=torch.int64, device=dev)
    undo = {k: torch.empty(n, device=dev) for k in "pmv"}
    items = ue // 4
    blocks = -(-items // THREADS)
    su = 4  # chunk_pass.cu's units per stage at NP = 2
    flags = torch.zeros(blocks * -(-a.units // su), device=dev, dtype=torch.int32)
    mod = _module()
    fns = {k: mod.get_function(k) for k in ("chunk_pass_p2", "chunk_pass_undo1_p2",
                                             "chunk_pass_undo2_p2")}  # fmt: skip
    live = {k: v.clone() for k, v in init.items()}

    def launch(name):
        args = [np.uint64(live["p"].data_ptr()), np.uint64(live["m"].data_ptr()),
                np.uint64(live["v"].data_ptr()), np.uint64(g.data_ptr()), np.int64(ue),
                np.int32(0), np.int32(a.units), np.int64(0), np.int64(items),
                np.uint64(seg_t.data_ptr()), np.int32(1), np.uint64(tables.data_ptr()),
                np.int32(0), np.int32(0), np.uint64(ptrs.data_ptr()), np.int32(4),
                np.uint64(0)]  # fmt: skip
        if name != "chunk_pass_p2":
            args += [np.uint64(undo[k].data_ptr()) for k in "pmv"] + [np.uint64(flags.data_ptr())]
        with tripwire.launch_on_torch_stream(dev):
            fns[name]((blocks,), (THREADS,), tuple(args))

    variants = {
        "pass alone (no undo)": lambda: launch("chunk_pass_p2"),
        "undo copy, then pass (main)": lambda: (
            [undo[k].copy_(live[k]) for k in "pmv"], launch("chunk_pass_p2")),
        "pass writes undo (unordered)": lambda: launch("chunk_pass_undo1_p2"),
        "pass writes undo, fenced and flagged a stage at a time": lambda: (
            flags.zero_(), launch("chunk_pass_undo2_p2")),
    }
    # Bytes: every variant from the same state gives the plain pass's state, parity and
    # (where it writes one) an undo copy equal to the old state.
    want = None
    for name, fn in variants.items():
        for k in live:
            live[k].copy_(init[k])
        for s in scratch:
            s.zero_()
        for k in undo:
            undo[k].fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        got = {**{k: v.clone() for k, v in live.items()}, "parity": torch.stack(scratch).clone()}
        if want is None:
            want = got
        same = all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
        undo_ok = name.startswith("pass alone") or all(
            torch.equal(undo[k].view(torch.int32), init[k].view(torch.int32)) for k in "pmv"
        )
        print(f"bytes: {name}: state and parity {'equal' if same else 'DIFFER'}; "
              f"undo copy {'= old state' if undo_ok else 'WRONG'}")  # fmt: skip
    out = {}
    for name, fn in variants.items():
        times = []
        for _ in range(a.reps + 3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        out[name] = statistics.median(times[3:])
    base = out["undo copy, then pass (main)"]
    for name, ms in out.items():
        print(f"{name}: {ms:.3f} ms a chunk ({ms / base:.3f}x main)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
