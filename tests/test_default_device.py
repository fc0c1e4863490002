"""``leto run`` without ``--device``: the GPU when the driver shows one, else the CPU —
decided without importing torch where it can be, so the CLI's own torch import comes
after the zygote has started (they overlap) instead of before it; and ``leto run`` as a
whole starts its zygote before it imports torch.

Each case runs in a fresh interpreter (torch must not be imported yet), with a stand-in
``cuda.bindings.driver`` on its path where the case needs the driver API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json, sys
    import leto.run_cli as rc
    if len(sys.argv) > 1 and sys.argv[1]:
        rc.NVIDIA_DRIVER = sys.argv[1]  # (where this machine's driver would be)
    if len(sys.argv) > 2:
        rc.torch_builds_cuda = lambda: sys.argv[2] == "cuda-build"
    got = rc.default_device()
    print(json.dumps({"device": got, "torch": "torch" in sys.modules}))
    """
)

STUB = textwrap.dedent(
    """
    import enum, os

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_NO_DEVICE = 100

    def cuInit(flags):
        if os.environ.get("STUB_CUINIT") == "raise":
            raise RuntimeError('Function "cuInit" not found')
        return (CUresult[os.environ.get("STUB_CUINIT", "CUDA_SUCCESS")],)

    def cuDeviceGetCount():
        return (CUresult.CUDA_SUCCESS, int(os.environ.get("STUB_COUNT", "0")))
    """
)


def _probe(tmp_path, stub: bool, env=None, driver_path: str = "", build: str | None = None):
    path = []
    if stub:
        pkg = tmp_path / "stub" / "cuda" / "bindings"
        pkg.mkdir(parents=True)
        (tmp_path / "stub" / "cuda" / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        (pkg / "driver.py").write_text(STUB)
        path.append(str(tmp_path / "stub"))
    # Without the stand-in: no cuda-python, on any machine (None in sys.modules makes
    # ``import cuda.bindings`` fail as an absent package does).
    code = f"import sys; sys.path[:0] = {path!r}\n" + ("" if stub else "sys.modules['cuda'] = None\n") + PROBE
    out = subprocess.run(
        [sys.executable, "-c", code, driver_path, *([build] if build else [])],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "env, device",
    [
        ({"STUB_COUNT": "2"}, "cuda"),
        ({"STUB_COUNT": "0"}, "cpu"),
        ({"STUB_CUINIT": "CUDA_ERROR_NO_DEVICE"}, "cpu"),  # e.g. CUDA_VISIBLE_DEVICES=""
        ({"STUB_CUINIT": "raise"}, "cpu"),  # cuda-python without a libcuda
    ],
)
def test_the_driver_decides_without_torch(tmp_path, env, device):
    got = _probe(tmp_path, stub=True, env=env, build="cuda-build")
    assert got == {"device": device, "torch": False}, got


def test_a_cpu_build_of_torch_sees_no_gpu_where_the_driver_shows_one(tmp_path):
    got = _probe(tmp_path, stub=True, env={"STUB_COUNT": "1"}, build="cpu-build")
    assert got == {"device": "cpu", "torch": False}, got


def test_this_machines_torch_build_is_told_from_its_libraries():
    import torch

    from leto.run_cli import torch_builds_cuda

    assert torch_builds_cuda() == (torch.version.cuda is not None)


def test_without_cuda_python_and_without_nvidias_driver_it_is_the_cpu_without_torch(tmp_path):
    got = _probe(tmp_path, stub=False, driver_path=str(tmp_path / "no-such-driver"))
    assert got == {"device": "cpu", "torch": False}, got


def test_without_cuda_python_but_with_nvidias_driver_torch_decides(tmp_path):
    (tmp_path / "driver").mkdir()
    got = _probe(tmp_path, stub=False, driver_path=str(tmp_path / "driver"))
    import torch

    assert got == {"device": "cuda" if torch.cuda.is_available() else "cpu", "torch": True}


def test_leto_run_starts_its_zygote_before_it_imports_torch(tmp_path):
    # The zygote's import of torch is a fresh job's way to its first trainer: one in this
    # process before it would come first, then the zygote's (not overlapping).
    script = tmp_path / "train.py"
    script.write_text("")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["cuda"] = None  # (no cuda-python, and no NVIDIA driver, below)
        import leto.launch.zygote as z
        import leto.run_cli as rc
        from leto import cli

        rc.NVIDIA_DRIVER = {str(tmp_path / "no-such-driver")!r}

        class Started(Exception):
            pass

        class Zygote:  # stands in for the real one: says what was imported by then
            def __init__(self, *a, **k):
                print("torch imported:", "torch" in sys.modules, flush=True)
                raise Started

        z.Zygote = Zygote
        try:
            cli.main(["run", "--nproc-per-node", "1", {str(script)!r}])
        except Started:
            pass
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "LETO_ZYGOTE": "1"},
    )  # fmt: skip
    assert "torch imported: False" in out.stdout, (out.stdout, out.stderr[-2000:])
