"""``faultkit inject`` end to end on the CPU build: the README's main job."""

from __future__ import annotations

import json
import subprocess
import sys


def inject(*args: str) -> tuple[int, str, str]:
    r = subprocess.run(
        [sys.executable, "-m", "faultkit.cli", "inject", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.returncode, r.stdout, r.stderr


def test_update_phase_with_16_lost_pages_per_group_is_exact():
    code, out, err = inject("--phase", "update", "--pages", "16", "--json")
    assert code == 0, err
    v = json.loads(out)
    assert v["exact"] and v["first_divergence"] is None
    assert v["pages_rebuilt"] == v["pages_lost_device"] > 2 * 16, v
    assert v["recoveries"] == 1 and v["recovery_s"] > 0
    assert (
        "memfd truncation" in v["poison_mechanism"]["device"]
        or "HWPOISON" in v["poison_mechanism"]["device"]
    )


def test_more_pages_than_parity_covers_ends_in_the_fatal_path():
    code, out, _ = inject("--phase", "parity-copy", "--pages", "17", "--json")
    v = json.loads(out)
    assert code == 1 and v["fatal"] and not v["exact"]
    assert "checkpoint fallback" in v["fatal_detail"]


def test_host_parity_pages_and_another_rank():
    code, out, err = inject(
        "--phase",
        "grad-parity",
        "--pages",
        "3",
        "--host-parity-pages",
        "1",
        "--rank",
        "1",
        "--json",
    )
    assert code == 0, err
    v = json.loads(out)
    assert v["exact"] and v["host_pages_rebuilt"] == v["pages_lost_host"] == 2


def test_bad_options_are_refused_with_a_reason():
    code, _, err = inject("--phase", "nowhere")
    assert code == 2 and "--phase 'nowhere'" in err
    code, _, err = inject("--mode", "kernel-abort")
    assert code == 2 and "not available yet" in err


def test_table_output_names_the_verdict():
    code, out, _ = inject("--phase", "sync", "--iterations", "4")
    assert code == 0 and "EXACT" in out and "first divergence" in out
