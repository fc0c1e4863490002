"""What a checkpoint costs the loop, and so how often the checkpointer saves: Young's
interval counts everything the first save stalled the loop (the full scrub before it
included), and a save put off while the last one is written is asked for again every
few iterations, not by a collective at every one."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import leto.trainer.checkpoint as ckpt
from leto.sim.model import young_interval

SCRUB_S = 0.05  # a full scrub 10x an iteration, as at 1.1 B on a GPU (0.36 s vs 0.27 s)
ITER_S = 0.005


@pytest.fixture
def world1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _job():
    flat = {"param": torch.zeros(64)}
    scrub = SimpleNamespace(full=lambda when: (time.sleep(SCRUB_S), {"when": when})[1])
    return SimpleNamespace(
        up=SimpleNamespace(state=SimpleNamespace(flat=flat, local_valid=64)),
        rank=0,
        scrub=scrub,
        settle_checks=lambda: None,
    )


def test_youngs_interval_counts_the_scrub_before_the_save(world1, tmp_path):
    ck = ckpt.Checkpointer(tmp_path, 0, mttf_s=60.0, hof_ratio=0.0)
    job = _job()
    for t in range(3):
        ck.before_update()
        time.sleep(ITER_S)
        ck.after_iteration(t, job)
        ck.drain()
    ck.close()
    first = ck.saves[0]
    assert ck.cost_s(first) >= SCRUB_S, first
    t_iter = sorted(ck._t_iter)[len(ck._t_iter) // 2]
    want = round(young_interval(ck.cost_s(first) / t_iter, 60.0, t_iter))
    assert ck.interval == want, (ck.interval, want, first, t_iter)
    # What the save's call alone gave: a fraction of it.
    alone = round(young_interval(1e-3 / t_iter, 60.0, t_iter))
    assert ck.interval >= 5 * alone, (ck.interval, alone)
    assert "interval Young's" in ck.summary() and "1 saved (iteration 0)" in ck.summary()


def test_a_save_put_off_is_agreed_on_again_every_few_iterations(world1, tmp_path, monkeypatch):
    ck = ckpt.Checkpointer(tmp_path, 0, interval=1)
    job = _job()
    ck.after_iteration(0, job)
    ck.drain()
    writing: Future = Future()  # the last save still being written
    ck.pending = writing
    calls = []
    real = ckpt.dist.all_reduce
    monkeypatch.setattr(
        ckpt.dist, "all_reduce", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    )
    for t in range(1, 1 + 2 * ckpt.RETRY):
        ck.after_iteration(t, job)
    assert ck.deferred == [1, 1 + ckpt.RETRY], ck.deferred
    assert len(calls) == 2, calls
    writing.set_result(None)
    t = 1 + 2 * ckpt.RETRY
    ck.after_iteration(t, job)  # the next agreement finds the write done: it saves
    ck.drain()
    ck.close()
    assert [s["iteration"] for s in ck.saves] == [0, t], ck.saves
    assert "put off 2 times" in ck.summary()
    assert math.isfinite(ck.cost_s(ck.saves[-1]))
