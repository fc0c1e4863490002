"""How Dynamo splits a compiled model inside torch's DDP and inside ``run.model``
(``leto.trainer.ddp_shape.DDPShaped``) whose parameters are views of one flat buffer, as
Leto binds them: prints the pieces (each piece's parameter inputs) of both as JSON.
One process, a gloo group of one (DDP needs a process group; its split does not depend
on the world size). Run by tests/test_compiled_split.py."""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

from leto.trainer.ddp_shape import DDPShaped

BUCKET_MIB = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(6)]
    )


def recorder():
    pieces = []

    def backend(gm, example_inputs):
        pieces.append(sorted(n.target for n in gm.graph.nodes if n.op == "placeholder"))
        return gm.forward

    return pieces, backend


def on_one_buffer(m: nn.Module) -> nn.Module:
    """Every parameter a view of one flat tensor (leto.update.layout's binding)."""
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    at = 0
    for mod in list(m.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, nn.Parameter(flat[at : at + p.numel()].view(p.shape)))
            at += p.numel()
    return m


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29655"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.randn(4, 256)
    ddp_pieces, backend = recorder()
    ddp = nn.parallel.DistributedDataParallel(
        torch.compile(model(), backend=backend), bucket_cap_mb=BUCKET_MIB
    )
    ddp(x).sum().backward()
    torch._dynamo.reset()
    leto_pieces, backend = recorder()
    run = SimpleNamespace(job=SimpleNamespace(sync_backward=lambda on: None))
    shaped = DDPShaped(
        torch.compile(on_one_buffer(model()), backend=backend), run, None, BUCKET_MIB
    )
    shaped(x).sum().backward()
    print(json.dumps({"ddp": ddp_pieces, "leto": leto_pieces}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
