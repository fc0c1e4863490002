"""Megatron-Core under ``leto.Run``: what Leto takes from Megatron's parallel state and
what it refuses.

Runs in a trainer, in ``leto.Run``, only where the script imported Megatron-Core (Leto
never imports it otherwise). A Megatron job under Leto is Megatron's ``GPTModel`` (or any
of its modules) driven by Megatron's schedule, with torch's optimizer, scheduler and
Leto's gradient reduction where the script had torch's DDP:

* Megatron's parallel state says which ranks hold replicas: tensor or pipeline parallel
  over the whole world (every rank its own shards or stage: nothing reduced), data
  parallel over the whole world (gradients reduced as DDP would), or data parallel within
  tensor × pipeline (gradients reduced, ranks compared, over Megatron's data-parallel
  group: the ranks of one tensor-parallel position and pipeline stage); a pipeline is
  Megatron's schedule of one model chunk a stage (the script sums the tied embedding's
  gradient over the first and last stage, as Megatron-LM's ``finalize_model_grads``), or
  its interleaved schedule over several, each chunk its own Megatron DDP object (a list
  given to ``leto.Run``, which ``run.model`` is);
* a mixture of experts over expert parallelism (Megatron's MoE layers, each rank its own
  experts) with Megatron's DDP and optimizer: its expert buffers reduce the experts'
  gradients over the expert-data-parallel group, Leto retains each rank's experts as its
  own (the replica checks off);
* Megatron's RNG tracker (the named generator states its dropout forks) is retained with
  torch's global generators (``leto.trainer.rng_state``), without the script's help.

Megatron's own ``DistributedDataParallel`` with its optimizer (``get_megatron_optimizer``)
over fp32 parameters (``FP32Optimizer``) or bf16 ones (``Float16Module``, its Float16
optimizer), or with its ``DistributedOptimizer`` (fp32 or bf16): ``adopt`` hands Leto the
torch optimizers inside
Megatron's; Megatron keeps its gradient buffers, its bucketed reduction, its norm and its
clipping, and Leto runs the inner optimizer's ``step()`` — called by Megatron's after it
clipped — as its update, the reduced and clipped gradients (``main_grad``) copied into
retained memory first (``leto.trainer.retained``, ``external_grads``); the parameters keep
their objects (Megatron's hooks and buckets hold them), their storage swapped into the pool.
Where Megatron's optimizer keeps fp32 main copies (the ``DistributedOptimizer``'s shards,
each rank its own; the Float16 optimizer's copies) those are what is retained
(``MainShards``), and after a resume every rank casts them into the parameters (under the
``DistributedOptimizer`` into Megatron's parameter buffer, all-gathered: ``rebuild``).
The routers' expert bias (``moe_router_enable_expert_bias``) is retained per iteration
with the running statistics (``leto.trainer.buffer_state``; the CPU build only so far).
With fp16 parameters its loss scaler skips an update whose gradients hold inf/NaN;
``leto.trainer.megatron_scaler`` tells ``leto.Run`` of each skip and retains the scaler.

Refused when ``leto.Run`` is made, by name, with nothing retained — what is not built
yet, rather than a run that is silently wrong: Megatron's ``DistributedDataParallel``
with a torch optimizer (its gradients live in ``main_grad``: the optimizer would update
nothing), Megatron FSDP, several optimizer instances (docs/megatron-distopt.md); ``Float16Module`` without Megatron's optimizer; apex's and
TransformerEngine's fused optimizers; TransformerEngine layers; sequence parallelism,
fp8/fp4; without
Megatron's DDP the interleaved pipeline schedule (a DDP object a chunk),
pipeline or expert parallelism with data-parallel replicas (its no_sync handling, its
expert buffers); context parallelism; RNG trackers other than
Megatron's own ``CudaRNGStatesTracker`` (TransformerEngine's, CUDA-graph-safe ones).
"""

from __future__ import annotations

import sys

import torch

from leto.errors import FatalFailure, InvalidInput
from leto.job import keys
from leto.trainer import skip_init
from leto.trainer.dp_group import DPGroup

_NOTHING = "; nothing was retained (docs/porting.md, Megatron-Core)"


def imported() -> bool:
    return "megatron.core.parallel_state" in sys.modules


