"""Several ranks on one GPU (``leto run --ranks-per-gpu N``, a testing option): what the
gloo process group carries for CUDA tensors, what it does not, and the refusal of a
parallelism that needs what it lacks, before anything starts.

Runs wherever a refusal is due: in faultkit (``check_job``, before its reference run) and
in a trainer's ``leto.Run`` (a pipeline stage, before its first iteration). NCCL refuses
two ranks on one GPU, so ranks sharing one talk over gloo. Gloo copies a CUDA tensor
through pinned host memory for all-reduce (SUM, AVG as SUM then a division, MIN, MAX,
PRODUCT), broadcast, reduce, all-gather (a list, or into one tensor), gather, scatter,
all-to-all into one tensor (``all_to_all_single``) and reduce-scatter (into one tensor, or
the list form): what data parallelism, ZeRO-1, FSDP2, tensor and expert parallelism use.
It has no such copy for point-to-point messages (the sender dies: "writev ... Bad
address"), for the coalesced forms, or for the list form of all-to-all, and no PREMUL_SUM
on any device (``LACKS``). Checked on an H200 with torch 2.11 (2026-12-03,
``python -m bench.gloo_cuda``, which runs every collective named here and says where this
table is wrong): as stated.

Not covered: a collective a user's own script calls that no entry names fails at its
first call, with gloo's message; the speed of any of it (every CUDA collective makes a
round trip through host memory and TCP).
"""

from __future__ import annotations

# The collectives gloo does not carry for CUDA tensors: name -> why.
LACKS = {
    "send/recv": "gloo hands the tensor's address to its TCP transport as is, with no copy "
    "through host memory for a CUDA tensor",
    "PREMUL_SUM": "a reduction scaled by a factor is no gloo reduction op, on any device",
    "all_reduce_coalesced": "gloo's coalesced all-reduce takes CPU tensors only",
    "all_gather_into_tensor_coalesced": "gloo's coalesced all-gather has no copy through host "
    "memory for CUDA tensors",
    "all_to_all": "the list form (all_to_all_single, one tensor, is carried)",
}
# Parallelisms (faultkit's --parallel names, and Megatron's layouts) that need one of
# them: -> (what it is, the collective it needs, why).
NEEDS = {
    "pp": (
        "pipeline parallelism (torch.distributed.pipelining, leto.Run(data_parallel=False))",
        "send/recv",
        "it sends activations and gradients between stages",
    ),
    "megatron-pp": (
        "Megatron's pipeline schedule (pipeline-parallel size above 1)",
        "send/recv",
        "it sends activations and gradients between stages",
    ),
    "megatron-ddp": (
        "Megatron's DistributedDataParallel",
        "all_reduce_coalesced",
        "its buckets are reduced (and, under its DistributedOptimizer, gathered) coalesced",
    ),
    "titan": (
        "torchtitan (FSDP2 with its gradient divide factor)",
        "PREMUL_SUM",
        "its reduce-scatter scales the gradients by the factor",
    ),
}


def refusal(parallel: str) -> str | None:
    """Why ``parallel`` cannot run with ranks sharing a GPU over gloo (the parallelism and
    the collective named, what to do instead; the caller says what was kept), or None
    when nothing it needs is missing."""
    if parallel not in NEEDS:
        return None
    what, collective, why = NEEDS[parallel]
    return (
        f"{what} cannot run with ranks sharing a GPU (--ranks-per-gpu > 1: gloo on CUDA): "
        f"{why} with {collective}, and {LACKS[collective]}; give each rank its own GPU "
        f"(NCCL) or run on the CPU"
    )


def gloo_on_cuda(device, backend: str | None) -> bool:
    """True when this trainer's tensors are on a GPU and its process group is gloo (ranks
    sharing GPUs)."""
    return getattr(device, "type", device) == "cuda" and backend == "gloo"
