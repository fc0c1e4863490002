"""What it costs for the gradients to land in a persistent flat buffer — an in-process
benchmark of one component (issue 59), never a figure of the product.

Leto's retained gradients are views of one flat buffer that backward accumulates into:
the buffer is zeroed at the iteration's start and every parameter's first gradient is
*added* to zeros (read the buffer, read the gradient, write the buffer), where a plain
script's ``zero_grad(set_to_none=True)`` lets autograd keep the gradient it computed
(no traffic). Three ways, on a stack of ``--layers`` linear layers (``--dim``², bf16
autocast, fp32 parameters), ``--tokens`` rows a step:

* ``none``: ``.grad`` set to None before backward (what the plain script does);
* ``views``: ``.grad`` the flat buffer's views, zeroed before forward (Leto today);
* ``copy``: ``.grad`` None before backward; a hook copies each gradient into its view as
  it arrives (the first micro-batch's), and the view becomes ``.grad`` after.

Each step's time (forward + backward; the zeroing included for ``views``) and whether
every way's gradients equal ``none``'s bytes (``views``' may differ in the sign of a
zero: 0.0 + -0.0 is 0.0).

    python -m bench.grad_landing --layers 16 --dim 8192 --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.dim, args.dim, bias=True) for _ in range(args.layers)]
    ).to(dev)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    flat = torch.zeros(n, device=dev)
    views, off = [], 0
    for p in params:
        views.append(flat[off : off + p.numel()].view(p.shape))
        off += p.numel()
    x = torch.randn(args.tokens, args.dim, device=dev)
    mode = {"v": "none"}

    def pre(i):
        def hook(g):
            if mode["v"] == "copy" and params[i].grad is None:
                views[i].copy_(g)
            return g

        return hook

    def post(i):
        def hook(p):
            if mode["v"] == "copy":
                p.grad = views[i]

        return hook

    for i, p in enumerate(params):
        p.register_hook(pre(i))
        p.register_post_accumulate_grad_hook(post(i))

    def step(way: str) -> None:
        mode["v"] = way
        if way == "views":
            flat.zero_()
            for p, v in zip(params, views, strict=True):
                p.grad = v
        else:
            for p in params:
                p.grad = None
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()

    def grads(way: str) -> list[torch.Tensor]:
        step(way)
        return [(p.grad if way == "none" else v).clone() for p, v in zip(params, views, strict=True)]

    ref = grads("none")
    rows = {}
    for way in ("none", "views", "copy", "none", "views", "copy"):
        same = all(
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(ref, grads(way), strict=True)
        )
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda d: None)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(way)
        sync(dev)
        ms = (time.perf_counter() - t0) * 1e3 / args.steps
        rows.setdefault(way, []).append(ms)
        print(f"{way:>6}: {ms:8.2f} ms a step; gradients' bytes equal to none's: {same}")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out = {"gpu": name, "date": time.strftime("%Y-%m-%d"),
           "parameters": n, "tokens": args.tokens, "ms": rows}  # fmt: skip
    print(json.dumps(out))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
