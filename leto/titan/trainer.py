"""``LetoTrainer``: torchtitan's ``Trainer`` (0.2.x) with its training state retained
by Leto and recovered in place. It changes three things and no arithmetic:

* the process group is ``leto.init()``'s (torchtitan's ``init_distributed`` finds it
  made and keeps it), so a shadow trainer parks, pre-initialized, before torchtitan
  builds anything;
* after torchtitan has built and parallelized the model, its optimizers, schedulers,
  data loader and checkpointer, ``leto.Run`` retains the model part, the inner AdamW
  and LambdaLR of torchtitan's containers and the data loader's position;
  torchtitan's own checkpoint, when one is enabled and present, is loaded first — Leto
  retains what it loaded (it refuses a load after) and a recovery starts from Leto's
  state instead;
* ``train()`` is torchtitan's loop over ``run.iterations()``: ``train_step``, the
  checkpoint save, the validation and the profiler as torchtitan runs them, the step
  counter set from the iteration (a recovered trainer resumes at the first unfinished
  one), each iteration's loss given to ``run.record_loss`` before the update (the sum
  of its micro-batches' losses, as torchtitan logs it) and ``ntokens_seen`` kept in
  ``run.state``.

What Leto cannot retain exactly is refused before the process group is made
(``refusals``), naming the flag."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import MODEL, ModelWrapper
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.train import Trainer

import leto
from leto.errors import InvalidInput
from leto.trainer import shared_gpu


def refusals(job_config: JobConfig) -> list[str]:
    """What this job asks of torchtitan that Leto cannot retain exactly, one line each
    naming the flag; empty when it can run."""
    par, out = job_config.parallelism, []
    if par.pipeline_parallel_degree > 1:
        out.append(
            "pipeline parallelism (--parallelism.pipeline_parallel_degree "
            f"{par.pipeline_parallel_degree}): torchtitan's schedules step several model "
            "parts, Leto retains one"
        )
    if par.data_parallel_replicate_degree > 1:
        out.append(
            "replicated data parallelism (--parallelism.data_parallel_replicate_degree "
            f"{par.data_parallel_replicate_degree}): torchtitan's replicate() reduces the "
            "gradients Leto reduces; shard instead (--parallelism.data_parallel_shard_degree)"
        )
    if job_config.training.enable_cpu_offload:
        out.append("--training.enable_cpu_offload: Leto retains the state in device memory")
    if job_config.model.converters:
        out.append(
            f"model converters {job_config.model.converters} (--model.converters: float8 "
            "and MX keep scales beside the weights that Leto does not retain)"
        )
    if job_config.optimizer.early_step_in_backward:
        out.append(
            "--optimizer.early_step_in_backward: the update runs inside backward, Leto's "
            "crash-consistent update after it"
        )
    if job_config.optimizer.name not in ("Adam", "AdamW"):
        out.append(f"--optimizer.name {job_config.optimizer.name}")
    ft = getattr(job_config, "fault_tolerance", None)
    if ft is not None and getattr(ft, "enable", False):
        out.append("--fault_tolerance.enable (torchft): one fault-tolerance runtime a job")
    return out


def shared_gpu_refusal(device, backend: str | None) -> str | None:
    """Why torchtitan cannot run in this trainer's process group: ranks sharing a GPU
    (``leto run --ranks-per-gpu``, gloo on CUDA) lack the PREMUL_SUM its FSDP2 gradient
    reduce-scatter uses; None where it can."""
    if not shared_gpu.gloo_on_cuda(device, backend):
        return None
    return f"torchtitan under Leto: {shared_gpu.refusal('titan')}. Nothing was retained."


class LetoTrainer(Trainer):
    def __init__(self, job_config: JobConfig):
        bad = refusals(job_config)
        if bad:
            raise InvalidInput(
                "torchtitan under Leto cannot run this job exactly: "
                + "; ".join(bad)
                + ". Nothing was started."
            )
        # Before torchtitan's init_distributed (which finds the group made and keeps
        # it): a shadow trainer parks in here, torchtitan imported, until promoted.
        ctx = leto.init()
        # Before torchtitan builds anything: its first backward would stop on the
        # collective gloo lacks, deep in FSDP2.
        why = shared_gpu_refusal(ctx.device, dist.get_backend() if dist.is_initialized() else None)
        if why is not None:
            raise InvalidInput(why)
        super().__init__(job_config)
        # torchtitan's checkpoint (--checkpoint.enable), loaded where its train() would
        # load it but before leto.Run: a fresh job retains what it loaded; a recovery
        # or Leto's fallback overwrites it with Leto's own state.
        self.checkpointer.load(step=job_config.checkpoint.load_step)
        self._losses: list[torch.Tensor] = []
        self.run = leto.Run(
            ctx,
            self.model_parts[0],
            list(self.optimizers.optimizers),
            list(self.lr_schedulers.schedulers),
            start_iteration=self.step,
            data=self.dataloader,
        )
        self.ntokens_seen = self.run.state.get("ntokens_seen", self.ntokens_seen)
        # torchtitan's checkpointer keeps the model's state dict from when it was made
        # (as after its own loads, it is made again): its tensors are now Leto's.
        if MODEL in self.checkpointer.states:
            self.checkpointer.states[MODEL] = ModelWrapper(self.model_parts)
        container_step = self.optimizers.step

        def step(*args, **kwargs):
            # The iteration's loss and token count, recorded with its update.
            self.run.record_loss(torch.sum(torch.stack(self._losses)))
            self._losses = []
            self.run.state = {"ntokens_seen": self.ntokens_seen}
            container_step(*args, **kwargs)

        self.optimizers.step = step

    def forward_backward_step(self, *args, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(*args, **kwargs)
        self._losses.append(loss.detach())
        return loss

    def train(self) -> None:
        job_config = self.job_config
        first = True
        with (
            maybe_enable_profiling(
                job_config.profiling, global_step=self.step, base_folder=job_config.job.dump_folder
            ) as torch_profiler,
            maybe_enable_memory_snapshot(
                job_config.profiling, global_step=self.step, base_folder=job_config.job.dump_folder
            ) as memory_profiler,
        ):
            # After leto.Run: a recovered trainer's loader has its position back.
            data_iterator = self.batch_generator(self.dataloader)
            for it in self.run.iterations(job_config.training.steps):
                self.step = it + 1
                if first:
                    logger.info(f"Training starts at step {self.step} (under Leto)")
                self.gc_handler.run(self.step)
                try:
                    self.train_step(data_iterator)
                except DataloaderExhaustedError:
                    logger.warning("Ran out of data; last step was canceled.")
                    break
                self.checkpointer.save(
                    self.step, last_step=(self.step == job_config.training.steps)
                )
                if job_config.validation.enable and self.validator.should_validate(self.step):
                    self.validator.validate(self.model_parts, self.step)
                if torch_profiler:
                    torch_profiler.step()
                if memory_profiler:
                    memory_profiler.step()
                if first:  # torchtitan's shorter timeout once the first step has run
                    dist_utils.set_pg_timeouts(
                        timeout=timedelta(seconds=job_config.comm.train_timeout_seconds),
                        parallel_dims=self.parallel_dims,
                    )
                    first = False
        logger.info("Training completed")
