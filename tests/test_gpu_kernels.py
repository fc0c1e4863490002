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
    "name, kernel",
    [("codec", "gf_build_tables"), ("chunk_pass", "chunk_pass_p1"), ("grad_clip", "grad_clip_h4")],
)
def test_each_module_names_its_source_and_options(name, kernel):
    source, opts, headers = gpu_kernels._spec(name)
    assert kernel in source and "-std=c++17" in opts and len(headers) == 2
    if name != "codec":  # IEEE denormals, as torch builds its kernels
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


def _fake_cupy(monkeypatch, compiled: list, refuse: set, version=(12, 8), arch="90",
               split_ok=True):  # fmt: skip
    """Stand-ins for the CuPy pieces ``leto.gpu_kernels`` and its loaders use: a compiler
    that counts its calls (and refuses ``--split-compile`` unless ``split_ok``) and a
    module loader that refuses the binaries in ``refuse``."""
    import types

    class CompileException(Exception):
        pass

    def compile_using_nvrtc(src, options=()):
        if not split_ok and "--split-compile=0" in options:
            raise CompileException("nvrtc: error: unrecognized option --split-compile=0")
        compiled.append(options)
        return f"ptx {len(compiled)}"  # PTX comes back as text

    class Module:
        def load_file(self, path):
            with open(path, "rb") as f:
                binary = f.read()
            if binary in refuse:
                raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
            self.binary = binary

    def get_version():
        if version is None:
            raise AttributeError("getVersion")
        return version

    cupy = types.ModuleType("cupy")
    cupy.__version__ = "14.0.0"
    cuda = types.ModuleType("cupy.cuda")
    cuda.compiler = types.SimpleNamespace(
        compile_using_nvrtc=compile_using_nvrtc, CompileException=CompileException
    )
    cuda.function = types.SimpleNamespace(Module=Module)
    cuda.Device = lambda d=None: types.SimpleNamespace(compute_capability=arch, id=0)
    cupy.cuda = cuda
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = types.SimpleNamespace(getVersion=get_version)
    for name, mod in {"cupy": cupy, "cupy.cuda": cuda, "cupy_backends": types.ModuleType("x"),
                      "cupy_backends.cuda": types.ModuleType("y"),
                      "cupy_backends.cuda.libs": libs}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)


def test_the_chunk_pass_kernel_is_compiled_once_a_machine(tmp_path, monkeypatch):
    # The logic of leto.gpu_kernels through leto.update.chunk_pass._module, on the CPU:
    # compiled by the first process (each _module() call here stands for one), read back
    # by later ones; a kept binary the driver refuses is compiled and kept again; an
    # NVRTC whose version is unknown compiles every time and keeps nothing.
    from leto.update import chunk_pass

    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    compiled, refuse = [], set()
    _fake_cupy(monkeypatch, compiled, refuse)

    def build():
        chunk_pass._module.cache_clear()
        return chunk_pass._module().module.binary

    first = build()
    assert (first, len(compiled)) == (b"ptx 1", 1)
    assert "-ftz=false" in compiled[0]  # IEEE denormals, as torch's kernels
    assert "--split-compile=0" in compiled[0]  # NVRTC on every core
    assert build() == b"ptx 1" and len(compiled) == 1  # read back, not compiled
    refuse.add(b"ptx 1")  # a damaged kept file
    assert build() == b"ptx 2" and len(compiled) == 2
    assert build() == b"ptx 2" and len(compiled) == 2  # kept again
    # What the binary depends on, each in the key: another architecture, NVRTC, output,
    # NVRTC's threads.
    _fake_cupy(monkeypatch, compiled, refuse, arch="100")
    assert build() == b"ptx 3"
    _fake_cupy(monkeypatch, compiled, refuse, version=(13, 0))
    assert build() == b"ptx 4"
    monkeypatch.setenv("CUPY_COMPILE_WITH_PTX", "1")
    assert build() == b"ptx 5" and build() == b"ptx 5"
    monkeypatch.setenv(gpu_kernels.ENV_SPLIT, "0")
    assert build() == b"ptx 6" and "--split-compile=0" not in compiled[-1]
    _fake_cupy(monkeypatch, compiled, refuse, version=None)
    kept = sorted(p.name for p in tmp_path.glob("*.nvrtc"))
    assert build() == b"ptx 7" and build() == b"ptx 8"
    assert sorted(p.name for p in tmp_path.glob("*.nvrtc")) == kept, "nothing kept"
    chunk_pass._module.cache_clear()


def test_an_nvrtc_without_split_compilation_compiles_on_one_thread(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    compiled = []
    _fake_cupy(monkeypatch, compiled, set(), split_ok=False)
    path = gpu_kernels.module_file("codec")
    assert path.read_bytes() == b"ptx 1" and "--split-compile=0" not in compiled[0]
    assert gpu_kernels.module_file("codec") == path and len(compiled) == 1


def test_a_build_dir_that_cannot_be_written_compiles_once_into_a_file_of_its_own(
    tmp_path, monkeypatch
):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path / "file" / "below"))
    compiled = []
    _fake_cupy(monkeypatch, compiled, set())
    path = gpu_kernels.module_file("codec")
    assert path.read_bytes() == b"ptx 1" and len(compiled) == 1
