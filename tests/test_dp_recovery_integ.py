"""Exact recovery of data-parallel training on CPU (gloo) under ``leto run`` with
shadows off: the in-place recovery by cold-started trainers.

Each test kills one rank at a named point of an iteration; the agent fences the other
ranks wherever they are, the fault plan loses pages, and every rank starts again cold
on its surviving pool. Losses and every retained tensor must equal the fault-free run
byte for byte. A kill at each point the faultkit matrix covers (compute.backward,
allreduce, grad_parity, sync, update.optimizer/.parity/.store/.tier2) is the CI gate's
(``.ci/run``); here: the other points, lost pages, world 4, ZeRO-1, accumulation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faultkit import hooks
from faultkit.inject import PHASES
from faultkit.job import JobFault, first_difference, run_job
from leto.workload.train import TrainConfig

# A test may build a shared reference first (one more leto run).
pytestmark = [pytest.mark.timeout(400), pytest.mark.integ]
CFG = TrainConfig(iterations=4)
ZERO1 = TrainConfig(iterations=4, zero1=True)
# Gradient accumulation: two micro-batches per iteration under bf16 autocast, gradients
# reduced in several small buckets while the last backward runs.
ACCUM = TrainConfig(iterations=4, micro_batches=2, autocast="bf16", bucket_mib=0.05)
# The points the CI's faultkit matrix (world 2, L3 shadows, each phase x lost pages x a
# host parity page) does not already kill at; gather is ZeRO-1 only (its own test).
MATRIX_POINTS = set(PHASES.values())
POINTS = [p for p in hooks.POINTS if p != "gather" and p not in MATRIX_POINTS]


# fp16 autocast with the script's torch.amp.GradScaler, its first scale so large that
# iteration 0's step overflows and is skipped: a transaction that commits nothing.
FP16 = TrainConfig(iterations=4, autocast="fp16", init_scale=131072.0)
# The script's two optimizers — torch.optim.Muon for the blocks' matrices (each updated
# whole, its own chunk) and fused AdamW for the rest: one transaction once both stepped —
# under fp16 with a scale at which AdamW's gradients overflow in iterations 0-3 and
# Muon's do not: the scaler skips AdamW's steps only (the transaction updates Muon's).
MUON_FP16 = TrainConfig(iterations=4, optimizer="muon", autocast="fp16", init_scale=1048576.0)


class _References:
    """The session's shared fault-free references, by name (built on first use)."""

    def __init__(self, job_reference):
        self.get = job_reference

    def __getitem__(self, key):
        world, cfg = {
            2: (2, CFG), 4: (4, CFG), "zero1": (2, ZERO1), "accum": (2, ACCUM),
            "fp16": (2, FP16), "muon_fp16": (2, MUON_FP16),
        }[key]  # fmt: skip
        return self.get(world, cfg, save_state=True)  # final states: the ZeRO-1 test


@pytest.fixture(scope="module")
def reference(job_reference):
    return _References(job_reference)


def run(world, cfg, out, fault=None, lose=()):
    faults = [JobFault(fault[0], fault[1], inject=lose)] if fault else []
    return run_job(world, cfg, out, faults, shadow_level="off", save_state=True)


# Group 0 of the allocation set: units 0-4 (param, exp_avg, exp_avg_sq pages 0-4): H1 = 4
# pages of group 0, a host parity page of group 1 and a gradient page, on every rank.
LOSE_H1_PAGES_AND_A_PARITY_PAGE = (
    ("data", "param", (0, 3)),
    ("data", "exp_avg", (1, 4)),
    ("tier1", 1, (2,)),
    ("data", "grad", (1,)),
)


def test_kill_one_rank_anywhere_world_2(reference, tmp_path):
    # One job, one kill per recovery (as faultkit certify strikes), the ranks taking turns:
    # each point of POINTS in the next generation, in iteration 1 (the forward's kill
    # redoes it whole, so the load's strikes it again), 2, 3 — a recovery finishes an
    # interrupted update, so a later point of the same iteration would never be reached.
    # A second chunk's (#2) for the update's points: a mid-update state.
    assert POINTS == ["compute.forward", "update.load", "update.undo", "update.commit"], POINTS
    faults = [
        JobFault(i % 2, f"{p}@{it}#{1 if p in hooks.ONCE_PER_ITERATION else 2}")
        for i, (p, it) in enumerate(zip(POINTS, (1, 1, 2, 3), strict=True))
    ]
    got = run_job(2, CFG, tmp_path, faults, shadow_level="off", save_state=True)
    assert got["injections"] == 4, got["injections"]
    assert [r["failed_ranks"] for r in got["recoveries"]] == [[f.rank] for f in faults]
    assert first_difference(reference[2], got) is None, first_difference(reference[2], got)


