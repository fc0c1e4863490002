"""A test's reference run: a plain script under torchrun (no Leto), once more if it fails.

Plain torch + gloo has aborted (SIGABRT) at its exit after a finished run, in CI with
other jobs on the two cores (seen with nanoGPT and with ``tests/scripts/buffers_job.py``,
both with their outputs written; nanoGPT twice in a row once, at ``d15c15b``). A third
failure fails the test, with every run's end.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ATTEMPTS = 3


def run(what: str, argv_for, cwd_for=None, **kwargs) -> int:
    """``python -m torch.distributed.run`` + ``argv_for(attempt)`` (attempts 0 to
    ``ATTEMPTS - 1``: a fresh output place each), in ``cwd_for(attempt)`` if given,
    ``subprocess.run``'s ``kwargs``; returns the attempt that finished."""
    why = ""
    for attempt in range(ATTEMPTS):
        cwd = None if cwd_for is None else cwd_for(attempt)
        try:
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", *argv_for(attempt)],
                check=True, capture_output=True, text=True, cwd=cwd, **kwargs,
            )  # fmt: skip
            return attempt
        except subprocess.CalledProcessError as e:
            why += f"\ntorchrun of {what}, attempt {attempt}:\n{e.stdout[-2000:]}\n{e.stderr[-2000:]}"
            if attempt < ATTEMPTS - 1:
                print(f"the torchrun reference failed; run again: {why[-800:]}")
    pytest.fail(why)
