"""karpathy/nanoGPT's own ``train.py`` and ``model.py`` (``examples/porting/nanogpt``,
vendored with only its CPU edits) and their Leto port: the port changes at most 9
lines, and keeps nanoGPT's micro-step loop as written — its
``model.require_backward_grad_sync`` toggle skips the reduction of every micro-step
but the last, as under DDP — and its data path: ``run.batches(get_batch)`` retains its
prefetch. A tiny config on synthetic tokens, two gloo ranks, ``leto run``'s default
shadow level, a rank killed in iteration 2's second micro-batch with pages lost: the
checkpoint nanoGPT saves (model and AdamW state after the last evaluation) is
byte-identical under torchrun + DDP and under ``leto run``. nanoGPT records no loss for
Leto, so the ``--verify`` run's trainers each say so once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from faultkit.job import JobFault, run_job
from leto.memory.config import PoolConfig
from leto.workload.train import TrainConfig
from tests import torchrun_reference
from tests.test_porting import changed_lines

HERE = Path(__file__).resolve().parents[1] / "examples" / "porting" / "nanogpt"
FILES = ("train.py", "train_leto.py", "model.py", "configurator.py")
VOCAB = 64
# 4 micro-steps over 2 ranks: 2 per rank, the first one's reduction skipped by the toggle;
# an evaluation (and nanoGPT's checkpoint) at iteration 3, then one more step.
ARGS = [
    "--device=cpu", "--backend=gloo", "--dtype=float32", "--compile=False",
    "--dataset=synthetic", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
    "--batch_size=2", "--gradient_accumulation_steps=4", "--max_iters=3",
    "--eval_interval=3", "--eval_iters=2", "--warmup_iters=1", "--lr_decay_iters=3",
]  # fmt: skip
# Issue 47: both ranks on cuda:0 over gloo (torchrun with LETO_RANKS_PER_GPU=2, leto run
# --ranks-per-gpu 2; bash bench/gpu_suite.sh world2-ports): the same comparison on the GPU,
# deterministic algorithms on through a nanoGPT config file (it has no flag for them; SDPA's
# fp32 CUDA backward is not deterministic otherwise).
SHARED_GPU = {"LETO_RANKS_PER_GPU": "2", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC = "import torch\ntorch.use_deterministic_algorithms(True)\n"


def test_the_nanogpt_port_changes_at_most_9_lines():
    changed = changed_lines(HERE / "train.py", HERE / "train_leto.py")
    assert 0 < changed <= 9, f"{changed} lines changed"


def _workdir(root: Path) -> Path:
    """nanoGPT reads configurator.py and data/<dataset>/ from its working directory."""
    root.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copy(HERE / f, root / f)
    (root / "deterministic.py").write_text(DETERMINISTIC)  # (the GPU case's config file)
    subprocess.run(
        [sys.executable, str(HERE / "prepare_synthetic.py"), "--vocab", str(VOCAB)],
        check=True, cwd=root, timeout=60,
    )  # fmt: skip
    return root


def _differs(a: dict, b: dict, what: str) -> str | None:
    if a.keys() != b.keys():
        return f"{what}: keys differ: {sorted(map(str, a.keys() ^ b.keys()))}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if (why := _differs(x, y, f"{what}.{k}")) is not None:
                return why
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return f"{what}.{k} differs"
    return None


@pytest.mark.integ
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda-shared",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
        # Issue 60 item 5: compiled (torch.compile, Inductor) at world 2, the ranks sharing
        # the GPU: torchrun + DDP splits the graph at its buckets, run.model at Leto's
        # presented as DDP's (tests/test_compiled_split.py).
        pytest.param(
            "cuda-shared-compiled",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_nanogpt_under_leto_run_is_byte_identical_to_torchrun_and_ddp_after_a_kill(
    tmp_path, device
):
    compiled = device.endswith("-compiled")
    device = device.removesuffix("-compiled")
    args = ARGS if device == "cpu" else [a.replace("--device=cpu", "--device=cuda") for a in ARGS]
    if compiled:
        args = [a.replace("--compile=False", "--compile=True") for a in args]
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else SHARED_GPU
    if device != "cpu":
        args = ["deterministic.py", *args]  # a config file, run by nanoGPT's configurator
    # The reference, unmodified nanoGPT under torchrun (once more in a fresh folder if
    # plain torch + gloo aborts at its exit: tests.torchrun_reference).
    folders = [tmp_path / "ddp", tmp_path / "ddp-again", tmp_path / "ddp-third"]
    ddp = folders[torchrun_reference.run(
        "nanoGPT",
        lambda a: ["--standalone", "--nproc-per-node", "2", "train.py", *args,
                   f"--out_dir={folders[a] / 'out'}"],
        cwd_for=lambda a: _workdir(folders[a]), timeout=120, env=dict(os.environ, **env),
    )]  # fmt: skip
    leto = _workdir(tmp_path / "leto")  # run_job starts leto run in this folder
    # Killed after the forward of its second micro-batch (before that micro-batch's
    # prefetch), pages lost: iteration 2 is redone from 1's record, and the promoted
    # trainer's pre-loop get_batch must return the batch 1 prefetched.
    gpu = {} if device == "cpu" else {
        "device": "cuda", "extra": ("--ranks-per-gpu", "2"),
        "pool": PoolConfig.for_cuda(0, data_pages=6, tier1_pages=2, allow_fault_injection=True),
    }  # fmt: skip
    summary = run_job(
        2, TrainConfig(), leto, [JobFault(1, "compute.backward@2#2", lose_pages=2)],
        script=leto / "train_leto.py", script_args=[*args, f"--out_dir={leto / 'out'}"], **gpu,
    )  # fmt: skip
    assert summary["injections"] == 1, summary["recoveries"]
    want = torch.load(ddp / "out" / "ckpt.pt", weights_only=False)
    got = torch.load(leto / "out" / "ckpt.pt", weights_only=False)
    assert want["iter_num"] == got["iter_num"] == 3, (want["iter_num"], got["iter_num"])
    assert (why := _differs(want["model"], got["model"], "model")) is None, why
    assert (why := _differs(want["optimizer"], got["optimizer"], "optimizer")) is None, why
    # Every trainer (the first two and the shadows promoted in the recovery) says it
    # once in its log, and the agent once on the console, counting them.
    said = {
        log.name: log.read_text().count("committed without a loss")
        for log in sorted((leto / "logs").glob("rank*.log"))
    }
    assert all(n <= 1 for n in said.values()), said
    assert said["rank0.gen0.active.log"] == said["rank1.gen0.active.log"] == 1, said
    assert summary["no_loss_ranks"] == sum(said.values()), (summary["no_loss_ranks"], said)
    assert "run.record_loss(loss)" in (leto / "logs" / "rank0.gen0.active.log").read_text()
