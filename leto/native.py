"""Building Leto's small native libraries (loaded with ctypes), one way for all of them.

Runs in whichever process first needs a library (a trainer). ``build_shared`` compiles
one source file into a shared object under ``$LETO_BUILD_DIR`` (default
``~/.cache/leto``), named by a hash of the source, the flags and anything else the
caller says the binary depends on (e.g. torch's version), so a changed input builds
anew and an unchanged one is reused; the file appears atomically, so ranks building at
once never load a partial one. A failed build raises ``InvalidInput`` with the command
and the compiler's message.

``cached_bytes`` keeps any other build product the same way (a kernel NVRTC compiles at
run time), read back by later processes.

Not covered: Python extension modules (``torch.utils.cpp_extension`` builds those);
cleaning old builds out of the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from leto.errors import InvalidInput

ENV_BUILD_DIR = "LETO_BUILD_DIR"


def compiler(env_var: str, names: Sequence[str], what: str) -> str:
    """The compiler ``$env_var`` names, else the first of ``names`` on PATH."""
    for name in (os.environ.get(env_var), *names):
        if name and (found := shutil.which(name)):
            return found
    raise InvalidInput(
        f"{what} needs a compiler ({' or '.join(names)}) on PATH; set {env_var} to one"
    )


def build_dir() -> Path:
    """Where builds are kept: ``$LETO_BUILD_DIR``, default ``~/.cache/leto``."""
    return Path(os.environ.get(ENV_BUILD_DIR, Path.home() / ".cache" / "leto"))


def build_shared(
    source: Path,
    stem: str,
    cc: str,
    flags: Sequence[str],
    link: Sequence[str] = (),
    depends_on: bytes = b"",
    timeout_s: float = 300,
) -> Path:
    """Compile ``source`` to ``<build dir>/<stem>-<hash>.so`` once; returns its path."""
    key = source.read_bytes() + " ".join([*flags, *link]).encode() + depends_on
    digest = hashlib.sha256(key).hexdigest()[:16]
    root = build_dir()
    lib = root / f"{stem}-{digest}.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cc, *flags, "-shared", "-o", str(out), str(source), *link]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise InvalidInput(
                f"compiling {source.name} failed (rc {proc.returncode}); command: "
                f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
            )
        os.replace(out, lib)  # atomic: a concurrent build never loads a partial file
    return lib


def kept_path(stem: str, inputs: bytes, suffix: str = "bin") -> Path:
    """Where ``cached_bytes`` keeps what it makes for ``inputs``."""
    return build_dir() / f"{stem}-{hashlib.sha256(inputs).hexdigest()[:16]}.{suffix}"


def cached_bytes(
    stem: str,
    inputs: bytes,
    make: Callable[[], bytes],
    suffix: str = "bin",
) -> bytes:
    """What ``make()`` returns for ``inputs`` (everything the result depends on), kept
    under the build dir as ``<stem>-<hash>.<suffix>`` and read back in later processes:
    a kernel compiled at run time (NVRTC) is compiled once per machine, not once per
    trainer and shadow. A cache that cannot be written is no error (the bytes are
    returned, and the next process makes them again). A kept file its caller cannot load
    (damaged) is the caller's to remove (``leto.gpu_kernels.load``)."""
    path = kept_path(stem, inputs, suffix)
    root = path.parent
    try:
        kept = path.read_bytes()
    except OSError:
        kept = None
    if kept is not None:
        return kept
    data = make()
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=f".{stem}-", delete=False) as f:
            tmp = f.name
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees a partial file
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return data
