"""How a model's training state maps onto retained pool memory.

Runs in the trainer. Parameters (and, for bf16 parameters, fp32 master weights) and the
AdamW moments form one pool *allocation set*: unit u holds the same element range of
every tensor, so the pages of one element range — parameter, master, moments — are
consecutive pages of one protection group, and a *chunk* (a few units) commits all of
its state together. Gradients are a separate protected allocation (their own groups,
re-encoded every iteration). Every tensor is flat; each model parameter is a view into
it at a fixed offset, so model code is unchanged.

A parallelized model (FSDP2, tensor parallel, both) retains each rank's local shards
instead (``leto.update.shards``): a slot per parameter shard, FSDP2's padding after it.

A pipeline stage is an ordinary model here (its parameters are its own).

Not covered: parameters of mixed dtypes (one dtype per model; bf16 gets fp32 master
weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leto.errors import InvalidInput
from leto.memory.client import GroupView, PoolClient
from leto.memory.config import AllocationKind
from leto.update.optim import CUT_ELEMS
from leto.update.shards import LocalShard, bind_shard, is_sharded, local, local_shards

SET_NAMES = ("param", "master", "exp_avg", "exp_avg_sq")
# Parameter alignment in elements: the optimizer's cut granularity (it must divide every
# unit, checked below).
ALIGN_ELEMS = CUT_ELEMS


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: torch.Size
    offset: int  # in elements of the flat tensors
    numel: int
    layerwise: bool = False  # updated as a whole (its own chunk), e.g. by Muon
    trainable: bool = True  # requires_grad: frozen parameters are retained, never updated
    aliases: tuple[str, ...] = ()  # other names of the same (tied) parameter
    span: int = 0  # elements reserved from offset when more than numel (an FSDP2 shard's padding)


class RetainedModel:
    def __init__(
        self,
        client: PoolClient,
        model: torch.nn.Module,
        chunk_units: int = 2,
        shard: tuple[int, int] | None = None,
        layerwise=None,
    ):
        """``layerwise(name, param) -> bool`` marks parameters a layer-wise optimizer
        updates whole: each starts on a unit boundary, owns its units and lies in one
        protection group, so its chunk is exactly the layer."""
        params = list(model.named_parameters())
        if not params:
            raise ValueError("the model has no parameters")
        check_buffers(model)
        # FSDP2 / tensor parallel: this rank's shard of each DTensor parameter is what is
        # retained (None: no DTensor parameters).
        self.shards: dict[str, LocalShard] | None = None
        if is_sharded(model):
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else 1
            by_id = local_shards(model, world)
            self.shards = {n: by_id[id(p)] for n, p in params if id(p) in by_id}
            if shard is not None or layerwise is not None:
                raise ValueError(
                    "a parallelized model (FSDP2, tensor parallel) takes neither ZeRO-1 nor "
                    "a layer-wise optimizer under Leto"
                )
        # Tied parameters (one tensor under several names, e.g. an LM head sharing the
        # embedding) are retained once and bound under every name.
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"parameters must all be float32 or all bfloat16, found {sorted(map(str, dtypes))}"
            )
        self.client = client
        self.dtype = next(iter(dtypes))
        self.master = self.dtype != torch.float32
        self.page_bytes = client.config.page_bytes
        psize = torch.empty((), dtype=self.dtype).element_size()
        self.unit_elems = self.page_bytes // psize  # one parameter page per unit
        if self.unit_elems % ALIGN_ELEMS:
            raise ValueError(
                f"pages of {self.page_bytes} bytes hold {self.unit_elems} parameters; the "
                f"layout needs a multiple of {ALIGN_ELEMS} (use pages of at least "
                f"{ALIGN_ELEMS * psize} bytes)"
            )
        self.slots: list[ParamSlot] = []
        ue = self.unit_elems
        names = [n for n in SET_NAMES if n != "master" or self.master]
        sizes = {"param": psize, "master": 4, "exp_avg": 4, "exp_avg_sq": 4}
        unit = sum(ue * sizes[n] // self.page_bytes for n in names)
        per_group_elems = (client.config.data_pages // unit) * ue
        if layerwise is not None and shard is not None:
            raise ValueError(
                "a layer-wise optimizer with ZeRO-1 sharding is not supported; use one or the other"
            )
        off = 0
        align = ALIGN_ELEMS
        for name, p in params:
            whole = bool(layerwise and layerwise(name, p))
            # Every parameter starts at a multiple of ALIGN_ELEMS elements (>= 16 bytes,
            # as the caching allocator aligns tensors): CUDA's _foreach_norm takes its
            # vectorized path (a different summation order) only for aligned tensors,
            # and the CPU fused AdamW needs chunk cuts at vector multiples from a
            # parameter's start. Gaps stay zero (pages are zeroed) and are never updated.
            off = -(-off // align) * align
            if whole:
                off = -(-off // ue) * ue  # a fresh unit
                if p.numel() > per_group_elems:
                    raise ValueError(
                        f"layer {name} has {p.numel()} elements, more than one protection group "
                        f"holds ({per_group_elems}); raise data_pages or the page size"
                    )
                if off // per_group_elems != (off + p.numel() - 1) // per_group_elems:
                    off = -(-off // per_group_elems) * per_group_elems  # start the next group
            others = tuple(n for n in aliases[id(p)] if n != name)
            shape, span = p.shape, 0
            if self.shards is not None and name in self.shards:
                shape, span = self.shards[name].shape, self.shards[name].span
            numel = shape.numel()
            self.slots.append(
                ParamSlot(name, shape, off, numel, whole, p.requires_grad, others, span)
            )
            off += max(numel, span)
            if whole:
                off = -(-off // ue) * ue  # nothing else shares its units
        self.numel = off
        # ZeRO-1: this rank updates (and retains optimizer state for) one shard of
        # whole units; every shard has the same padded size so all-gather is uniform.
        total_units = -(-self.numel // self.unit_elems)
        self.shard = shard
        if shard is None:
            self.shard_start, self.local_elems, self.local_valid = 0, self.numel, self.numel
        else:
            rank, world = shard
            per = -(-total_units // world)
            self.shard_start = rank * per * self.unit_elems
            self.local_elems = per * self.unit_elems
            self.local_valid = (
                min(self.numel, self.shard_start + self.local_elems) - self.shard_start
            )
            if self.local_valid <= 0:
                raise ValueError(
                    f"rank {rank} of {world} gets no parameters: {total_units} units of "
                    f"{self.unit_elems} elements cannot be sharded {world} ways"
                )
        self.set_names = names
        self.unit_pages = [self.unit_elems * sizes[n] // self.page_bytes for n in names]
        self.unit = sum(self.unit_pages)
        reply = client.attach_set(
            names, [self.local_elems * sizes[n] for n in names], self.unit_pages
        )
        self.units, self.units_per_group, self.first_group = (
            reply.units,
            reply.units_per_group,
            reply.first_group,
        )
        self.chunk_units = max(1, min(chunk_units, self.units_per_group))
        self._chunks = [self._chunks_of(gi) for gi in range(-(-self.units // self.units_per_group))]
        self.max_chunk_units = max(u1 - u0 for cs in self._chunks for u0, u1 in cs)
        self.flat = {
            n: client.attach(n, self.local_elems * sizes[n]).view(
                self.dtype if n == "param" else torch.float32
            )
            for n in names
        }
        self.grad = client.attach("grad", shape=(self.numel,), dtype=self.dtype)
        # The full parameters the model computes with: the retained shard itself when
        # unsharded; with ZeRO-1 a reusable buffer refilled by all-gather from the
        # owners' retained shards (so it never needs parity).
        if shard is None:
            self.param_full = self.flat["param"]
        else:
            self.param_full = client.attach(
                "param_full",
                shape=(shard[1] * self.local_elems,),
                dtype=self.dtype,
                kind=AllocationKind.REUSABLE,
            )
        self.n_groups = -(-self.units // self.units_per_group)

    # -- model binding --------------------------------------------------------------

    def bind(self, model: torch.nn.Module, swap_data: bool = False) -> dict[str, torch.nn.Parameter]:
        """Make every parameter (and, if it trains, its .grad) a view of retained
        memory, under each of its names; returns the new parameters by name.
        ``swap_data``: each parameter keeps its object, its storage swapped (``.data``) and
        its ``.grad`` left alone — where a library holds the parameter objects and keeps
        their gradients itself (Megatron's DDP: its hooks, buckets and ``main_grad``);
        ``stage_grads`` then copies those gradients in before an update."""
        out = {}
        for slot in self.slots:
            if swap_data:
                module_name, _, attr = slot.name.rpartition(".")
                param = getattr(model.get_submodule(module_name), attr)
                param.data = self.param_full[slot.offset : slot.offset + slot.numel].view(
                    slot.shape
                )
                out[slot.name] = param
                continue
            sh = self.shards.get(slot.name) if self.shards is not None else None
            if sh is not None:  # a DTensor parameter stays; its local shard moves here
                bind_shard(
                    sh,
                    self.param_full[slot.offset : slot.offset + max(slot.span, slot.numel)],
                    self.grad[slot.offset : slot.offset + slot.numel] if slot.trainable else None,
                )
                out[slot.name] = sh.param
                continue
            view = self.param_full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            param = torch.nn.Parameter(view, requires_grad=slot.trainable)
            module_name, _, attr = slot.name.rpartition(".")
            old = getattr(model.get_submodule(module_name), attr, None)
            if isinstance(old, torch.nn.Parameter):
                # What libraries note on a parameter (Megatron's tensor_model_parallel,
                # partition_dim, shared...: its gradient norm counts a shard by them).
                param.__dict__.update(old.__dict__)
            if slot.trainable:
                param.grad = self.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for name in (slot.name, *slot.aliases):
                module_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(module_name), attr, param)
            out[slot.name] = param
        return out

    def attach_grads(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Point every trainable parameter's .grad at retained memory again (a script's
        ``zero_grad(set_to_none=True)`` drops it)."""
        for slot in self.slots:
            p = params[slot.name]
            if slot.trainable and (
                p.grad is None or local(p.grad).data_ptr() != self._grad_ptr(slot)
            ):
                view = self.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
                sh = self.shards.get(slot.name) if self.shards is not None else None
                p.grad = sh.grad_of(view) if sh is not None else view

    def stage_grads(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Copy every trainable parameter's gradient (a library's own buffer: ``bind``'s
        ``swap_data``) into retained memory, for the update to read and protect."""
        for slot in self.slots:
            if not slot.trainable:
                continue
            g = params[slot.name].grad
            if g is None:
                raise InvalidInput(
                    f"parameter {slot.name} has no gradient at the optimizer's step: its "
                    "optimizer would skip it, and Leto updates every trainable parameter — "
                    "freeze it (requires_grad=False) before leto.Run"
                )
            self.grad[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(g)

    def check_grads(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Every trainable parameter's gradient is still its retained view."""
        for slot in self.slots:
            g = params[slot.name].grad
            if slot.trainable and (g is None or local(g).data_ptr() != self._grad_ptr(slot)):
                raise RuntimeError(
                    f"the gradient of {slot.name} is not in retained memory any more "
                    f"(set to None or replaced after the iteration began); gradients "
                    f"would not be retained — zero them with optimizer.zero_grad() "
                    f"under Leto, which keeps them in place"
                )

    def _grad_ptr(self, slot: ParamSlot) -> int:
        return self.grad.data_ptr() + slot.offset * self.grad.element_size()

    # -- groups and chunks ----------------------------------------------------------

    def set_groups(self, views: list[GroupView]) -> list[GroupView]:
        """The allocation set's groups, in update order."""
        by_gid = {g.gid: g for g in views}
        return [by_gid[self.first_group + i] for i in range(self.n_groups)]

    @staticmethod
    def groups_of(views: list[GroupView], name: str) -> list[GroupView]:
        return [g for g in views if any(m[0] == name for m in g.members)]

    def chunks(self, group_index: int) -> list[tuple[int, int]]:
        """Unit ranges [u0, u1) of the chunks of a group (global unit numbers)."""
        return self._chunks[group_index]

    def _chunks_of(self, group_index: int) -> list[tuple[int, int]]:
        # chunk_units units at a time, except that a layer-wise parameter's units form
        # one chunk of their own.
        first = group_index * self.units_per_group
        last = min(self.units, first + self.units_per_group)
        ue = self.unit_elems
        whole = {
            (s.offset - self.shard_start) // ue: -(-(s.offset - self.shard_start + s.numel) // ue)
            for s in self.slots
            if s.layerwise
        }
        out, u = [], first
        while u < last:
            if u in whole:
                out.append((u, whole[u]))
                u = whole[u]
                continue
            end = min(u + self.chunk_units, last)
            nxt = min((w for w in whole if u < w < end), default=end)
            out.append((u, nxt))
            u = nxt
        return out

    def chunk_pages(self, group_index: int, units: tuple[int, int]) -> tuple[int, int]:
        """(first page in the group, page count) of a chunk: consecutive by construction."""
        u0, u1 = units
        return (u0 - group_index * self.units_per_group) * self.unit, (u1 - u0) * self.unit

    def element_range(self, units: tuple[int, int]) -> tuple[int, int]:
        """A chunk's elements in this rank's (shard-local) tensors."""
        return units[0] * self.unit_elems, min(units[1] * self.unit_elems, self.local_valid)

    def slot_at(self, local_start: int) -> ParamSlot:
        g = local_start + self.shard_start
        return next(s for s in self.slots if s.offset <= g < s.offset + s.numel)

    def pieces(self, e0: int, e1: int) -> list[tuple[int, int]]:
        """Shard-local [a, b) ranges of a chunk cut at parameter boundaries (the
        optimizer runs per parameter, as torch.optim does, so results match it bit for
        bit). Add ``shard_start`` for positions in the full gradient."""
        out = []
        g0, g1 = e0 + self.shard_start, e1 + self.shard_start
        for s in self.slots:
            a, b = max(g0, s.offset), min(g1, s.offset + s.numel)
            if a < b:
                out.append((a - self.shard_start, b - self.shard_start))
        return out

    def load_shard(self) -> None:
        """Copy this rank's shard of the full parameters into its retained state."""
        if self.shard is None:
            return
        lo, n = self.shard_start, self.local_valid
        self.flat["param"][:n].copy_(self.param_full[lo : lo + n])
        if self.master:
            self.flat["master"][:n].copy_(self.param_full[lo : lo + n].float())

    def gather(self, group=None) -> None:
        """ZeRO-1: every rank's updated shard into everyone's full parameters."""
        if self.shard is None:
            return
        import torch.distributed as dist

        parts = list(self.param_full.split(self.local_elems))
        dist.all_gather(parts, self.flat["param"], group=group)


def check_buffers(model: torch.nn.Module) -> None:
    """A buffer on the meta device would never get a value: refused by name. (Persistent
    buffers: ``leto.trainer.buffer_state`` under ``leto.Run``.)"""
    for name, b in model.named_buffers():
        if b.device.type == "meta":
            raise ValueError(
                f"buffer {name} is on the meta device; build buffers on the real device "
                f"(the script's construction gives them their values)"
            )
