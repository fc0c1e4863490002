"""A compiled model inside ``run.model`` is split by Dynamo where torchrun + DDP splits
it (``leto.trainer.ddp_shape``): DDP's ``DDPOptimizer`` compiles a model inside DDP's
forward in pieces at DDP's gradient buckets, and the pieces round as they do, so a
compiled script is bit-identical to its torchrun + DDP run only if Leto's are the same
pieces — also with its parameters views of one retained buffer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leto.job.store import free_port

SCRIPT = Path(__file__).parent / "scripts" / "compiled_split.py"


@pytest.mark.integ  # a process with Dynamo in it
@pytest.mark.timeout(240)
@pytest.mark.parametrize("bucket_mib", [2.0, 25.0])
def test_dynamo_splits_a_compiled_model_at_ddps_buckets(bucket_mib):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), str(bucket_mib)],
        capture_output=True, text=True, timeout=220, env={**os.environ, "PORT": str(free_port())},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["leto"] == got["ddp"], got
    # 12 MiB of parameters: DDP's first bucket (1 MiB) and then bucket_mib each.
    assert len(got["ddp"]) == (7 if bucket_mib == 2.0 else 2), got["ddp"]
