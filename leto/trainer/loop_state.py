"""The script's loop state, retained per iteration: each optimizer's hyperparameters and
step count, the LR schedulers, the GradScaler and ``run.state`` (the script's small
state). ``leto.update.loop_record`` holds the bytes; this module decides what goes in
and how a recovery restores it.

Runs in a trainer, inside ``leto.Run``. A *step record* of iteration t is written at
``optimizer.step()`` of t, i.e. with the loop as it was at the start of t (the
schedulers and the scaler change after the step); an *end record* of t (every step
skipped by the GradScaler) holds the start of t + 1. The data record of t is written
just before either, and always holds the start of t + 1 (t's batches are drawn by then).

Not covered: more than one ``scheduler.step()`` per iteration (``leto.Run`` refuses it).
"""

from __future__ import annotations

from leto.errors import FatalFailure
from leto.update.loop_record import LoopRecord
from leto.update.user_optim import UserOptimizer


class LoopState:
    def __init__(
        self,
        loop: LoopRecord,
        user: UserOptimizer,
        schedulers: list,
        scaler,
        n_optimizers: int,
        data=None,
    ):
        """``data``: the data position's records (``DataState``), or None."""
        self.loop, self.user, self.schedulers, self.scaler = loop, user, schedulers, scaler
        self.data = data
        self.state: dict = {}  # ``run.state``
        self.updates = [0] * n_optimizers  # steps committed so far, per optimizer

    def _snapshot(self) -> dict:
        return {
            "scheduler": [sc.state_dict() for sc in self.schedulers],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "state": dict(self.state),
        }

    def write_step(self, t: int, skip: list[int]) -> dict:
        """Iteration ``t``'s step record, before its update runs; returns the update's
        description (hyperparameters, step counts, the optimizers skipped)."""
        rec = {"hparams": self.user.hparams(), "updates": list(self.updates), "skip": skip}
        self._write_data(t)
        self.loop.write(t, {**rec, **self._snapshot()})
        return rec

    def write_end(self, t: int) -> None:
        """The GradScaler skipped every step of ``t``: it commits nothing, and its end —
        the schedulers stepped, the scale backed off — is the start of ``t + 1``."""
        rec = {"end": True, "hparams": self.user.hparams(), "updates": list(self.updates)}
        self._write_data(t)
        self.loop.write(t, {**rec, **self._snapshot()})

    def _write_data(self, t: int) -> None:
        # Before the loop record: a loop record of t (what a recovery that finishes t
        # reads) then always has t's data record beside it.
        if self.data is not None:
            self.data.write(t)

    def committed(self, skip) -> None:
        """The update described by the last step record is done."""
        self.updates = committed(self.updates, skip)

    def step_record(self, t: int) -> dict:
        """The step record of ``t``, whose interrupted update a recovery finishes."""
        rec = self.loop.read(t)
        if rec is None:
            raise FatalFailure(
                f"the update of iteration {t} was interrupted and its hyperparameters are "
                f"not in the loop record: it cannot be finished exactly"
            )
        return rec

    def restore(self, n: int) -> None:
        """The loop's state at the start of iteration ``n``: from ``n``'s step record,
        or from ``n - 1``'s with the rest of that iteration replayed — one
        ``scheduler.step()`` each, and the scaler's update after a step it did not
        skip. The data position is ``n - 1``'s data record whichever record the rest
        came from."""
        if self.data is not None:
            self.data.restore(n, required=self.loop.read(n - 1) is not None)
        rec = self.loop.read(n)
        replay = False
        if rec is None or rec.get("end"):
            rec = self.loop.read(n - 1)
            replay = rec is not None and not rec.get("end")
        if rec is None:
            # A fresh start (its optimizers' loaded step counts, else one update per
            # iteration so far), or a checkpoint restore without a loop record.
            self.updates = [n if k is None else k for k in self.user.loaded_steps]
            return
        self.updates = (
            committed(rec["updates"], rec.get("skip", ())) if replay else list(rec["updates"])
        )
        for (_, group), h in zip(self.user.groups, rec["hparams"], strict=True):
            group.update(h)
        self.state = dict(rec["state"])
        if self.scaler is not None and rec.get("scaler") is not None:
            sd = rec["scaler"] if isinstance(rec["scaler"], list) else dict(rec["scaler"])
            if replay:  # (Megatron's loss scaler replays its own update)
                sd = getattr(self.scaler, "grown", scaler_grown)(sd)
            self.scaler.load_state_dict(sd)
        for sc, st in zip(self.schedulers, rec["scheduler"], strict=True):
            sc.load_state_dict(st)
            if replay:
                sc.optimizer._opt_called = True
                sc.step()


def scaler_grown(sd: dict) -> dict:
    """A GradScaler's state after ``update()`` of a step with no inf/NaN: the growth
    tracker counts it, and every ``growth_interval`` of them multiply the scale by the
    growth factor — as torch's kernel does: the float32 scale times the double factor,
    in double, rounded to float32."""
    import numpy as np

    sd = dict(sd)
    tracker = sd["_growth_tracker"] + 1
    if tracker >= sd["growth_interval"]:
        sd["scale"] = float(np.float32(float(np.float32(sd["scale"])) * sd["growth_factor"]))
        tracker = 0
    sd["_growth_tracker"] = tracker
    return sd


def committed(updates: list[int], skip) -> list[int]:
    """Each optimizer's step count after an update that skipped the optimizers ``skip``."""
    return [n if oi in skip else n + 1 for oi, n in enumerate(updates)]
