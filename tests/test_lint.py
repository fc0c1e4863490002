"""The tree passes ruff (part of the test command so CI enforces it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed; it is part of the dev extra: pip install -e '.[dev]'")
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
