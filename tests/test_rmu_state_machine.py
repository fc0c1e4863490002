"""A Hypothesis state machine that crashes the updater anywhere, loses pages while no
trainer runs, restarts, and compares every retained byte with an uninterrupted run
(torch.optim.AdamW) whenever a trainer stands at an iteration boundary."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from faultkit import hooks
from leto.memory.client import PoolClient
from leto.memory.launch import start_state_manager
from leto.update.rmu import UpdaterConfig
from tests import rmu_harness as h
from tests.pool_helpers import small_config

pytestmark = pytest.mark.integ  # a state manager process and a long Hypothesis state machine

MAX_ITERS = 6


@functools.cache
def reference(iterations: int, layerwise: str | None) -> dict:
    return h.reference_muon(iterations) if layerwise else h.reference(iterations)


class UpdaterMachine(RuleBasedStateMachine):
    @initialize(
        data_pages=st.sampled_from([6, 8, 12]),
        tier1=st.integers(1, 3),
        chunk_units=st.integers(1, 2),
        layerwise=st.sampled_from([None, "muon"]),
    )
    def start_pool(self, data_pages, tier1, chunk_units, layerwise):
        if layerwise:
            data_pages = 16  # whole layers must fit a group
        self.pool = start_state_manager(small_config(data_pages=data_pages, tier1_pages=tier1))
        self.cfg = UpdaterConfig(
            chunk_units=chunk_units, adamw=h.ADAMW, muon=h.MUON, layerwise=layerwise
        )
        self.tier1 = tier1
        self.client, self.up, self.model, self.it = h.start(self.pool, self.cfg)
        self.alive = True

    def teardown(self):
        hooks.disarm()
        if getattr(self, "alive", False):
            self.client.close()
        if hasattr(self, "pool"):
            self.pool.stop()

    @precondition(lambda self: self.alive and self.it < MAX_ITERS)
    @rule()
    def train(self):
        h.one_iteration(self.up, self.model, self.it)
        self.it += 1

    @precondition(lambda self: self.alive and self.it < MAX_ITERS)
    @rule(point=st.sampled_from(h.POINTS), nth=st.integers(1, 3))
    def crash(self, point, nth):
        hooks.arm(point, self.it, nth, mode="raise")
        try:
            h.one_iteration(self.up, self.model, self.it)
            self.it += 1  # the point was not reached that often: no crash
        except hooks.InjectedCrash:
            self.client.close()
            del self.client, self.up, self.model
            self.alive = False
            self.lost = False
        finally:
            hooks.disarm()

    @precondition(lambda self: self.alive and self.it >= MAX_ITERS)
    @rule()
    def finished(self):
        """The run is over: only the invariant is left to check."""

    @precondition(lambda self: not self.alive and not self.lost)
    @rule(data=st.data())
    def lose_pages(self, data):
        """At most the tolerance: up to H1 data pages of one group, once per crash."""
        self.lost = True
        with PoolClient.connect(self.pool.socket_path, self.pool.token, role="faultkit") as f:
            status = f.status()
            sets = [g for g in status["groups"] if g["kind"] == "set"]
            g = data.draw(st.sampled_from(sets), label="group")
            n_lost = data.draw(st.integers(1, min(self.tier1, g["data_pages"])), label="pages lost")
            first_unit = sum(s["data_pages"] // 3 for s in sets if s["gid"] < g["gid"])
            n_units = g["data_pages"] // 3
            slots = [
                (name, u)
                for u in range(first_unit, first_unit + n_units)
                for name in ("param", "exp_avg", "exp_avg_sq")
            ]
            chosen = data.draw(
                st.lists(st.sampled_from(slots), min_size=n_lost, max_size=n_lost, unique=True),
                label="pages",
            )
            for name, u in chosen:
                f.inject_loss("data", name, [u])
            if (
                data.draw(st.booleans(), label="also a tier-1 page of another group")
                and len(sets) > 1
            ):
                other = data.draw(st.sampled_from([s for s in sets if s["gid"] != g["gid"]]))
                f.inject_loss("tier1", other["gid"], [0])

    @precondition(lambda self: not self.alive)
    @rule()
    def restart(self):
        self.client, self.up, self.model, self.it = h.start(self.pool, self.cfg)
        self.alive = True

    @invariant()
    def retained_state_equals_the_uninterrupted_run(self):
        if not getattr(self, "alive", False):
            return
        want = reference(self.it, self.cfg.layerwise)
        for k, w in want.items():
            # Per parameter: each is aligned, and layers are padded to whole units.
            flat = self.up.state.flat[k]
            got = torch.cat([flat[s.offset : s.offset + s.numel] for s in self.up.state.slots])
            if self.cfg.layerwise:
                w = torch.cat(w)
            diff = (got.view(torch.uint8) != w.view(torch.uint8)).nonzero()
            assert diff.numel() == 0, f"iteration {self.it}: {k} differs at byte {int(diff[0])}"


UpdaterMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("LETO_MACHINE_EXAMPLES", 15)),
    stateful_step_count=10,
    deadline=None,
)
TestUpdaterMachine = UpdaterMachine.TestCase
