"""The model zoo's training script: one case of ``bench/zoo/models.py``, as a user writes
it for torchrun + DDP, and (``--leto``) the same script with Leto's changes.

    torchrun --standalone --nproc-per-node 1 bench/zoo/train.py --case tied --out ref
    leto run --nproc-per-node 1 bench/zoo/train.py --leto --case tied --out leto

The Leto port changes what docs/porting.md says (``leto.init``, ``leto.Run`` with the
optimizers, schedulers and scaler, ``run.iterations``, ``run.record_loss``); everything
else — autocast, the GradScaler, clipping, a hand-set lr, torch.compile — is the same
line in both. Deterministic algorithms on, so two runs can be compared bit for bit.

Writes under ``--out``: ``rank<r>.state.pt`` (every parameter and every optimizer's
state, as ``state_dict()`` reports them, at the end) and ``rank<r>.zoo-losses.jsonl`` (each
iteration's summed loss as a float's hex, exact).

Not covered: data loading (the tokens are a function of rank, iteration and micro-batch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the clone, for bench.zoo

from bench.zoo.models import CASES, SIZES, make_model, make_optimizers, tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, choices=sorted(CASES), help="the zoo case")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model sizes")
    ap.add_argument("--iterations", type=int, default=4, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per iteration")
    ap.add_argument("--out", required=True, help="folder for the state and losses")
    ap.add_argument("--leto", action="store_true", help="the Leto port (under leto run)")
    ap.add_argument("--zero1", action="store_true", help="Leto port: leto.Run(..., zero1=True)")
    ap.add_argument("--leave-at", type=int, help="break out of the loop at this iteration, "
                    "before its step (as llm.c's loop does at its last step)")  # fmt: skip
    ap.add_argument("--models", help="comma-separated: train only these of the case's models "
                    "(default all; a test whose claim one model shows)")  # fmt: skip
    args = ap.parse_args()
    case = CASES[args.case]
    if args.models:
        models = tuple(args.models.split(","))
        if not set(models) <= set(case.models):
            ap.error(f"--models {args.models}: case {case.name} has {', '.join(case.models)}")
        case = dataclasses.replace(case, models=models)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.leto:
        import leto

        ctx = leto.init()
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    size = SIZES[args.size]
    model = make_model(case, args.size, device)
    start = 1234 if case.optim.endswith("-loaded") else 0  # the script resumes its checkpoint
    opts, scheds, hand_lr = make_optimizers(case, model, args.iterations)
    fp16 = case.precision == "fp16-scaler"
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    amp_dtype = {"bf16-autocast": torch.bfloat16, "fp16-scaler": torch.float16}.get(case.precision)
    amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    if args.leto:
        run = leto.Run(ctx, model, opts, scheds, scaler=scaler if fp16 else None,
                       start_iteration=start, zero1=args.zero1)  # fmt: skip
        ddp = run.model
        loop = run.iterations(start + args.iterations)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        loop = range(start, start + args.iterations)
    inner = ddp.module
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Appended to, a line an iteration: a promoted Leto trainer runs the script again
    # from the top and logs the iterations it redoes again (the latest line counts).
    log = open(out / f"rank{rank}.zoo-losses.jsonl", "a")  # noqa: SIM115
    for it in loop:
        if args.leave_at is not None and it == start + args.leave_at:
            break
        if hand_lr is not None:
            for o in opts:
                for g in o.param_groups:
                    g["lr"] = hand_lr(it)
        total = torch.zeros((), device=device)
        for micro in range(args.accum):
            x = tokens(0, rank, it, micro, size).to(device)
            sync = micro == args.accum - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                with amp:
                    # Through the DDP(-shaped) object: its forward decides the reduction.
                    loss = ddp(x) / args.accum
                scaler.scale(loss).backward()
            total += loss.detach().float()
        if case.clip is not None:
            for o in opts:
                scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        if args.leto:
            run.record_loss(total)
        for o in opts:
            scaler.step(o)
        scaler.update()
        for s in scheds:
            s.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        log.write(json.dumps({"iteration": it, "loss": float(total).hex()}) + "\n")
        log.flush()
    log.close()
    state = {
        "params": {n: p.detach().cpu().clone() for n, p in inner.named_parameters()},
        # (Under ZeRO-1 each rank holds a shard of it: state_dict() is refused.)
        "optim": [] if args.zero1 else [o.state_dict() for o in opts],
    }
    torch.save(state, out / f"rank{rank}.state.pt")
    del ddp, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
