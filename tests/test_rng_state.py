"""The global generators' retained states (leto.trainer.rng_state): what a recovery sets
gives the draws the failed trainer would have made, a script's seeding between
leto.Run and its loop does not undo it, and the record holds no tensor (unpickling one
imports torch.utils.serialization on a promoted trainer's way to training)."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys

import numpy as np
import torch

from leto.trainer.rng_state import GlobalRNG


def _draws() -> tuple:
    return torch.rand(4), random.random(), np.random.rand()


def test_a_recovery_draws_what_the_failed_trainer_would_have_drawn():
    g = GlobalRNG(torch.device("cpu"))
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    _draws()
    record = pickle.dumps(g.state_dict())  # at a commit
    want = _draws()
    g.load_state_dict(pickle.loads(record))  # a promoted trainer's leto.Run
    torch.manual_seed(5), random.seed(5), np.random.seed(5)  # its start-up seeds again
    g.apply()  # run.iterations()
    got = _draws()
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    g.apply()  # once only: a second call changes nothing
    assert not torch.equal(torch.rand(4), want[0])


def test_the_record_unpickles_without_importing_anything():
    record = pickle.dumps(GlobalRNG(torch.device("cpu")).state_dict())
    code = (
        "import pickle, sys, torch\n"
        "before = set(sys.modules)\n"
        f"pickle.loads({record!r})\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
