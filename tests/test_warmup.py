"""A parked shadow's warm-up (``leto.trainer.warmup``): the script's function runs on
the shadow's device, leaves the RNG as it found it, and a failing one only costs the
head start. (End to end, in real shadows: tests/test_runtime_integ.py.)"""

from __future__ import annotations

import torch

from leto.trainer.warmup import generic_step, warm_up

CPU = torch.device("cpu")


def test_the_warm_up_runs_on_the_device_and_leaves_the_rng_as_it_found_it():
    ran = []

    def step(device):
        ran.append(device)
        w = torch.randn(16, 16, requires_grad=True, device=device)  # draws from the RNG
        (w @ w).sum().backward()

    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    out = warm_up(step, CPU, rank=0)
    assert ran == [CPU]
    assert torch.equal(torch.rand(4), expected), "the warm-up's draws leaked into the RNG"
    assert out["warmup_s"] >= 0 and "warmup_failed" not in out, out


def test_a_warm_up_that_raises_is_reported_and_not_raised(capsys):
    def step(device):
        raise RuntimeError("CUDA out of memory (stand-in)")

    out = warm_up(step, CPU, rank=3)
    assert out["warmup_failed"] == "RuntimeError: CUDA out of memory (stand-in)", out
    err = capsys.readouterr().err
    assert "rank 3: shadow: warm-up failed (RuntimeError: CUDA out of memory" in err, err
    assert "parks without it" in err, err


def test_tools_warm_up_in_the_shadow_and_a_failing_one_is_reported_not_raised(capsys):
    from leto import plugins
    from leto.trainer.warmup import warm_tools

    seen = []

    def good(device):
        seen.append(device)

    def bad(device):
        raise OSError("pinned memory exhausted (stand-in)")

    saved = list(plugins._shadow_warmups)
    try:
        plugins.install_shadow_warmup(good)
        plugins.install_shadow_warmup(good)  # installed once
        plugins.install_shadow_warmup(bad)
        out = warm_tools(CPU, rank=2)
    finally:
        plugins._shadow_warmups[:] = saved
    assert seen == [CPU], "a tool's warm-up ran other than once"
    assert out["tools_warmup_s"] >= 0
    (failed,) = out["tools_warmup_failed"]
    assert "bad" in failed and "OSError: pinned memory exhausted" in failed, failed
    err = capsys.readouterr().err
    assert "rank 2: shadow: a tool's warm-up failed" in err, err


def test_a_plain_scripts_generic_warm_up_runs_and_leaves_the_rng_as_it_found_it():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    out = warm_up(generic_step, device, rank=0)
    assert "warmup_failed" not in out, out
    assert torch.equal(torch.rand(4), want), "the generic warm-up moved the RNG"
    assert torch.backends.cuda.matmul.allow_tf32 is False, "TF32 left changed"
