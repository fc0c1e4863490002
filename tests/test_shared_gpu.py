"""Ranks sharing a GPU over gloo (``leto run --ranks-per-gpu``, issue 47): the
parallelisms that need a collective gloo does not carry for CUDA tensors are refused
before anything is retained, naming the parallelism and the collective
(``leto.trainer.shared_gpu``). Unit tests, no process group: the GPU side is
``python -m bench.gloo_cuda`` and ``bash bench/gpu_suite.sh world2-parallel``."""

from __future__ import annotations

import types

import pytest
import torch

from leto.errors import InvalidInput
from leto.trainer import run as run_module
from leto.trainer import shared_gpu


def test_a_refusal_names_the_parallelism_and_the_missing_collective():
    for parallel, words in (("pp", ("pipeline parallelism", "send/recv")),
                            ("titan", ("torchtitan", "PREMUL_SUM"))):  # fmt: skip
        why = shared_gpu.refusal(parallel)
        assert why is not None and all(w in why for w in words), why
        assert "own GPU" in why, why  # and what to do instead
    for carried in ("dp", "fsdp", "tp", "ep", "ep+fsdp", "fsdp+tp", "dp-loader"):
        assert shared_gpu.refusal(carried) is None, carried
    assert shared_gpu.gloo_on_cuda(torch.device("cuda", 0), "gloo")
    assert not shared_gpu.gloo_on_cuda(torch.device("cuda", 0), "nccl")
    assert not shared_gpu.gloo_on_cuda(torch.device("cpu"), "gloo")


def test_a_pipeline_stage_on_a_shared_gpu_is_refused_before_anything_is_retained(monkeypatch):
    # leto.Run(data_parallel=False) is a pipeline stage: on CUDA over gloo its first send
    # would hand gloo a device address. Refused first, before the pool is touched (the
    # context has none). Data-parallel jobs pass this check.
    monkeypatch.setattr(run_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(run_module.dist, "get_backend", lambda *a: "gloo")
    ctx = types.SimpleNamespace(device=torch.device("cuda", 0), world_size=2)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidInput, match=r"data_parallel=False.*send/recv.*nothing was retained"):
        run_module.Run(ctx, model, opt, data_parallel=False)
    monkeypatch.setattr(run_module.dist, "get_backend", lambda *a: "nccl")
    with pytest.raises(Exception) as past:  # past the check: the stand-in context is bare
        run_module.Run(ctx, model, opt, data_parallel=False)
    assert "send/recv" not in str(past.value), past.value


def test_megatron_shards_on_a_shared_gpu_pass_and_its_pipeline_and_ddp_are_refused(monkeypatch):
    # Megatron's tensor parallelism (torch's DDP path) makes leto.Run treat the ranks as
    # unreplicated without a pipeline: gloo carries its collectives, so it passes;
    # Megatron's pipeline schedule sends between stages, and Megatron's DDP reduces
    # coalesced: both refused by name, before anything is retained.
    from leto.trainer import megatron

    monkeypatch.setattr(run_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(run_module.dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(megatron, "check", lambda *a: (False, None))  # (its shards)
    ctx = types.SimpleNamespace(device=torch.device("cuda", 0), world_size=2)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(megatron, "pipeline_stages", lambda: 1)
    with pytest.raises(Exception) as past:  # past the check: the stand-in context is bare
        run_module.Run(ctx, model, opt)
    assert "sharing a GPU" not in str(past.value), past.value
    monkeypatch.setattr(megatron, "pipeline_stages", lambda: 2)
    with pytest.raises(InvalidInput, match=r"Megatron's pipeline schedule .*send/recv.*nothing"):
        run_module.Run(ctx, model, opt)
    monkeypatch.setattr(megatron, "pipeline_stages", lambda: 1)
    monkeypatch.setattr(megatron, "adopt", lambda m, o: (o, [object()]))  # Megatron's DDP
    with pytest.raises(InvalidInput, match=r"Megatron's DistributedDataParallel .*coalesced"):
        run_module.Run(ctx, model, opt)


def test_the_gpu_probe_tries_every_collective_the_table_names():
    # python -m bench.gloo_cuda runs them on a GPU (gpu_suite world2-parallel); here only
    # that nothing in the table goes untried.
    from bench.gloo_cuda import PROBES

    assert set(shared_gpu.LACKS) <= set(PROBES), set(shared_gpu.LACKS) - set(PROBES)
    for _, collective, _ in shared_gpu.NEEDS.values():
        assert collective in shared_gpu.LACKS, collective
