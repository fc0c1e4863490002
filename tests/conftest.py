"""Test configuration: Hypothesis profiles and the GPU marker.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default; bounded examples, derandomized so a
CI run is reproducible) and ``dev`` (many more examples, for hunting).
Tests marked ``gpu`` run only where torch sees a CUDA device; elsewhere they are
reported as skipped with that reason, never silently passed.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the lent H200: bench/gpu_suite.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
