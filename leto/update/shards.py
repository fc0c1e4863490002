"""A parallelized model's parameters under Leto: each rank retains its local shards.

Runs in the trainer. Two kinds of sharded parameter, both DTensors:

* **FSDP2** (``fully_shard``): every parameter is sharded on dim 0 over the
  data-parallel mesh. Its ``FSDPParam`` holds the rank's *padded* local shard as one
  flat tensor (``_sharded_param_data``: what the all-gather reads) and the DTensor's
  local tensor, a view of that shard's valid rows. Leto places both in retained pool
  memory — the valid rows at the parameter's slot, the padding right after it (zeroed
  pages, never updated). After backward FSDP2 reduce-scatters and, when the parameter
  already has a ``.grad``, adds its shard *in place* (``grad._local_tensor += shard``).
* **Tensor parallel** (``parallelize_module``: ``ColwiseParallel``, ``RowwiseParallel``
  and the like): the parameter's local tensor moves into retained memory; autograd
  accumulates into an existing DTensor ``.grad`` in place.
* **FSDP2 × TP** (a 2-D mesh, FSDP2 on the data-parallel dimension): FSDP2's shard of
  the TP-local tensor, as for FSDP2.
* **Expert parallelism × FSDP2**: a DTensor parameter left out of every ``fully_shard``
  unit (``ignored_params``) and sharded over every rank by its own parallelism — a
  mixture of experts' experts, ``Shard(0)`` by expert over the ep mesh — is retained as
  the rank's local tensor, as for TP; its gradient is the script's (the all-to-all
  brings every rank's tokens to the expert).

Every sharded parameter gets a DTensor gradient over retained memory, zeroed at each
iteration's start, so the reduced gradient lands there without a copy; it is not
replicated across ranks — its parity is what protects it. The parallelism does its own
reductions (FSDP2's reduce-scatter, TP's collectives): Leto's data-parallel all-reduce
is off for a sharded model, so a data-parallel dimension must be FSDP2's. A recovery
re-forms the module as the script does (``fully_shard`` / ``parallelize_module`` over a
fresh model in the promoted trainer), and binding puts the retained shards back under
it: no checkpoint, no collective for the state.

FSDP2 internals used (torch 2.11–2.13; checked, with a clear error, before anything is
bound): ``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params`` and, per
``FSDPParam``, ``sharded_param``, ``sharded_size``, ``padded_sharded_param_size``,
``_sharded_param_data``, ``fsdp_placement``, ``mesh_info`` and ``to_sharded_dtensor``.

Not covered: HSDP (FSDP2's replicate × shard mesh), ``Shard(d)`` for d > 0
(``shard_placement_fn``), CPU offload, data parallelism beside TP without FSDP2.
(Pipeline stages are ordinary modules: ``leto.Run(..., data_parallel=False)``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leto.errors import InvalidInput

_NEEDS = (
    "sharded_param",
    "sharded_size",
    "padded_sharded_param_size",
    "_sharded_param_data",
    "fsdp_placement",
    "mesh_info",
    "to_sharded_dtensor",
)


@dataclass(frozen=True)
class LocalShard:
    """One parameter's shard on this rank."""

    param: torch.nn.Parameter  # the DTensor parameter the model and the optimizer hold
    shape: torch.Size  # the local tensor (FSDP2: the valid rows)
    span: int  # elements retained for it (FSDP2: the padded shard; >= shape.numel())
    owner: object = None  # its FSDPParam (None: a tensor-parallel DTensor)

    def grad_of(self, view: torch.Tensor):
        """A DTensor gradient of this parameter whose local tensor is ``view``."""
        if self.owner is not None:
            return self.owner.to_sharded_dtensor(view.view(self.shape))
        from torch.distributed.tensor import DTensor

        p = self.param
        return DTensor.from_local(
            view.view(self.shape), p.device_mesh, p.placements,
            shape=p.shape, stride=p.stride(), run_check=False,
        )  # fmt: skip


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter is a DTensor (``fully_shard``, ``parallelize_module``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def local_shards(model: torch.nn.Module, world: int) -> dict[int, LocalShard]:
    """id(parameter) -> its shard, for every DTensor parameter of the model; a layout Leto
    cannot retain is refused by name. Plain parameters beside tensor-parallel ones are
    replicated over the TP mesh (their gradients are the same on every rank)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    out: dict[int, LocalShard] = {}
    fqn = {id(p): n for n, p in model.named_parameters()}
    fsdp = False
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        fsdp = True
        group = mod._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            missing = [a for a in _NEEDS if not hasattr(fp, a)]
            if missing:
                raise InvalidInput(
                    f"this torch's FSDP2 lacks {missing} on FSDPParam; Leto's FSDP2 support "
                    f"was built against torch 2.11–2.13 — nothing was retained"
                )
            name = fqn.get(id(fp.sharded_param), "a parameter")
            if fp.fsdp_placement != Shard(0):
                raise InvalidInput(
                    f"{name} is sharded on dim {fp.fsdp_placement.dim}; Leto retains Shard(0) "
                    f"shards only (no shard_placement_fn) — nothing was retained"
                )
            if getattr(fp, "offload_to_cpu", False):
                raise InvalidInput(
                    f"{name}: FSDP2 CPU offload is not supported under Leto (the retained "
                    f"shard is the parameter) — nothing was retained"
                )
            if getattr(fp.mesh_info, "replicate_mesh_dim", None) is not None:
                raise InvalidInput(
                    f"{name} is on an HSDP mesh (replicate x shard); Leto supports FSDP2 "
                    f"on one data-parallel mesh dimension — nothing was retained"
                )
            span = 1
            for d in fp.padded_sharded_param_size:
                span *= d
            out[id(fp.sharded_param)] = LocalShard(
                fp.sharded_param, torch.Size(fp.sharded_size), span, fp
            )
    for name, p in model.named_parameters():
        if id(p) in out:
            continue
        # A DTensor outside every fully_shard unit (FSDP2's ignored_params) is sharded by
        # its own parallelism over every rank — a mixture of experts' experts under expert
        # parallelism beside FSDP2 — and retained as the rank's shard, as for TP.
        if fsdp and not isinstance(p, DTensor):
            raise InvalidInput(
                f"parameter {name} is not sharded by fully_shard; apply fully_shard to the "
                f"root module too (Leto retains FSDP2 shards and does no data-parallel "
                f"reduction of its own for a sharded model) — nothing was retained"
            )
        if isinstance(p, DTensor):
            if p.device_mesh.size() != world:
                raise InvalidInput(
                    f"parameter {name} is tensor-parallel over {p.device_mesh.size()} of "
                    f"{world} ranks: data parallelism beside TP needs fully_shard on the "
                    f"data-parallel mesh dimension (FSDP2 x TP) — nothing was retained"
                )
            local = p.to_local()
            out[id(p)] = LocalShard(p, local.shape, local.numel())
    return out


def bind_shard(shard: LocalShard, padded: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Put one parameter's shard into retained memory: ``padded`` (1-D, ``span``
    elements: the local tensor, then FSDP2's padding) becomes the parameter's local
    tensor (and what FSDP2 all-gathers from); ``grad`` (the local tensor's elements) its
    gradient's local tensor (None: a frozen parameter, no gradient)."""
    n = shard.shape.numel()
    if padded.numel() != shard.span or (grad is not None and grad.numel() != n):
        raise ValueError(f"retained views of {padded.numel()} elements for a shard of "
                         f"{shard.span} (gradient: {n})")  # fmt: skip
    if shard.owner is not None:
        shard.owner._sharded_param_data = padded
    shard.param._local_tensor = padded[:n].view(shard.shape)
    if grad is not None:
        shard.param.grad = shard.grad_of(grad)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return getattr(t, "_local_tensor", t)
