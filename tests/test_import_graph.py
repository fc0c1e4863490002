"""Dependencies point one way: ``leto`` never imports its tools (faultkit, verifiers,
nvbit_tools' consumers are the other way round). Checked twice: statically, every
import statement anywhere in ``leto/`` (functions included), and at run time, importing
every ``leto`` module in a fresh interpreter leaves faultkit and verifiers unloaded."""

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
