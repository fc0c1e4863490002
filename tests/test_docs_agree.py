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
