"""A data-parallel job whose model is compiled is told at its start how it compares with
torchrun + DDP + compile (leto.trainer.run.compiled_dp_notice)."""

from __future__ import annotations

import torch
from torch import nn

from leto.trainer.run import compiled_dp_notice


def test_a_compiled_data_parallel_model_is_told_the_way_to_compare():
    compiled = torch.compile(nn.Linear(4, 4), backend="eager")  # (compiles at its first call: never here)
    said = compiled_dp_notice(compiled, 2, replicated=True)
    assert said and "optimize_ddp = False" in said and "2 ranks" in said, said


def test_nothing_is_said_where_nothing_differs():
    compiled = torch.compile(nn.Linear(4, 4), backend="eager")
    assert compiled_dp_notice(compiled, 1, replicated=True) is None  # no DDP to split at
    assert compiled_dp_notice(compiled, 2, replicated=False) is None  # sharded: no DDP
    assert compiled_dp_notice(nn.Linear(4, 4), 2, replicated=True) is None
