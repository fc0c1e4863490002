"""The script's global random number generators, retained with its data position.

Runs in a trainer, inside ``leto.Run``. A script that draws from the global generators
inside its loop — dropout masks, ``torch.randint`` batches, ``random.shuffle`` — draws,
in a promoted trainer, from generators that its start-up seeded afresh: the recovery
would then train on other masks or batches than the run that never failed. ``leto.Run``
records these states with the data position when each iteration commits (at
``optimizer.step()``, ``leto.trainer.data_state``) and a recovery resuming at ``n``
sets ``n - 1``'s when ``run.iterations()`` starts — after whatever seeding the script's
start-up does again — so the draws of ``n`` onwards are the failed trainer's.

What is retained: torch's CPU generator, the trainer's CUDA device's generator (when on
a GPU), Python's ``random``, NumPy's legacy global generator (when the script imported
NumPy) and Megatron-Core's RNG tracker's named states (when the script set one up:
``leto.trainer.megatron``). Nothing is reseeded on a fresh start: the script's own seeding stands.

Not covered: draws made after ``optimizer.step()`` within an iteration (they happen
after the record: a recovery does not replay them), generators the script made itself
(``torch.Generator()``: give the object that owns them as ``data=`` if it has
``state_dict``), other devices' generators.
"""

from __future__ import annotations

import random
import sys

import torch

from leto.trainer import megatron


class GlobalRNG:
    """The global generators as one ``state_dict``/``load_state_dict`` object."""

    def __init__(self, device: torch.device):
        self.device = device if device.type == "cuda" else None
        self._pending: dict | None = None  # a recovery's states, until ``apply``

    def state_dict(self) -> dict:
        # torch's states as bytes: a tensor in the record would make a recovery's
        # unpickling import torch.utils.serialization on its way to training.
        out = {"torch": _raw(torch.get_rng_state()), "python": random.getstate()}
        if self.device is not None:
            out["cuda"] = _raw(torch.cuda.get_rng_state(self.device))
        np = sys.modules.get("numpy")
        if np is not None:
            out["numpy"] = np.random.get_state()
        if megatron.imported() and (states := megatron.tracker_states()) is not None:
            out["megatron"] = states
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Kept until ``apply``: the script may seed the generators between ``leto.Run``
        and its loop (its start-up, run again in a promoted trainer), which must not
        undo the recovery's states."""
        self._pending = sd

    def apply(self) -> None:
        """Set the states a recovery loaded (``run.iterations()``, before the first
        iteration); nothing on a fresh start."""
        sd, self._pending = self._pending, None
        if sd is not None:
            self.set_now(sd)

    def set_now(self, sd: dict) -> None:
        """Set the generators to ``sd`` (a ``state_dict()``) now."""
        torch.set_rng_state(_tensor(sd["torch"]))
        random.setstate(sd["python"])
        if self.device is not None and "cuda" in sd:
            torch.cuda.set_rng_state(_tensor(sd["cuda"]), self.device)
        if "numpy" in sd:
            import numpy as np

            np.random.set_state(sd["numpy"])
        if "megatron" in sd:
            megatron.set_tracker_states(sd["megatron"])


def _raw(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()


def _tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