def adopt(model, optimizers: list) -> tuple[list, list | None]:
    """The optimizers Leto runs, and Megatron's ``DistributedDataParallel`` objects — one,
    or one a model chunk under the interleaved schedule (``model`` a list of them) —
    where the script gave ``leto.Run`` Megatron's own DDP and optimizer (the torch
    optimizers inside Megatron's, then); ``(optimizers, None)`` otherwise. Refuses what
    is not supported."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    mod = sys.modules.get("megatron.core.distributed.distributed_data_parallel")
    kind = mod.DistributedDataParallel if imported() and mod is not None else ()
    ddps = [c for c in chunks if kind and isinstance(c, kind)]
    if len(chunks) > 1 and len(ddps) != len(chunks):
        raise InvalidInput(
            "leto.Run takes a list of model chunks as Megatron's DistributedDataParallel "
            "objects, one a chunk (its interleaved pipeline schedule); give any other model "
            "as one module" + _NOTHING
        )
    if not ddps:
        inner = next((m for c in chunks for m in c.modules() if kind and isinstance(m, kind)), None)
        if inner is not None:
            raise InvalidInput(
                "leto.Run: Megatron's DistributedDataParallel is inside another module: give "
                "leto.Run the DistributedDataParallel itself" + _NOTHING
            )
        return optimizers, None
    ddp = ddps[0]
    cfg = ddp.ddp_config
    want = (
        ("DistributedOptimizer",)
        if cfg.use_distributed_optimizer
        else ("FP32Optimizer", "Float16OptimizerWithFloat16Params")
    )
    if getattr(cfg, "num_distributed_optimizer_instances", 1) > 1:
        raise InvalidInput(
            "leto.Run: several DistributedOptimizer instances "
            "(num_distributed_optimizer_instances > 1) are not supported under Leto yet"
            + _NOTHING
        )
    for flag in ("use_megatron_fsdp", "use_custom_fsdp", "nccl_ub"):
        if getattr(cfg, flag, False):
            raise InvalidInput(
                f"leto.Run: Megatron's DistributedDataParallel with {flag}=True is not "
                "supported under Leto yet" + _NOTHING
            )
    inner = []
    for opt in optimizers:
        if not type(opt).__module__.startswith("megatron."):
            raise InvalidInput(
                f"leto.Run: the model is wrapped in Megatron's DistributedDataParallel, whose "
                f"gradients live in main_grad: {type(opt).__name__} would update nothing. "
                "Give leto.Run Megatron's optimizer (get_megatron_optimizer), or the "
                "unwrapped model with a torch optimizer (Leto then reduces the gradients)"
                + _NOTHING
            )
        for part in getattr(opt, "chained_optimizers", [opt]):
            if type(part).__name__ not in want:
                raise InvalidInput(
                    f"leto.Run: Megatron's {type(part).__name__} with its "
                    f"DistributedDataParallel's use_distributed_optimizer="
                    f"{cfg.use_distributed_optimizer} is not supported under Leto "
                    "(docs/megatron-distopt.md) — its FP32Optimizer and Float16 optimizer "
                    "(bf16 parameters) without it, its DistributedOptimizer with it, are"
                    + _NOTHING
                )
            config = getattr(part, "config", None)
            if getattr(config, "overlap_param_gather_with_optimizer_step", False):
                raise InvalidInput(
                    "leto.Run: overlap_param_gather_with_optimizer_step is not supported "
                    "under Leto yet" + _NOTHING
                )
            inner.append(part.optimizer)
    return inner, ddps


def distributed(ddps: list | None) -> bool:
    """Whether Megatron's DDP shards the optimizer (its DistributedOptimizer)."""
    return bool(ddps) and bool(ddps[0].ddp_config.use_distributed_optimizer)


def main_copies(megatron_optimizers: list) -> bool:
    """Whether Megatron's optimizers keep fp32 main copies apart from the model's
    parameters (its DistributedOptimizer's shards, its Float16 optimizer's copies): those,
    not the parameters, are what Leto retains."""
    return any(
        type(part).__name__ in ("DistributedOptimizer", "Float16OptimizerWithFloat16Params")
        for opt in megatron_optimizers
        for part in getattr(opt, "chained_optimizers", [opt])
    )


