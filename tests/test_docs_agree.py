"""The docs say each thing once and agree with the code: the number of changes a port
makes, and the one list of fault points (``leto.plugins.FAULT_POINTS``)."""

from __future__ import annotations

import re
from pathlib import Path

from leto.plugins import FAULT_POINTS

ROOT = Path(__file__).resolve().parents[1]
NUMBERS = {"three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def _changes(text: str) -> set[int]:
    return {NUMBERS[m.lower()] for m in re.findall(r"\b(\w+) changes\b", text) if m.lower() in NUMBERS}


def test_the_readme_and_the_porting_guide_count_the_same_changes():
    readme = _changes((ROOT / "README.md").read_text())
    porting = _changes((ROOT / "docs" / "porting.md").read_text())
    assert readme and readme == porting, (readme, porting)


def test_the_fault_points_are_listed_once_and_as_the_code_has_them():
    runtime = (ROOT / "docs" / "runtime.md").read_text()
    rows = runtime.split("| point | where | reached |", 1)[1].split("\n\n", 1)[0]
    table = re.findall(r"^\| `([\w.]+)` \|", rows, re.M)
    assert tuple(table) == FAULT_POINTS, table
    readme = (ROOT / "README.md").read_text()
    listed = [p for p in FAULT_POINTS if f"`{p}`" in readme]
    assert len(listed) <= 2, f"the README lists fault points again: {listed}"


def test_the_porting_guides_code_uses_only_what_leto_has():
    # Every ctx.<name> and run.<name> in docs/porting.md's code blocks exists: a field
    # of leto.init()'s Context, or an attribute or method leto.Run sets or defines.
    import dataclasses
    import inspect

    from leto.trainer import run as run_module
    from leto.trainer.api import Context

    text = (ROOT / "docs" / "porting.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    fields = {f.name for f in dataclasses.fields(Context)} | {
        n for n, _ in inspect.getmembers(Context)
    }
    src = inspect.getsource(run_module.Run)
    has = set(re.findall(r"self\.(\w+) =", src)) | {n for n, _ in inspect.getmembers(run_module.Run)}
    for name in set(re.findall(r"\bctx\.(\w+)", code)):
        assert name in fields, f"porting.md uses ctx.{name}, which Context does not have"
    for name in set(re.findall(r"\brun\.(\w+)", code)):
        assert name in has, f"porting.md uses run.{name}, which leto.Run does not have"
    for shape in ("configure_optimizers(model)", "num_iterations - 1", "ctx.generation == 0"):
        assert shape in code, f"porting.md no longer shows {shape!r} in code"
