"""The checkpointer across ranks: ranks that measure different costs still save at the
same iterations (a save is collective; a mismatch would deadlock), and a restore loads
exactly what was saved."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leto.job.store import free_port
from leto.trainer.checkpoint import Checkpointer, latest


def _job(rank: int, value: float):
    flat = {"param": torch.full((64,), value), "exp_avg": torch.full((64,), -value)}
    state = SimpleNamespace(flat=flat, local_valid=64)
    # The scrub before each save (leto.integrity.scrub) has nothing to check here.
    scrub = SimpleNamespace(full=lambda when: {"groups": 0, "when": when})
    # Nor has the update recheck (leto.integrity.recheck) anything to settle.
    return SimpleNamespace(
        up=SimpleNamespace(state=state), rank=rank, scrub=scrub, settle_checks=lambda: None
    )


def _run_ranks(worker, root, world: int = 2) -> dict:
    """Run ``worker(rank, world, port, root, queue)`` on ``world`` spawned ranks; each
    puts ``(rank, result)``; returns rank -> result."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, str(root), q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"a rank exited {p.exitcode}"
    return got


def _closing_async_save():
    """``dcp.async_save`` as torch 2.11 has it: it closes the stager it was given once the
    save is done (2.13 leaves that to the caller). The checkpointer keeps saving."""
    import leto.trainer.checkpoint as ckpt

    real = ckpt.dcp.async_save

    def closing(state, **kw):
        got = real(state, **kw)
        stager = kw.get("async_stager")
        if stager is not None:
            done = getattr(got, "upload_completion", got)
            done.add_done_callback(lambda _: stager.close())
        return got

    ckpt.dcp.async_save = closing


def _worker(rank: int, world: int, port: int, root: str, q) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    _closing_async_save()
    # An MTTF this short gives intervals of a few iterations, apart by the cost ratio.
    ck = Checkpointer(root, rank, mttf_s=0.2, hof_ratio=0.0)
    job = _job(rank, 1.0)
    ck.warm(job)
    # 24 iterations: a save put off while the last is written is asked for again 4
    # iterations later, and a save's copies start at the next iteration's begin, so
    # saves come every ~5 iterations (12 iterations gave 2 saves under load).
    for t in range(24):
        time.sleep(0.01 * (1 + 4 * rank))  # rank 1 measures 5x longer iterations
        ck.before_update()  # as leto.Run does: the last save's staging has read the state
        job.up.state.flat["param"].fill_(float(t))
        ck.after_iteration(t, job)
    ck.close()
    assert len(ck.saves) >= 3, f"too few saves to test the stager's reuse: {ck.saves}"
    q.put((rank, [s["iteration"] for s in ck.saves]))
    dist.destroy_process_group()


@pytest.mark.integ
def test_ranks_with_different_costs_save_at_the_same_iterations(tmp_path):
    got = _run_ranks(_worker, tmp_path)
    assert got[0] == got[1], f"ranks saved at different iterations: {got}"
    path, it = latest(tmp_path)
    assert it == got[0][-1], (it, got)
    loaded = {"rank0.param": torch.empty(64), "rank1.exp_avg": torch.empty(64)}
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert torch.equal(loaded["rank0.param"], torch.full((64,), float(it))), loaded["rank0.param"]
    assert torch.equal(loaded["rank1.exp_avg"], torch.full((64,), -1.0))


def _joining_worker(rank: int, world: int, port: int, root: str, q) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    job = _job(rank, 1.0)
    # Whether a save found an earlier checkpoint's metadata in its directory (on any rank).
    import leto.trainer.checkpoint as ckpt

    real, stale = ckpt.dcp.async_save, []

    def spy(state, storage_writer, process_group, **kw):
        stale.append((Path(storage_writer.path) / ".metadata").exists())
        return real(state, storage_writer=storage_writer, process_group=process_group, **kw)

    ckpt.dcp.async_save = spy
    first = Checkpointer(root, rank, interval=4)  # generation 0: saves at 0 and 4
    # Each save written before the next iteration (instant iterations here would
    # otherwise put the next save off while the last one is still being written).
    for t in range(7):
        first.after_iteration(t, job)
        first.drain()
    first.close()
    got = {"first": [s["iteration"] for s in first.saves]}
    # A promoted trainer joining at 7 continues the schedule (next save at 8, not 7).
    joined = Checkpointer(root, rank, interval=4, joining_at=7)
    for t in range(7, 10):
        joined.after_iteration(t, job)
        joined.drain()
    joined.close()
    got["joined at 7"] = [s["iteration"] for s in joined.saves]
    # A restart after a fallback that passed over the checkpoints of 4 and 8 (restored
    # the one of 0, joins at 1): its schedule runs from 0, not from the newer ones, and
    # its save at 4 replaces the old one, whose metadata is gone before any rank writes.
    back = Checkpointer(root, rank, interval=4, joining_at=1)
    for t in range(1, 6):
        back.before_update()
        job.up.state.flat["param"].fill_(100.0 + t)
        back.after_iteration(t, job)
        back.drain()
    back.close()
    got["joined at 1"] = [s["iteration"] for s in back.saves]
    # The last save failing after training ended is reported, not raised (the job is done).
    from concurrent.futures import Future

    failed: Future = Future()
    failed.set_exception(OSError("disk full"))
    back.pending = failed
    back.close()
    got["close reported"] = back.close_error
    # A promoted trainer joining where a save is due (Young's interval of 3, agreed by an
    # earlier generation, newest checkpoint 8) keeps that interval and puts the save off
    # its first iteration, the one a recovery's user waits for: it saves at 14, not 13.
    store = dist.HashStore()
    store.set(ckpt.keys.CHECKPOINT_INTERVAL, "3")
    young = Checkpointer(root, rank, mttf_s=3600.0, joining_at=13, store=store)
    for t in range(13, 16):
        young.after_iteration(t, job)
        young.drain()
    young.close()
    got["joined at 13"] = ([s["iteration"] for s in young.saves], young.interval)
    got["a save found old metadata"] = any(stale)
    q.put((rank, got))
    dist.destroy_process_group()


@pytest.mark.integ
def test_a_trainer_joining_a_running_job_continues_its_checkpoint_schedule(tmp_path):
    got = _run_ranks(_joining_worker, tmp_path)
    want = {
        "first": [0, 4],
        "joined at 7": [8],
        "joined at 1": [4],
        "joined at 13": ([14], 3),
        "a save found old metadata": False,
        "close reported": "OSError: disk full",
    }
    assert got[0] == want and got[1] == want, got
    loaded = {"rank0.param": torch.empty(64)}
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=tmp_path / "it00000004", no_dist=True)
    assert torch.equal(loaded["rank0.param"], torch.full((64,), 104.0)), loaded["rank0.param"]
