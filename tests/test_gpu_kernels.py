"""Leto's run-time compiled CUDA modules (leto.gpu_kernels): what each compiles, the lock
that makes a trainer wait for a build in progress instead of compiling again, the
prebuild processes leto run starts on a GPU; on a GPU, a module compiled once and kept,
and a damaged kept file compiled again."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from leto import gpu_kernels, native


@pytest.mark.parametrize(
    "name, kernel", [("codec", "gf_build_tables"), ("chunk_pass", "chunk_pass_p1")]
)
def test_each_module_names_its_source_and_options(name, kernel):
    source, opts, headers = gpu_kernels._spec(name)
    assert kernel in source and "-std=c++17" in opts and len(headers) == 2
    if name == "chunk_pass":  # IEEE denormals, as torch builds its kernels
        assert "-ftz=false" in opts


def test_an_unknown_module_is_refused_by_name():
    with pytest.raises(ValueError, match="no CUDA module 'gemm'"):
        gpu_kernels._spec("gemm")


def test_a_build_in_progress_is_waited_for_not_repeated(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    got = []

    def second():
        t0 = time.monotonic()
        with gpu_kernels._locked("codec-sm90", 10.0):
            got.append(time.monotonic() - t0)

    with gpu_kernels._locked("codec-sm90", 10.0):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        assert got == [], "the second build went ahead while the first held the lock"
    t.join(10)
    assert got and got[0] >= 0.45


def test_a_lock_held_too_long_is_passed_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    with gpu_kernels._locked("codec-sm90", 10.0):
        t0 = time.monotonic()
        with gpu_kernels._locked("codec-sm90", 0.2) as second:
            assert second.fd is None and time.monotonic() - t0 < 5
    assert "held its build for 0.2 s; compiling it here" in capsys.readouterr().err


def test_the_prebuilds_start_one_process_a_module_and_can_be_turned_off(tmp_path, monkeypatch):
    procs = gpu_kernels.start_prebuilds(tmp_path)
    assert len(procs) == len(gpu_kernels.MODULES)
    for p in procs:
        assert p.wait(timeout=120) == 0
    for name in gpu_kernels.MODULES:
        said = (tmp_path / f"prebuild.{name}.log").read_text()
        # Without CuPy (this machine's CPU build) nothing is built, and it says so.
        assert f"prebuild of {name}:" in said, said
    gpu_kernels.stop_prebuilds(procs)
    monkeypatch.setenv(gpu_kernels.ENV_PREBUILD, "0")
    assert gpu_kernels.start_prebuilds(tmp_path) == []


def test_the_prebuild_needs_a_module_name():
    p = subprocess.run([sys.executable, "-m", "leto.gpu_kernels", "all"], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and "usage" in p.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_module_is_compiled_once_and_a_damaged_file_again(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    t0 = time.monotonic()
    path = gpu_kernels.module_file("chunk_pass")
    first = time.monotonic() - t0
    t0 = time.monotonic()
    assert gpu_kernels.module_file("chunk_pass") == path
    assert time.monotonic() - t0 < first / 10, "kept: not compiled again"
    # The prebuild's file is what a trainer loads.
    p = subprocess.run([sys.executable, "-m", "leto.gpu_kernels", "codec"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0 and "kept in" in p.stdout, p.stdout + p.stderr
    import cupy

    t0 = time.monotonic()
    mod = gpu_kernels.load("codec", lambda f: cupy.RawModule(path=f))
    assert mod.get_function("gf_build_tables") is not None
    assert time.monotonic() - t0 < 5, "the prebuild's file was not used"
    path.write_bytes(b"not a cubin")
    from cupy.cuda import function

    def load(f):
        m = function.Module()
        m.load_file(f)
        return m

    assert gpu_kernels.load("chunk_pass", load).get_function("chunk_pass_p1") is not None