class MainShards(torch.nn.Module):
    """What Leto retains under Megatron's DistributedOptimizer (this rank's fp32 main
    shards) or Float16 optimizer (fp32 copies of the bf16 parameters): the inner
    optimizer's parameters, as one module's parameters — the same tensor objects
    (Megatron's groups, ``main_param`` and the inner optimizer hold them), so binding
    swaps their storage. Each gets ``requires_grad`` (what Leto updates); no autograd
    runs through them (Megatron sets their ``.grad`` from its buffers). The model's own
    parameters are a cast of them (``rebuild``)."""

    def __init__(self, inner_optimizers: list):
        super().__init__()
        for oi, opt in enumerate(inner_optimizers):
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    if p.is_leaf and not p.requires_grad:
                        p.requires_grad_(True)
                    # (not nn.Parameter objects: registered as they are, by identity)
                    self._parameters[f"o{oi}_g{gi}_p{pi}"] = p


def unrestored(model: torch.nn.Module, observed) -> str | None:
    """A parameter of the model that the retained main copies do not restore (a frozen
    one: Megatron's optimizer keeps no copy of it), or None. A promoted trainer must
    initialize the model as the script does: the active trainer's observation of the
    set-up (``observed``, a ``leto.trainer.skip_init`` mode or None) says so."""
    frozen = next((n for n, p in model.named_parameters() if not p.requires_grad), None)
    if frozen is not None:  # (its value comes from the script's set-up only)
        skip_init.mark_unsafe(
            observed,
            f"{frozen} is frozen, and Megatron's optimizer keeps no copy of it in the "
            "retained state",
        )
    return frozen


def rebuild(megatron_optimizers: list, ddps: list) -> None:
    """The model's parameters from the retained main copies, as Megatron's step makes
    them after each update: each rank casts its own into the parameters (under the
    DistributedOptimizer: into Megatron's parameter buffer, then all-gathered —
    collective: every rank, after a resume)."""
    with torch.no_grad():
        for opt in megatron_optimizers:
            for part in getattr(opt, "chained_optimizers", [opt]):
                part._copy_main_params_to_model_params()
        if distributed(ddps):
            for ddp in ddps:  # (each model chunk's buffers)
                ddp.start_param_sync(force_sync=True)


def check(
    model: torch.nn.Module, optimizers: list, data_parallel: bool, ddp=None
) -> tuple[bool, DPGroup | None]:
    """``data_parallel`` as Megatron's parallel state has it (the script's own value where
    Megatron is not imported or not initialized), and the data-parallel group where it is
    smaller than the world (None: the world); raises ``InvalidInput`` for what is not
    supported. ``ddp``: Megatron's DDP that ``adopt`` accepted (with ``optimizers`` the
    torch ones inside Megatron's)."""
    if not imported():
        return data_parallel, None
    _refuse_wrappers(model, optimizers, ddp)
    _refuse_layers_and_configs(model)
    _tracker()  # refuses a tracker Leto cannot retain
    ps = sys.modules["megatron.core.parallel_state"]
    if not ps.model_parallel_is_initialized():
        return data_parallel, None
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        raise InvalidInput(
            f"leto.Run: Megatron's context parallelism (context parallel size {cp}) is not "
            "supported under Leto yet" + _NOTHING
        )
    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1 and dp > 1 and ddp is None:
        raise InvalidInput(
            f"leto.Run: Megatron's expert parallelism (expert parallel size {ep}) needs "
            "Megatron's DistributedDataParallel and optimizer under Leto: its expert buffers "
            "reduce the experts' gradients over the expert-data-parallel group, which Leto's "
            "own reduction does not" + _NOTHING
        )
    virtual = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if virtual != (len(ddp) if ddp else 1):
        raise InvalidInput(
            f"leto.Run: Megatron's interleaved pipeline schedule has {virtual} model chunks "
            f"a stage, and leto.Run was given {len(ddp) if ddp else 1}: give it the list of "
            "Megatron DistributedDataParallel objects, one a chunk (with Megatron's "
            "optimizer over them)" + _NOTHING
        )
    if pp > 1 and dp > 1 and ddp is None:
        raise InvalidInput(
            f"leto.Run: Megatron's pipeline schedule ({pp} stages) with {dp} data-parallel "
            "replicas needs Megatron's DistributedDataParallel and optimizer: the schedule "
            "runs the last micro-batch's forward under no_sync, so a reduction decided at "
            "forward time (torch's DDP, Leto's own) does not reduce in its backward, and "
            "the script would clip gradients no rank has reduced" + _NOTHING
        )
    if dp > 1 and not data_parallel:
        raise InvalidInput(
            f"leto.Run(data_parallel=False): Megatron's parallel state has {dp} data-parallel "
            "replicas, whose gradients must be reduced" + _NOTHING
        )
    if ep > 1:
        # Each rank's experts its own (replicas only over the expert-data-parallel
        # group): Megatron reduces them; the replica checks are off, as under the
        # DistributedOptimizer.
        return False, None
    if dp > 1 and tp * pp > 1:
        # The replicas: the ranks of this tensor-parallel position and pipeline stage.
        return True, DPGroup.of(ps.get_data_parallel_group())
    return dp > 1, None


