"""Test configuration: Hypothesis profiles and the GPU marker.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default; bounded examples, derandomized so a
CI run is reproducible) and ``dev`` (many more examples, for hunting).
Tests marked ``gpu`` run only where torch sees a CUDA device; elsewhere they are
reported as skipped with that reason, never silently passed. Tests marked ``integ``
start whole ``leto run`` jobs (seconds each, CPU-bound on 2 cores): ``pytest -m "not
integ"`` is the quick loop. Fault-free references are built once per session and job
configuration (``job_reference``, ``inject_reference``) and shared by every module; so is
a faulted job two modules assert on (``ported_llama_killed``).
"""

from __future__ import annotations

import os
from pathlib import Path

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
    skip = pytest.mark.skip(
        reason="needs a CUDA device (on a GPU machine: bash bench/gpu_suite.sh)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def job_reference(tmp_path_factory):
    """``job_reference(world, cfg, **run_job_kwargs)``: the fault-free run of the example
    job for that configuration, built on first use and shared for the session."""
    from faultkit.job import run_job

    cache: dict = {}

    def get(world: int, cfg, **kw) -> dict:
        key = (world, cfg, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            kw.setdefault("shadow_level", "off")  # shadows change nothing fault-free
            cache[key] = run_job(world, cfg, tmp_path_factory.mktemp("jobref"), **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def inject_reference(tmp_path_factory):
    """``inject_reference(cfg)``: faultkit's fault-free reference for an ``InjectConfig``
    (only its job fields matter), built once per session."""
    from dataclasses import replace

    from faultkit.inject import InjectConfig, reference_run

    cache: dict = {}

    def get(cfg) -> dict:
        job = replace(
            cfg,
            phase=InjectConfig.phase,
            pages=0,
            host_parity_pages=0,
            mode="kill",
            rank=0,
            every=0,
            abort_after_blocks=InjectConfig.abort_after_blocks,
            shadow_level="off",
            replica_check=True,  # the fault-free bytes are the same either way
        )
        if job not in cache:
            cache[job] = reference_run(job, Path(tmp_path_factory.mktemp("injref")))
        return cache[job]

    return get


@pytest.fixture(scope="session")
def ported_llama_killed(tmp_path_factory):
    """``(summary, out)``: the ported Llama (``examples/porting/llama_leto.py``) under
    ``leto run`` on two ranks with L2 shadows, rank 1 killed in the middle of iteration 2's
    optimizer step with pages of every kind lost on every rank. One job, two claims:
    tests/test_porting.py compares its bytes with DDP's, tests/test_promoted_imports.py
    reads what its promoted trainers imported."""
    from faultkit.job import JobFault, run_job
    from leto.workload.train import TrainConfig
    from tests.test_porting import CPU_LOSE, ITERS, LETO

    out = tmp_path_factory.mktemp("ported_llama") / "faulted"
    got = run_job(
        2, TrainConfig(), out, [JobFault(1, "update.optimizer@2#1", inject=CPU_LOSE)],
        shadow_level="L2", script=LETO,
        script_args=["--iterations", str(ITERS), "--out", str(out / "train")],
    )  # fmt: skip
    return got, out
