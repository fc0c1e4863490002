"""Parallelized models under Leto (FSDP2, tensor parallel, FSDP2 x TP, pipeline
stages): each rank retains its own shards or stage.

Two gloo ranks in spawned processes, each with its own state manager: after binding,
FSDP2's padded shard (what it all-gathers from), the parameters' local tensors and the
gradients its reduce-scatter writes are all retained pool memory, and a backward gives
the retained gradient the same bytes as the same model sharded without Leto. Layouts
Leto cannot retain are refused by name. End to end (``leto run``): the parallel example
under Leto is bit-identical to the same script under torchrun — FSDP2 and TP on two
ranks, FSDP2 x TP on four, pipeline stages on two and four (GPipe, 1F1B) — also after a rank
is killed (in the optimizer step, or mid-schedule) with parameter, moment, gradient and
host-parity pages lost on every rank; so is the mixture-of-experts example (experts
sharded by rank, all-to-all dispatch, the rest data parallel or FSDP2) on two ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest
import torch

from faultkit.job import JobFault, run_job
from leto.job.store import free_port
from leto.memory.launch import start_state_manager
from leto.workload.train import TrainConfig
from tests import torchrun_reference
from tests.pool_helpers import small_config

SPAWN = mp.get_context("spawn")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "parallel"


def _model():
    torch.manual_seed(0)
    # 7 and 5 rows: FSDP2 pads rank 1's shard of each.
    return torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh()
    )


def _shard(model, mesh, **kw):
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _ptr_in(t: torch.Tensor, base: torch.Tensor) -> bool:
    lo = base.data_ptr()
    return lo <= t.data_ptr() < lo + base.numel() * base.element_size()


def _rank(rank: int, port: int, sockets: list, q) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        from leto.errors import InvalidInput
        from leto.memory.client import PoolClient
        from leto.update.layout import RetainedModel

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        client = PoolClient.connect(*sockets[rank])
        leto_model, plain = _shard(_model(), mesh), _shard(_model(), mesh)
        originals = {n: p.to_local().clone() for n, p in leto_model.named_parameters()}
        state = RetainedModel(client, leto_model)
        params = state.bind(leto_model)
        with torch.no_grad():
            for n, p in params.items():
                p.to_local().copy_(originals[n])
        out = {"padded": 0}
        for mod in (leto_model[0], leto_model[2]):
            for fp in mod._get_fsdp_state()._fsdp_param_group.fsdp_params:
                local = fp.sharded_param.to_local()
                assert _ptr_in(fp._sharded_param_data, state.flat["param"])
                assert fp._sharded_param_data.data_ptr() == local.data_ptr()
                assert _ptr_in(fp.sharded_param.grad.to_local(), state.grad)
                pad = fp._sharded_param_data[local.numel() :]
                out["padded"] += pad.numel()
                assert int(pad.count_nonzero()) == 0
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        for m in (leto_model, plain):
            m(x).square().sum().backward()
        for (n, p), (_, q_) in zip(
            leto_model.named_parameters(), plain.named_parameters(), strict=True
        ):
            assert _ptr_in(p.grad.to_local(), state.grad), n
            assert torch.equal(p.grad.to_local(), q_.grad.to_local()), n
            assert torch.equal(p.to_local(), q_.to_local()), n
        assert int(state.grad.count_nonzero()) > 0
        # Layouts Leto cannot retain are refused by name, before anything is bound.
        refusals = []
        partly = _model()
        fully_shard(partly[0], mesh=mesh)  # the second layer stays replicated
        even = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4), torch.nn.Tanh()
        )  # columns split evenly: FSDP2 shards them on dim 1
        cols = _shard(even, mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
        # Tensor parallel over a size-1 "tp" dimension of a (2, 1) mesh, no FSDP2: the
        # other rank is a data-parallel replica Leto would have to reduce with.
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        tp_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["tp"]
        beside_dp = parallelize_module(_model(), tp_mesh, {"0": ColwiseParallel()})
        # HSDP: FSDP2 on a (replicate, shard) mesh.
        hsdp = _shard(_model(), init_device_mesh("cpu", (2, 1), mesh_dim_names=("r", "s")))
        for bad in (partly, cols, beside_dp, hsdp):
            try:
                RetainedModel(client, bad)
            except InvalidInput as e:
                refusals.append(str(e))
        out["refusals"] = refusals
        client.close()
        dist.destroy_process_group()
        q.put((rank, out))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, traceback.format_exc()))


@pytest.mark.integ
def test_fsdp2_shards_params_and_reduce_scattered_grads_live_in_retained_memory():
    sms = [start_state_manager(small_config()) for _ in range(2)]
    try:
        q = SPAWN.Queue()
        port = free_port()
        socks = [(str(sm.socket_path), sm.token) for sm in sms]
        procs = [SPAWN.Process(target=_rank, args=(r, port, socks, q)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        for sm in sms:
            sm.stop()
    for r in range(2):
        assert isinstance(got[r], dict), got[r]
    assert got[0]["padded"] == 0 and got[1]["padded"] > 0  # rank 1's shards carry padding
    for r in range(2):
        unsharded, cols, beside_dp, hsdp = got[r]["refusals"]
        assert "0.weight is on an HSDP mesh (replicate x shard)" in hsdp
        assert "0.weight is tensor-parallel over 1 of 2 ranks" in beside_dp
        assert "parameter 2.weight is not sharded by fully_shard" in unsharded
        assert "0.weight is sharded on dim 1; Leto retains Shard(0) shards only" in cols


def test_the_moe_port_changes_no_more_lines_than_the_fsdp2_port():
    from tests.test_porting import changed_lines

    fsdp = changed_lines(EXAMPLES / "gpt_parallel.py", EXAMPLES / "gpt_parallel_leto.py")
    moe = changed_lines(EXAMPLES / "gpt_moe.py", EXAMPLES / "gpt_moe_leto.py")
    assert 0 < moe <= fsdp <= 7, f"the MoE port changes {moe} lines, the FSDP2 port {fsdp}"


def _params(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.params.pt", map_location="cpu") for r in range(world)]


# (job, flags, world size, the fault, the rank it kills): FSDP2 and TP on two ranks,
# FSDP2 x TP on four, pipeline stages under GPipe (killed in the forward of the third
# micro-batch: mid-schedule) and 1F1B (in the optimizer step; on four stages, a middle
# one in its second micro-batch).
CASES = {
    "fsdp": ("gpt_parallel", ["--tp", "1"], 2, "update.optimizer@2#1", 1),
    "tp": ("gpt_parallel", ["--tp", "2"], 2, "update.optimizer@2#1", 1),
    "fsdp+tp": ("gpt_parallel", ["--tp", "2"], 4, "update.optimizer@2#1", 3),
    "pp-gpipe": ("gpt_pipeline", ["--schedule", "gpipe"], 2, "compute.forward@2#3", 1),
    "pp-1f1b": ("gpt_pipeline", ["--schedule", "1f1b"], 2, "update.optimizer@2#1", 0),
    "pp-4-stages": ("gpt_pipeline", ["--schedule", "1f1b"], 4, "compute.backward@2#2", 2),
    # A mixture of experts: experts sharded by rank, all-to-all dispatch, the rest data
    # parallel (the experts' gradients and moments are on one rank only: parity alone).
    "ep": ("gpt_moe", [], 2, "update.optimizer@2#1", 1),
    # The same with FSDP2 over the rest (the experts DTensors outside it), killed between
    # the forward (its all-to-alls done) and the backward.
    "ep+fsdp": ("gpt_moe", ["--fsdp"], 2, "compute.backward@2#1", 0),
}


@pytest.mark.integ
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_the_parallel_examples_under_leto_are_bit_identical_to_torchrun_after_a_fault_with_lost_pages(
    tmp_path, case
):
    script, flags, world, at, rank = CASES[case]
    plain = tmp_path / "plain"
    args = ["--iterations", "4", *flags]
    plains = [plain, tmp_path / "plain-again", tmp_path / "plain-third"]
    plain = plains[torchrun_reference.run(
        f"{script}.py",
        lambda a: ["--standalone", "--nproc-per-node", str(world), str(EXAMPLES / f"{script}.py"),
                   *args, "--out", str(plains[a])],
        timeout=180, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )]  # fmt: skip
    # Parameter and moment pages, a host parity page and a gradient page (a sharded or
    # per-stage gradient: not replicated anywhere, only its parity protects it) lost on
    # every rank while the job is fenced.
    lose = (("data", "param", (0, 3)), ("data", "exp_avg", (1, 2)), ("tier1", 1, (0,)),
            ("data", "grad", (1,)))  # fmt: skip
    out = tmp_path / "leto"
    got = run_job(
        world, TrainConfig(), out, [JobFault(rank, at, inject=lose)],
        shadow_level="L2", script=EXAMPLES / f"{script}_leto.py",
        script_args=[*args, "--out", str(out / "train")], timeout_s=300,
    )  # fmt: skip
    assert got["injections"] == 1 and got["recoveries"][0]["pages_lost"]["device"] > 0, got
    first, leto = _params(plain, world), _params(out / "train", world)
    for r in range(world):
        assert first[r].keys() == leto[r].keys()
        for k in first[r]:
            a, b = first[r][k].contiguous(), leto[r][k].contiguous()
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"rank {r}: {k}"
    # Training moved the weights (a run that trained nothing would also "match").
    key = "blocks.0.moe.experts.w1" if script == "gpt_moe" else "blocks.0.fc.weight"
    before = (_moe_initial(world) if script == "gpt_moe" else
              _initial(4 if script == "gpt_pipeline" else 2))[key]  # fmt: skip
    after = leto[0][key]
    assert not torch.equal(after, before[: after.shape[0], : after.shape[1]])


def _moe_initial(world: int) -> dict[str, torch.Tensor]:
    """Rank 0's initial parameters of the mixture-of-experts example."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_moe", EXAMPLES / "gpt_moe.py")
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    torch.manual_seed(0)
    m = moe.MoEGPT(0, world, None)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _initial(layers: int) -> dict[str, torch.Tensor]:
    from leto.workload.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab=257, block=32, n_layer=layers, n_head=2, n_embd=64, dropout=0.0))
    return {n: p.detach().clone() for n, p in m.named_parameters()}
