"""Leto's CUDA modules compiled at run time (NVRTC through CuPy), built once per machine
and, on a machine that has not built them yet, ahead of the trainers.

Runs in a trainer (``load``: the erasure codec's ``gf_matmul.cu``, the update's
``chunk_pass.cu``) and in the processes ``leto run`` starts beside its zygote
(``python -m leto.gpu_kernels NAME``, ``start_prebuilds``). No torch here: a prebuild
must not spend its first seconds importing it.

Each module's binary is kept under ``leto.native``'s build dir, named by a hash of what
it depends on (its source and headers, NVRTC's options and version, CuPy's version, the
device's architecture), so it is compiled once per machine. On an H100 (2026-12-05) the
two took 21 s of NVRTC (the codec 15.9 s, the chunk pass 5.3 s) inside a first trainer's
``leto.init()`` on a machine that had built neither. ``leto run`` (on a GPU) therefore
starts one prebuild process per module as it starts: they compile side by side while
the zygote imports torch (7-8 s there; 12 s beside NVRTC on every core). Whoever
compiles a module holds its lock file (``flock``), so a trainer that needs it meanwhile
waits for that build instead of compiling it again; where the binary is kept, a prebuild exits at once, having loaded
nothing onto the GPU (its memory use there was not measured).

Not covered: machines whose GPUs differ in architecture (the prebuild compiles for
device 0; a trainer on another compiles its own, as before); cleaning old binaries.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from leto import native

MODULES = ("codec", "chunk_pass", "grad_clip")
LOCK_TIMEOUT_S = 300.0  # past it, a trainer compiles the module itself (and says so)
ENV_PREBUILD = "LETO_PREBUILD"  # 0: leto run starts no prebuild
ENV_SPLIT = "LETO_NVRTC_SPLIT"  # 0: NVRTC optimizes on one thread


# The resumable chunk pass's build (chunk_pass.cu): units a thread saves and writes per
# step, and its L2 cache policies (2: the slots kept, the state streamed). The host's
# ItemLog layout follows the units (leto.update.chunk_pass.STEP_UNITS). On an H100
# (2026-12-06) two units a step with the policies took the least time (bench.resumable_pass);
# the variables pick others for benchmarks.
ENV_RF_UNITS, ENV_RF_HINTS = "LETO_RF_UNITS", "LETO_RF_HINTS"


def rf_units() -> int:
    g = int(os.environ.get(ENV_RF_UNITS, "2"))
    if not 1 <= g <= 8:
        raise ValueError(f"{ENV_RF_UNITS}={g}: from 1 to 8 units a step")
    return g


def rf_hints() -> int:
    h = int(os.environ.get(ENV_RF_HINTS, "2"))
    if h not in (0, 1, 2):
        raise ValueError(f"{ENV_RF_HINTS}={h}: 0 (none), 1 (evict-first state), 2 (L2 policies)")
    return h


def _spec(name: str) -> tuple[str, tuple[str, ...], list[str]]:
    """(source, NVRTC options, the headers' texts) of module ``name``."""
    kernels = resources.files("leto.erasure.kernels")  # gf_horner.cuh
    tripwire = resources.files("nvbit_tools")  # tripwire.cuh (nvbit_tools.tripwire: torch)
    headers = [kernels.joinpath("gf_horner.cuh"), tripwire / "tripwire.cuh"]
    if name == "codec":
        source = kernels.joinpath("gf_matmul.cu").read_text()
        opts = ("-std=c++17", f"-I{tripwire}", f"-I{kernels}")
    elif name == "chunk_pass":
        # IEEE denormals (``-ftz=false``), as torch builds its kernels: why is in
        # leto.update.chunk_pass.
        source = resources.files("leto.update").joinpath("chunk_pass.cu").read_text()
        opts = ("-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
                "-fmad=true", f"-I{tripwire}", f"-I{kernels}",
                f"-DLETO_RF_UNITS={rf_units()}", f"-DLETO_RF_HINTS={rf_hints()}")  # fmt: skip
    elif name == "grad_clip":
        # IEEE denormals (``-ftz=false``): the multiply torch's _foreach_mul_ does.
        source = resources.files("leto.update").joinpath("grad_clip.cu").read_text()
        opts = ("-std=c++17", "-ftz=false", f"-I{tripwire}", f"-I{kernels}")
    else:
        raise ValueError(f"no CUDA module {name!r}: one of {', '.join(MODULES)}")
    return source, opts, [h.read_text() for h in headers]


def module_file(name: str, again: bool = False) -> Path:
    """The file of module ``name`` compiled for the architecture of CuPy's current device
    (a prebuild's: device 0): kept, or compiled now under its lock (``again``: compiled
    anew, the kept file having failed to load). A build dir that cannot be written, or an NVRTC
    whose version is unknown (nothing kept), gets a file of this process's own."""
    import cupy
    from cupy.cuda import compiler

    source, opts, headers = _spec(name)
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc_version = str(nvrtc.getVersion())
    except Exception:  # NVRTC's version unknown: compiled here, nothing kept
        nvrtc_version = None
    cc = str(cupy.cuda.Device().compute_capability)  # (an attribute query; nothing is loaded)
    key = "\0".join([source, *headers, *opts, cupy.__version__, str(nvrtc_version), cc,
                     os.environ.get("CUPY_COMPILE_WITH_PTX", ""),
                     os.environ.get(ENV_SPLIT, "1")]).encode()  # fmt: skip

    def compile_() -> bytes:
        # A cubin for that architecture, or PTX with CUPY_COMPILE_WITH_PTX (in the key).
        # NVRTC's optimization passes on every core (--split-compile=0) where it takes
        # the option; as one thread where it does not.
        split = ("--split-compile=0",) if os.environ.get(ENV_SPLIT, "1") != "0" else ()
        try:
            out = compiler.compile_using_nvrtc(source, options=opts + split)
        except compiler.CompileException:
            if not split:
                raise
            out = compiler.compile_using_nvrtc(source, options=opts)
        if isinstance(out, tuple):  # (binary, name mapping) in CuPy >= 13
            out = out[0]
        return out if isinstance(out, bytes) else out.encode()

    if nvrtc_version is None:
        data = compile_()
    else:
        path = native.kept_path(name, key, "nvrtc")
        with _locked(f"{name}-sm{cc}", LOCK_TIMEOUT_S):
            if again:
                path.unlink(missing_ok=True)
            data = native.cached_bytes(name, key, compile_, suffix="nvrtc")
        if path.exists():
            return path
    own = Path(tempfile.mkdtemp(prefix="leto-kernels-")) / f"{name}.nvrtc"
    own.write_bytes(data)
    return own


def load(name: str, loader: Callable[[str], object]):
    """``loader(path)`` of module ``name``'s file (CuPy's current device); a kept file it
    cannot load (damaged) is compiled again once."""
    try:
        return loader(str(module_file(name)))
    except ImportError:
        raise
    except Exception:
        return loader(str(module_file(name, again=True)))


class _locked:
    """The module's lock file under the build dir, held while it is looked up or built;
    waited for up to ``wait_s`` (then built without it: two builds of one binary are
    wasteful, never wrong, its file appearing atomically)."""

    def __init__(self, stem: str, wait_s: float):
        self.stem, self.wait_s = stem, wait_s
        self.fd: int | None = None

    def __enter__(self):
        root = native.build_dir()
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(root / f".{self.stem}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return self  # a build dir that cannot be written: no lock, nothing kept
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    print(f"leto: {self.stem}: another process held its build for "
                          f"{self.wait_s:g} s; compiling it here", file=sys.stderr)  # fmt: skip
                    os.close(self.fd)
                    self.fd = None
                    return self
                time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (the lock goes with it)


def start_prebuilds(log_dir: str | Path) -> list[subprocess.Popen]:
    """One process per module, compiling it for device 0 now (``leto run`` on a GPU, at
    its start); their output in ``<log_dir>/prebuild.<name>.log``. Not waited for: a
    trainer that needs a module waits for its lock instead. ``LETO_PREBUILD=0``: none."""
    if os.environ.get(ENV_PREBUILD, "1") == "0":
        return []
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    procs = []
    for name in MODULES:
        with open(Path(log_dir) / f"prebuild.{name}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "leto.gpu_kernels", name],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
            )
    return procs


def stop_prebuilds(procs: list[subprocess.Popen]) -> None:
    """At the job's end: one still compiling is killed (its binary was not kept yet)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in MODULES:
        print(f"usage: python -m leto.gpu_kernels {{{','.join(MODULES)}}}", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        module_file(argv[0])
    except ImportError as e:  # (no CuPy: the trainers say what they lack)
        print(f"leto: prebuild of {argv[0]}: {e}; nothing built", flush=True)
        return 0
    print(f"leto: prebuild of {argv[0]}: kept in {time.time() - t0:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
