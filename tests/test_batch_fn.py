"""``run.batches(get_batch)`` (``leto.trainer.batch_fn``): a nanoGPT-style loop — one
batch drawn before the loop, the next iteration's drawn inside the current one (a
prefetch) — resumed by a "promoted trainer" from a commit's record draws exactly the
batches of the run that never failed; without the record its pre-loop call returns
iteration 0's batch (the trap it closes). In-process: the records pass through
``state_dict``/``load_state_dict`` and a pickle, as in the data record."""

from __future__ import annotations

import pickle
import random

import torch

from leto.trainer.batch_fn import BatchFunctions
from leto.trainer.rng_state import GlobalRNG

MICRO = 3


def get_batch(split: str) -> torch.Tensor:
    # A function of its argument and the global generators, as nanoGPT's.
    hi = 1000 if split == "train" else 10
    return torch.randint(0, hi, (4,)) + random.randrange(7)


def _trainer(record: bytes | None, start: int, stop: int, fail_after: int | None = None):
    """The script's start-up (its own seeding, then the pre-loop draw) and its loop from
    ``start``; returns every batch trained on per iteration, and the record taken at the
    commit of ``fail_after`` (the step of that iteration)."""
    torch.manual_seed(1337)
    random.seed(1337)
    rng = GlobalRNG(torch.device("cpu"))
    fns = BatchFunctions(rng)
    if record is not None:
        rng_sd, fns_sd = pickle.loads(record)
        rng.load_state_dict(rng_sd)
        fns.load_state_dict(fns_sd)
    gb = fns.wrap(get_batch)
    x = gb("train")  # the very first batch
    fns.start()
    rng.apply()
    seen, taken = {}, None
    for it in range(start, stop):
        if it % 2 == 0:
            gb("val")  # an evaluation at the top of the loop draws too
        seen[it] = []
        for _ in range(MICRO):
            seen[it].append(x)
            x = gb("train")  # the prefetch: the next micro-batch, or the next iteration's
        torch.rand(1)  # e.g. dropout in backward
        if it == fail_after:  # optimizer.step(): the commit records the data position
            taken = pickle.dumps([rng.state_dict(), fns.state_dict()])
    return seen, taken


def test_a_resumed_loop_draws_the_prefetched_batch_and_every_later_one():
    ref, _ = _trainer(None, 0, 6)
    _, record = _trainer(None, 0, 6, fail_after=2)  # its commit of 2, then it dies in 3
    got, _ = _trainer(record, 3, 6)
    for it in range(3, 6):
        for a, b in zip(ref[it], got[it], strict=True):
            assert torch.equal(a, b), f"iteration {it}: {a} != {b}"


def test_without_the_record_a_resumed_loop_trains_on_the_first_batch():
    ref, _ = _trainer(None, 0, 6)
    _, record = _trainer(None, 0, 6, fail_after=2)
    rng_sd, _ = pickle.loads(record)
    # The generators alone (what leto.Run retained before run.batches): iteration 3
    # starts from start-up's draw — iteration 0's batch — not 2's prefetch.
    got, _ = _trainer(pickle.dumps([rng_sd, []]), 3, 6)
    assert torch.equal(got[3][0], ref[0][0])
    assert not torch.equal(got[3][0], ref[3][0])


def test_only_argument_tuples_drawn_before_the_loop_are_recorded():
    _, record = _trainer(None, 0, 4, fail_after=1)
    _, (fn_sd,) = pickle.loads(record)
    assert list(fn_sd) == [repr((("train",), []))]
