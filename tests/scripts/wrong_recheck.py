"""A ``LETO_PLUGINS`` module for tests: the update recheck's own recomputation is wrong at
iteration 1, the same bit in every generation — a software mistake in the check, which
the alarm policy must settle without naming the device (tests/test_recheck_integ.py)."""

import torch

from leto.update.rmu import Updater

_step = Updater._user_step


def _wrong(self, it, units, points=True):
    _step(self, it, units, points)
    if not points and it == 1:  # the recheck's computation (the first one has points)
        e0 = self.state.element_range(units)[0]
        self.state.flat["exp_avg_sq"][e0 : e0 + 1].view(torch.int32).bitwise_xor_(1)


Updater._user_step = _wrong
