"""Dependencies point one way: ``leto`` never imports its tools (faultkit, verifiers,
nvbit_tools' consumers are the other way round). Checked twice: statically, every
import statement anywhere in ``leto/`` (functions included), and at run time, importing
every ``leto`` module in a fresh interpreter leaves faultkit and verifiers unloaded.

And the process model (issue 48): what runs in the training script (``leto.trainer``)
imports nothing ``leto run``'s agent runs (``leto.launch``), nor the reverse; what both
share (``leto.job``), the checks (``leto.integrity``), the updater, the codec and the
state manager import neither; no package imports back into one that imports it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

LETO = Path(__file__).resolve().parents[1] / "leto"
TOOLS = ("faultkit", "verifiers")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def test_no_leto_module_imports_a_tool():
    bad = [
        f"{p.relative_to(LETO.parent)}:{line} imports {mod}"
        for p in sorted(LETO.rglob("*.py"))
        for line, mod in _imports(p)
        if mod.split(".")[0] in TOOLS
    ]
    assert not bad, "leto must not import its tools:\n" + "\n".join(bad)


def test_importing_all_of_leto_loads_no_tool():
    code = (
        "import importlib, importlib.util, pkgutil, sys, leto\n"
        "for m in pkgutil.walk_packages(leto.__path__, 'leto.'):\n"
        "    if m.name.startswith('leto.titan.') and importlib.util.find_spec('torchtitan') is None:\n"
        "        continue  # leto.titan's modules import torchtitan (the [titan] extra)\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        f"print(sorted(t for t in {TOOLS!r} if t in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", f"tools loaded by importing leto: {p.stdout.strip()}"


# package -> packages it must not import (statically, anywhere in its modules)
FORBIDDEN = {
    "leto.trainer": ("leto.launch",),
    "leto.launch": ("leto.trainer",),
    "leto.job": (
        "leto.launch",
        "leto.trainer",
        "leto.preinit",
        "leto.update",
        "leto.integrity",
        "leto.erasure",
    ),
    "leto.integrity": ("leto.launch", "leto.trainer"),
    "leto.update": ("leto.launch", "leto.trainer"),
    "leto.memory": ("leto.launch", "leto.trainer", "leto.update", "leto.integrity", "leto.job"),
    "leto.erasure": ("leto.launch", "leto.trainer", "leto.update", "leto.integrity", "leto.memory"),
    "leto.preinit": ("leto.launch", "leto.trainer"),
}


def _package(path: Path) -> str:
    return ".".join(path.relative_to(LETO.parent).with_suffix("").parts)


def test_the_trainer_and_the_launcher_import_only_what_their_process_runs():
    bad = [
        f"{p.relative_to(LETO.parent)}:{line} imports {mod}"
        for p in sorted(LETO.rglob("*.py"))
        for src, forbidden in FORBIDDEN.items()
        if _package(p) == src or _package(p).startswith(src + ".")
        for line, mod in _imports(p)
        if any(mod == f or mod.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, "imports across the process model:\n" + "\n".join(bad)


def test_no_two_modules_import_each_other():
    # Module-level cycles, typing-only imports included (they are cycles to a reader).
    graph: dict[str, set[str]] = {}
    for p in LETO.rglob("*.py"):
        name = _package(p).removesuffix(".__init__")
        graph[name] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from leto.erasure import field``: the submodule, not the package
                graph[name] |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names}
    for deps in graph.values():
        # a submodule imported by name counts as that module, not its package
        subs = {d for d in deps if d in graph and d.rsplit(".", 1)[0] in deps}
        deps -= {d.rsplit(".", 1)[0] for d in subs}
        deps &= set(graph)
    pairs = sorted(
        f"{a} <-> {b}"
        for a, deps in graph.items()
        for b in deps
        if b in graph and a < b and a in graph[b]
    )
    assert not pairs, "modules that import each other:\n" + "\n".join(pairs)