def pipeline_stages() -> int | None:
    """Megatron's pipeline-parallel size (None: not a Megatron job, or its parallel state
    not initialized)."""
    ps = sys.modules.get("megatron.core.parallel_state") if imported() else None
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    return ps.get_pipeline_model_parallel_world_size()


def _refuse_wrappers(model: torch.nn.Module, optimizers: list, adopted=None) -> None:
    # (Megatron's DDP: ``adopt`` took it with its optimizer, or refused it already.)
    fp16 = sys.modules.get("megatron.core.transformer.module")
    if (
        adopted is None  # (Megatron's optimizer: its fp32 main copies are retained)
        and fp16 is not None
        and any(isinstance(m, fp16.Float16Module) for m in model.modules())
    ):
        raise InvalidInput(
            "leto.Run: Megatron's Float16Module (fp16/bf16 parameters with fp32 main "
            "parameters) is supported under Leto with Megatron's DistributedDataParallel and "
            "optimizer (get_megatron_optimizer: its fp32 main copies are retained) — "
            "otherwise keep float32 parameters and use torch.autocast" + _NOTHING
        )
    for opt in optimizers:
        kind = type(opt)
        where = kind.__module__
        if where.startswith("megatron."):
            raise InvalidInput(
                f"leto.Run: Megatron's optimizer {kind.__name__} ({where}) is not supported "
                "under Leto yet — give leto.Run a torch optimizer (torch.optim.AdamW)" + _NOTHING
            )
        if where.split(".")[0] in ("apex", "transformer_engine"):
            raise InvalidInput(
                f"leto.Run: the fused optimizer {kind.__name__} ({where}) is not supported — "
                "Leto's update reproduces torch's optimizers (torch.optim.AdamW(fused=True) "
                "is supported)" + _NOTHING
            )


def _refuse_layers_and_configs(model: torch.nn.Module) -> None:
    seen = set()
    for name, m in model.named_modules():
        where = type(m).__module__
        if where.split(".")[0] == "transformer_engine" or where.startswith(
            "megatron.core.extensions.transformer_engine"
        ):
            raise InvalidInput(
                f"leto.Run: {name or 'the model'} is a TransformerEngine layer "
                f"({type(m).__name__}): not supported under Leto yet — build the model with "
                "Megatron's local layer spec (get_gpt_layer_local_spec)" + _NOTHING
            )
        config = getattr(m, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "sequence_parallel"):
            continue
        seen.add(id(config))
        for flag in ("sequence_parallel", "fp8", "fp4"):
            if getattr(config, flag, None):
                raise InvalidInput(
                    f"leto.Run: Megatron's {flag} ({name or 'the model'}'s config) is not "
                    "supported under Leto yet" + _NOTHING
                )


