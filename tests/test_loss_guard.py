"""The loss guard (``leto.integrity.loss_guard``) without processes: a non-finite loss on
any rank is agreed by every rank through one all_gather (stood in for here), named in a
``FatalFailure`` (the runtime's checkpoint fallback), and nothing is exchanged at world
1.

The multi-process path — a transient NaN on one rank rolled back and the run EXACT —
is tests/test_loss_guard_integ.py."""

from __future__ import annotations

import math

import pytest

from leto.errors import FatalFailure
from leto.integrity import loss_guard
from leto.integrity.loss_guard import LossGuard, NonFiniteLoss


def _guard(monkeypatch, rank: int, flags: list[int]) -> LossGuard:
    monkeypatch.setattr(loss_guard.dist, "new_group", lambda **kw: "pg")

    def all_gather(out, mine, group=None):
        assert group == "pg" and int(mine) == flags[rank], "this rank's flag is sent"
        for o, f in zip(out, flags, strict=True):
            o.fill_(f)

    monkeypatch.setattr(loss_guard.dist, "all_gather", all_gather)
    return LossGuard(rank, len(flags))


def test_every_rank_learns_which_ranks_loss_was_not_finite(monkeypatch):
    assert _guard(monkeypatch, 0, [0, 0, 1]).agree(False) == [2]
    assert _guard(monkeypatch, 2, [0, 0, 1]).agree(True) == [2]
    assert _guard(monkeypatch, 1, [0, 0, 0]).agree(False) == []


def test_world_1_exchanges_nothing(monkeypatch):
    monkeypatch.setattr(loss_guard.dist, "all_gather", lambda *a, **k: pytest.fail("gathered"))
    g = LossGuard(0, 1)
    assert g.agree(True) == [0] and g.agree(False) == []


def test_the_failure_is_fatal_and_says_what_happens_next():
    g = LossGuard(1, 1)
    with pytest.raises(
        NonFiniteLoss, match=r"iteration 7: .*rank\(s\) \[1\] \(this rank's: nan\)"
    ) as e:
        g.fail(7, [1], math.nan)
    assert isinstance(e.value, FatalFailure)
    assert "last verified checkpoint" in str(e.value) and "--no-loss-guard" in str(e.value)


def test_the_guard_is_on_unless_leto_run_turned_it_off(monkeypatch):
    monkeypatch.delenv(loss_guard.ENV_LOSS_GUARD, raising=False)
    assert loss_guard.enabled()
    monkeypatch.setenv(loss_guard.ENV_LOSS_GUARD, "0")
    assert not loss_guard.enabled()