# (allreduce is in the CI matrix at world 2; here the largest world's update.)
@pytest.mark.parametrize("victim,point", [(3, "update.parity")])
def test_kill_one_rank_world_4(reference, tmp_path, victim, point):
    got = run(
        4, CFG, tmp_path, fault=(victim, f"{point}@2#1"), lose=LOSE_H1_PAGES_AND_A_PARITY_PAGE
    )
    assert first_difference(reference[4], got) is None, first_difference(reference[4], got)


def test_zero1_equals_replicated_bit_for_bit(reference, tmp_path):
    """Sharding optimizer state changes no bit: same losses, same parameters, and each
    rank's moments equal the replicated run's slice of them."""
    z = reference["zero1"]
    rep = reference[2]
    assert z["losses"] == rep["losses"]
    for r in range(2):
        assert torch.equal(
            z["states"][r]["param"].view(torch.uint8), rep["states"][0]["param"].view(torch.uint8)
        )
        lo = int(z["states"][r]["shard_start"])
        for k in ("exp_avg", "exp_avg_sq"):
            mine = z["states"][r][k]
            assert torch.equal(mine, rep["states"][0][k][lo : lo + mine.numel()]), f"rank {r} {k}"


# gather is ZeRO-1's own point; the sharded update's middle. (Its other phases strike
# the same code as the replicated job's, which the CI matrix covers.)
@pytest.mark.parametrize("point", ["gather", "update.optimizer"])
def test_zero1_kill_anywhere_with_lost_pages(reference, tmp_path, point):
    got = run(2, ZERO1, tmp_path, fault=(1, f"{point}@2#1"), lose=LOSE_H1_PAGES_AND_A_PARITY_PAGE)
    assert first_difference(reference["zero1"], got) is None, first_difference(
        reference["zero1"], got
    )


@pytest.mark.parametrize(
    "victim,point",
    # A kill in the second or the first micro-batch (the update after accumulation is
    # the same update as one micro-batch's: the matrix and the fp16 test strike it).
    [(1, "compute.backward@2#2"), (0, "compute.forward@1#1")],
)
def test_gradient_accumulation_recovers_exactly(reference, tmp_path, victim, point):
    """A kill in the second or first micro-batch: the iteration is redone from its first
    micro-batch."""
    got = run(2, ACCUM, tmp_path, fault=(victim, point))
    assert got["injections"] == 1, f"the fault {point} was not injected"
    assert first_difference(reference["accum"], got) is None, first_difference(
        reference["accum"], got
    )


def test_fp16_with_a_skipped_step_recovers_exactly(reference, tmp_path):
    ref = reference["fp16"]
    log = (Path(ref["out"]).parent / "logs" / "rank0.gen0.active.log").read_text()
    assert "iteration 0: the GradScaler skipped the step" in log, log[-800:]
    # A skipped iteration is an iteration: its loss is logged (torchrun's script logs it).
    assert sorted(ref["losses"][0]) == [0, 1, 2, 3], ref["losses"][0]
    # Two failures: a kill in iteration 1's backward (the loop resumes from the skipped
    # iteration's end: scaler backed off, scheduler stepped), then one in the middle of
    # iteration 2's update with H1 pages of a group lost (finished as the optimizer's
    # 2nd step, not the 3rd).
    faults = [
        JobFault(0, "compute.backward@1#1"),
        JobFault(1, "update.optimizer@2#2", inject=LOSE_H1_PAGES_AND_A_PARITY_PAGE),
    ]
    got = run_job(2, FP16, tmp_path, faults, shadow_level="L2")
    assert got["injections"] == 2, got["recoveries"]
    assert first_difference(ref, got) is None, first_difference(ref, got)


def test_muon_beside_adamw_with_adamws_steps_skipped_recovers_exactly(reference, tmp_path):
    ref = reference["muon_fp16"]
    log = (Path(ref["out"]).parent / "logs" / "rank0.gen0.active.log").read_text()
    assert "iteration 2: the GradScaler skipped the step of optimizer(s) [1]" in log, log[-800:]
    # Killed in the middle of iteration 2's update (Muon's layers updated, AdamW's pieces
    # left as they are) with H1 pages of a group lost.
    fault = JobFault(1, "update.optimizer@2#2", inject=LOSE_H1_PAGES_AND_A_PARITY_PAGE)
    got = run_job(2, MUON_FP16, tmp_path, [fault], shadow_level="L2")
    assert got["injections"] == 1, got["recoveries"]
    assert first_difference(ref, got) is None, first_difference(ref, got)
