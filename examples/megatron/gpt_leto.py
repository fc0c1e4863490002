"""``gpt_torchrun.py`` ported to Leto as docs/porting.md says ("Megatron-Core"):
``leto.init()`` where the script made its process group, ``leto.Run`` where it wrapped
the model in DDP (over Megatron's data-parallel group: Leto reads Megatron's parallel
state), ``run.iterations`` and ``run.record_loss``. Megatron's parallel state, model,
RNG tracker (retained by Leto), schedule, gradient norm and clipping are as they were.

    leto run --nproc-per-node 2 examples/megatron/gpt_leto.py --tp 2 --out out

The same ``iterations.jsonl`` and ``rank{r}.params.pt`` as the torchrun script.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

CUDA = torch.cuda.is_available()
if not CUDA:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cpu  # noqa: F401 - Megatron-Core on the CPU (an emulation)

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as MegatronDDP  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer.clip_grads import (  # noqa: E402
    clip_grad_by_total_norm_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate  # noqa: E402
from megatron.core.transformer.module import Float16Module, param_is_not_shared  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import leto  # noqa: E402


def tokens(dp_rank: int, it: int, micro: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1_000_003 * it + 1_009 * dp_rank + micro)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the rest: data)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    ap.add_argument(
        "--vpp", type=int, default=1,
        help="model chunks a stage (Megatron's interleaved schedule; with --megatron-ddp)",
    )
    ap.add_argument("--experts", type=int, default=0, help="a mixture of experts (0: dense)")
    ap.add_argument(
        "--freeze-embedding", action="store_true",
        help="train with the position embedding frozen (as a fine-tuning run)",
    )
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    ap.add_argument(
        "--expert-bias",
        action="store_true",
        help="with --experts: load balancing by the routers' expert bias (DeepSeek-V3's, "
        "sigmoid scores) instead of the auxiliary loss",
    )
    ap.add_argument(
        "--untie-embeddings-and-output-weights", action="store_true",
        help="an output layer of its own (Megatron-LM's flag; tied by default, as there)",
    )
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per iteration")
    ap.add_argument("--iterations", type=int, default=8, help="optimizer steps")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    ap.add_argument("--seed", type=int, default=1234, help="Megatron's seed")
    ap.add_argument(
        "--megatron-ddp",
        action="store_true",
        help="Megatron's own DistributedDataParallel (overlapped bucketed reduction) and "
        "optimizer (get_megatron_optimizer: its norm and clipping inside step())",
    )
    ap.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="with --megatron-ddp: Megatron's DistributedOptimizer (fp32 main shards, the "
        "parameters all-gathered after each step)",
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="with --megatron-ddp: bf16 parameters (Megatron's Float16Module; fp32 main copies)",
    )
    ap.add_argument(
        "--fp16",
        action="store_true",
        help="with --megatron-ddp: fp16 parameters and Megatron's dynamic loss scaler (an "
        "iteration with inf/NaN gradients skips its update)",
    )
    ap.add_argument(
        "--initial-loss-scale", type=float, default=2.0**16, help="with --fp16: the first scale"
    )
    ap.add_argument(
        "--loss-scale-window", type=int, default=1000, help="with --fp16: updates between growths"
    )
    ap.add_argument("--out", default="out", help="iterations.jsonl and parameters")
    args = ap.parse_args()
    if (args.bf16 or args.fp16) and not args.megatron_ddp or args.bf16 and args.fp16:
        ap.error("--bf16 or --fp16 (one of them) takes --megatron-ddp")
    half = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    if (args.vpp > 1 or args.ep > 1) and not args.megatron_ddp:
        ap.error("--vpp and --ep take --megatron-ddp (a DDP object a chunk; expert buffers)")
    vpp = args.vpp if args.vpp > 1 else None
    ctx = leto.init()
    rank, device = dist.get_rank(), torch.device("cuda" if CUDA else "cpu")
    if CUDA:
        # Testing on fewer GPUs (docs/runtime.md): LETO_RANKS_PER_GPU=N puts local ranks
        # N*g..N*g+N-1 on GPU g; leto run --ranks-per-gpu sets it.
        per_gpu = int(os.environ.get("LETO_RANKS_PER_GPU", "1"))
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) // per_gpu)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep, virtual_pipeline_model_parallel_size=vpp,
    )
    if args.pp > 1 and parallel_state.get_data_parallel_world_size() > 1 and not args.megatron_ddp:
        # torch's DDP decides to reduce at forward time, and the schedule runs the last
        # micro-batch's forward under no_sync: it would never reduce.
        ap.error("--pp with data-parallel replicas takes --megatron-ddp")
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # the RNG tracker
    torch.manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=True,
        bf16=args.bf16, fp16=args.fp16, params_dtype=half or torch.float32,
        pipeline_dtype=half or torch.float32,
        num_moe_experts=args.experts or None, moe_router_topk=2,
        moe_aux_loss_coeff=0.0 if args.expert_bias else 1e-2,
        moe_router_enable_expert_bias=args.expert_bias, moe_router_bias_update_rate=1e-2,
        moe_router_score_function="sigmoid" if args.expert_bias else "softmax",
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        add_bias_linear=not args.experts,  # (MoE models have none: OLMoE, Mixtral)
        virtual_pipeline_model_parallel_size=vpp,
        microbatch_group_size_per_vp_stage=args.pp if vpp else None,
    )  # fmt: skip

    def gpt(vp):  # a model chunk (vp: its place among this stage's, interleaved)
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.experts or None),
            vocab_size=args.vocab, max_sequence_length=args.seq,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
        ).to(device)  # fmt: skip

    model = gpt(None) if vpp is None else [gpt(vp) for vp in range(vpp)]
    for name, p in (model if vpp else [model])[0].named_parameters():
        if args.freeze_embedding and name == "embedding.position_embeddings.weight":
            p.requires_grad_(False)
    if args.megatron_ddp:  # Megatron's way: its DDP's buffers, its optimizer over them
        sharded = args.distributed_optimizer
        chunks = model if vpp else [model]
        if half is not None:
            chunks = [Float16Module(config, c) for c in chunks]
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=True, bucket_size=20_000, use_distributed_optimizer=sharded,
            grad_reduce_in_fp32=half is not None,
        )  # fmt: skip
        chunks = [
            MegatronDDP(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)
        ]  # fmt: skip
        model = chunks if vpp else chunks[0]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta1=0.9,
                adam_beta2=0.95, clip_grad=args.clip, use_distributed_optimizer=sharded,
                bf16=args.bf16, fp16=args.fp16, initial_loss_scale=args.initial_loss_scale,
                loss_scale_window=args.loss_scale_window,
            ),
            chunks,
        )  # fmt: skip
        config.grad_scale_func = optimizer.scale_loss  # (fp16: Megatron-LM's loss scaling)
        # Megatron-LM's schedule: its steps count samples.
        samples = args.micro_batch * args.micro_batches * parallel_state.get_data_parallel_world_size()
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=3 * samples,
            lr_decay_steps=args.iterations * samples, lr_decay_style="cosine", start_wd=0.1,
            end_wd=0.1, wd_incr_steps=args.iterations * samples, wd_incr_style="constant",
        )  # fmt: skip
    else:
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=3e-3, betas=(0.9, 0.95),
        )  # fmt: skip
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 3))
    run = leto.Run(ctx, model, optimizer, scheduler)
    model = run.model
    each = model if vpp else [model]  # the model chunks Megatron's schedule takes
    if vpp:  # (the interleaved schedule: one a chunk)
        config.no_sync_func = [c.no_sync for c in each]
    else:
        config.no_sync_func = model.no_sync if hasattr(model, "no_sync") else None
    dp_rank = parallel_state.get_data_parallel_rank()
    # The log's writer: the last stage's first rank (rank 0 without pipelines).
    writer = parallel_state.is_pipeline_last_stage() and dp_rank == 0 and (
        parallel_state.get_tensor_model_parallel_rank() == 0
    )
    position_ids = torch.arange(args.seq, device=device).unsqueeze(0)
    forward_backward = get_forward_backward_func()
    os.makedirs(args.out, exist_ok=True)

    def forward_step(batches, model):
        batch = next(batches).to(device)
        out = model(batch[:, :-1], position_ids, None, labels=batch[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    t_end = time.perf_counter()
    for it in run.iterations(args.iterations):
        if args.megatron_ddp:
            for c in each:  # Megatron's gradient buffers, zeroed as Megatron-LM does
                c.zero_grad_buffer()
        batches = [
            tokens(dp_rank, it, m, args.micro_batch, args.seq, args.vocab)
            for m in range(args.micro_batches)
        ]  # fmt: skip
        got = forward_backward(
            forward_step_func=forward_step, model=each,
            data_iterator=[iter(batches) for _ in each] if vpp else iter(batches),
            num_microbatches=args.micro_batches, seq_length=args.seq,
            micro_batch_size=args.micro_batch, forward_only=False,
        )  # fmt: skip
        # (the last pipeline stage's: the others compute no loss)
        loss = torch.stack([g["loss"] for g in got]).mean() if got else torch.zeros(())
        if args.megatron_ddp:
            # Megatron-LM's: the data-parallel reduction, then the tied embedding's
            # gradient summed over the first and last pipeline stages.
            finalize_model_grads(each)
        else:
            # The tied embedding's two copies (first and last stage): their gradients
            # summed, as Megatron-LM's finalize_model_grads does.
            gpt = getattr(model, "module", model)
            tied = gpt.shared_embedding_or_output_weight()
            if args.pp > 1 and gpt.share_embeddings_and_output_weights and tied is not None:
                dist.all_reduce(tied.grad, group=parallel_state.get_embedding_group())
            # Megatron's norm: every gradient once across the model-parallel group.
            params = list(model.parameters())
            grads = [
                p.grad for p in params
                if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
            ]  # fmt: skip
            norm = get_grad_norm_fp32(
                grads, grad_stats_parallel_group=parallel_state.get_model_parallel_group()
            )
            clip_grad_by_total_norm_fp32(params, args.clip, norm)
        run.record_loss(loss)
        if args.megatron_ddp:
            # Megatron's norm and clipping, then the update — none where the loss scaler
            # found inf/NaN (fp16): Megatron-LM steps its scheduler after an update only.
            updated, norm, _ = optimizer.step()
            if updated:
                scheduler.step(increment=samples)
        else:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if writer:
            line = {"iteration": it, "loss": loss.item(), "grad_norm": norm}  # (waits)
            # When it ended, and how long it took (bench.user_path's figures).
            t_prev, t_end = t_end, time.perf_counter()
            line.update(wall_s=t_end - t_prev, done_at=time.time())
            with open(os.path.join(args.out, "iterations.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")
    saved = {}
    for i, c in enumerate(each):
        unwrapped, where = getattr(c, "module", c), f"chunk{i}." if vpp else ""
        saved.update({
            where + k: v.detach().cpu() for k, v in unwrapped.state_dict().items()
            if v is not None and torch.is_tensor(v)
        })  # fmt: skip
    torch.save(saved, os.path.join(args.out, f"rank{rank}.params.pt"))


if __name__ == "__main__":
    main()
