"""``leto.native.cached_bytes``: a run-time build product (the chunk pass's NVRTC
binary) made once per machine and read back by later processes."""

import os

import pytest

from leto import native


def test_made_once_then_read_back_and_a_changed_input_makes_it_anew(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    made = []

    def make(tag):
        def f():
            made.append(tag)
            return f"binary {tag}".encode()

        return f

    assert native.cached_bytes("k", b"source 1", make(1)) == b"binary 1"
    assert native.cached_bytes("k", b"source 1", make(2)) == b"binary 1"  # read back
    assert native.cached_bytes("k", b"source 2", make(3)) == b"binary 3"  # another key
    assert made == [1, 3]
    # One file per key, no temporary file left behind.
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["k", "k"]


def test_a_cache_that_cannot_be_written_still_gives_the_bytes(tmp_path, monkeypatch):
    root = tmp_path / "ro"
    root.mkdir()
    os.chmod(root, 0o500)
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(root))
    try:
        if os.access(root, os.W_OK):  # (root ignores the mode: a file in its place)
            monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path / "file" / "below"))
            (tmp_path / "file").write_text("not a folder")
        calls = []
        for _ in range(2):
            got = native.cached_bytes("k", b"src", lambda: calls.append(1) or b"made")
            assert got == b"made"
        assert len(calls) == 2  # nothing kept: made each time, no error
    finally:
        os.chmod(root, 0o700)


def test_kept_bytes_the_caller_cannot_use_are_made_again_and_fresh_ones_raise(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    made, used = [], []

    def make(tag):
        return lambda: made.append(tag) or f"binary {tag}".encode()

    def use(data):
        if data == b"binary 1":  # as a driver refuses a damaged file
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
        used.append(data)

    assert native.cached_bytes("k", b"src", make(1)) == b"binary 1"  # kept, not used
    assert native.cached_bytes("k", b"src", make(2), use=use) == b"binary 2"
    assert native.cached_bytes("k", b"src", make(3), use=use) == b"binary 2"  # kept again
    assert made == [1, 2] and used == [b"binary 2", b"binary 2"]

    def refuse(data):
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):  # just made: the caller's error
        native.cached_bytes("k", b"other", make(4), use=refuse)


def _fake_cupy(monkeypatch, compiled: list, refuse: set, version=(12, 8), arch="90"):
    """Stand-ins for the CuPy pieces ``chunk_pass._module`` uses: a compiler that
    counts its calls and a module loader that refuses the binaries in ``refuse``."""
    import sys
    import types

    def compile_using_nvrtc(src, options=()):
        compiled.append(options)
        return f"ptx {len(compiled)}"  # PTX comes back as text

    class Module:
        def load(self, binary):
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
    cuda.compiler = types.SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc)
    cuda.function = types.SimpleNamespace(Module=Module)
    cuda.Device = lambda: types.SimpleNamespace(compute_capability=arch)
    cupy.cuda = cuda
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = types.SimpleNamespace(getVersion=get_version)
    for name, mod in {"cupy": cupy, "cupy.cuda": cuda, "cupy_backends": types.ModuleType("x"),
                      "cupy_backends.cuda": types.ModuleType("y"),
                      "cupy_backends.cuda.libs": libs}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)


def test_the_chunk_pass_kernel_is_compiled_once_a_machine(tmp_path, monkeypatch):
    # The logic of leto.update.chunk_pass._module, on the CPU: compiled by the first
    # process (each _module() call here stands for one), read back by later ones; a kept
    # binary the driver refuses is compiled and kept again; an NVRTC whose version is
    # unknown compiles every time and keeps nothing.
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
    assert build() == b"ptx 1" and len(compiled) == 1  # read back, not compiled
    refuse.add(b"ptx 1")  # a damaged kept file
    assert build() == b"ptx 2" and len(compiled) == 2
    assert build() == b"ptx 2" and len(compiled) == 2  # kept again
    # What the binary depends on, each in the key: another architecture, NVRTC, output.
    _fake_cupy(monkeypatch, compiled, refuse, arch="100")
    assert build() == b"ptx 3"
    _fake_cupy(monkeypatch, compiled, refuse, version=(13, 0))
    assert build() == b"ptx 4"
    monkeypatch.setenv("CUPY_COMPILE_WITH_PTX", "1")
    assert build() == b"ptx 5" and build() == b"ptx 5"
    _fake_cupy(monkeypatch, compiled, refuse, version=None)
    assert build() == b"ptx 6" and build() == b"ptx 7"
    chunk_pass._module.cache_clear()