def _tracker():
    """Megatron's RNG tracker, where it holds states Leto retains (None: no tracker)."""
    mod = sys.modules.get("megatron.core.tensor_parallel.random")
    if mod is None or not getattr(mod, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    tracker = mod._CUDA_RNG_STATE_TRACKER
    if type(tracker) is not mod.CudaRNGStatesTracker or tracker.use_cudagraphable_rng:
        raise InvalidInput(
            f"leto.Run: Megatron's RNG tracker is a {type(tracker).__name__}"
            f"{' (CUDA-graph safe)' if getattr(tracker, 'use_cudagraphable_rng', False) else ''}"
            ", whose states Leto cannot retain yet — use Megatron's own CudaRNGStatesTracker "
            "(model_parallel_cuda_manual_seed without te_rng_tracker or "
            "use_cudagraphable_rng)" + _NOTHING
        )
    return tracker if tracker.is_initialized() else None


def tracker_states() -> dict[str, bytes] | None:
    """The tracker's named generator states, as bytes (None: no tracker)."""
    tracker = _tracker()
    if tracker is None:
        return None
    return {name: s.cpu().numpy().tobytes() for name, s in tracker.get_states().items()}


def generators():
    """``(get, set)`` of the tracker's states, for what replays a forward (gradient
    replay); None where the script set up no tracker."""
    if not imported() or tracker_states() is None:
        return None
    return tracker_states, set_tracker_states


def set_tracker_states(states: dict[str, bytes]) -> None:
    tracker = _tracker()
    if tracker is None:
        raise InvalidInput(
            "a recovery has Megatron RNG tracker states, and this trainer's script set up "
            "no tracker before its loop (model_parallel_cuda_manual_seed)"
        )
    tracker.set_states(
        {name: torch.frombuffer(bytearray(raw), dtype=torch.uint8) for name, raw in states.items()}
    )


class Scheduler:
    """Megatron's ``OptimizerParamScheduler`` as ``leto.Run`` retains a torch LR
    scheduler: its state per iteration (``state_dict``/``load_state_dict``), its steps
    counted (``last_epoch``: one a iteration, checked) and one more replayed after a
    recovery finished an interrupted update (``step()``). Megatron-LM's steps count
    samples (``step(increment=global batch size)``): the replay takes the script's
    increment — the same every iteration (a batch-size ramp-up is refused when the
    increment changes), published in the store at its first step (``publish``) for a
    record made before it. The script keeps calling its own object's ``step``."""

    def __init__(self, scheduler, publish=None, published=None):
        self.scheduler = scheduler
        self.optimizer = scheduler.optimizer
        self.last_epoch = 0
        self.increment: int | None = None
        self._publish = publish or (lambda increment: None)
        self._published = published or (lambda: None)
        self._loading = False
        own = scheduler.step

        def step(increment: int) -> None:
            if not self._loading:
                if self.increment is None:
                    self._publish(increment)
                elif increment != self.increment:
                    raise InvalidInput(
                        f"Megatron's LR scheduler stepped by {increment} after {self.increment} "
                        "(a batch-size ramp-up): not supported under Leto yet — its steps "
                        "must be the same every iteration"
                    )
                self.last_epoch += 1
                self.increment = increment
            own(increment)

        scheduler.step = step

    def state_dict(self) -> dict:
        return {"megatron": self.scheduler.state_dict(), "increment": self.increment}

    def load_state_dict(self, state: dict) -> None:
        # Megatron's adds the saved step count to its own (a fresh one's: 0).
        self.scheduler.num_steps = 0
        self._loading = True
        try:
            self.scheduler.load_state_dict(state["megatron"])
        finally:
            self._loading = False
        self.increment = state["increment"]

    def step(self) -> None:
        increment = self.increment if self.increment is not None else self._published()
        if increment is None:
            raise FatalFailure(
                "a recovery must replay Megatron's LR scheduler's first step, and the "
                "increment the script gives it was never seen (the failure struck between "
                "the first update and the scheduler's first step): it cannot resume exactly"
            )
        self.scheduler.step(increment)


def schedulers(given: list, store=None, rank: int = 0) -> list:
    """The schedulers ``leto.Run`` retains: Megatron's ``OptimizerParamScheduler`` wrapped
    (``Scheduler``, its increment published in ``store``), torch's as they are."""
    if not imported():
        return given
    key = keys.scheduler_increment(rank)

    def publish(increment: int) -> None:
        if store is not None:
            store.set(key, str(int(increment)))

    def published() -> int | None:
        return int(store.get(key)) if store is not None and store.check([key]) else None

    return [
        Scheduler(sc, publish, published) if type(sc).__name__ == "OptimizerParamScheduler" else sc
        for sc in given
    ]
