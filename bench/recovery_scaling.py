"""How HOF recovery time grows with state size: ``bench.recovery_speed`` results at
several model sizes (one JSON each, e.g. ``bench/gpu_suite.sh scale``), as one table
with the recovering trainer's steps and one PNG (failure → progress regained against
parameters, one line per variant).

    python -m bench.recovery_scaling out/scale_1b.json out/scale_3b.json \\
        --png docs/img/recovery_scaling_h200.png

Reads results cut short by a time limit too (the variants that finished).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

BASELINE = "torchrun + checkpoint"
# The recovering trainer's steps, as its record names them (leto.trainer.api); the
# parity wait is how long resume waited for a deferred host parity scan (premapped).
STEPS = (
    "attach_localize_s", "map_retained_s", "localize_parity_wait_s", "finish_update_s",
    "reconstruct_s", "agree_s",
)  # fmt: skip


def load(paths: list[str]) -> list[dict]:
    """One point per file, by parameter count; a file without it is refused by name."""
    points = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        if "parameters" not in d or not d.get("variants"):
            raise SystemExit(f"{p}: no parameter count or no finished variant in it")
        points.append({"file": p, "parameters": d["parameters"], "variants": d["variants"]})
    return sorted(points, key=lambda q: q["parameters"])


def table(points: list[dict]) -> Table:
    t = Table(title="HOF recovery against state size (fp32 + AdamW: 16 B a parameter)")
    cols = ("parameters", "variant", "regained", "vs baseline", "to training", "iteration")
    for c in (*cols, *STEPS, "premapped", "exact"):
        t.add_column(c)
    for q in points:
        base = q["variants"].get(BASELINE, {}).get("regained_s")
        for name, r in q["variants"].items():
            steps = next(iter(r["record"].get("trainers", {}).values()), {})
            t.add_row(
                f"{q['parameters'] / 1e9:.2f} B",
                name,
                f"{r['regained_s']:.2f} s",
                f"{base / r['regained_s']:.1f}×" if base and name != BASELINE else "—",
                f"{r['to_training_s']:.2f} s" if r.get("to_training_s") else "-",
                _interrupted(r, steps),
                *(f"{steps[s]:.3f}" if s in steps else "-" for s in STEPS),
                str(r.get("premapped")),
                "EXACT" if r["exact"] else "NOT EXACT",
            )
    return t


def _interrupted(r: dict, steps: dict) -> str:
    """What became of the iteration the failure struck: its update finished from the
    chunks already committed, or the whole iteration redone (the kill came before its
    first chunk committed; forward and backward are lost work then) — or, for the
    baseline, recomputed from its checkpoint."""
    if "next_iteration" not in steps or "fail_at" not in r:
        return "-"
    if r["record"].get("level") == "checkpoint":
        return f"from checkpoint @ {steps['next_iteration']}"
    return "update finished" if steps["next_iteration"] > r["fail_at"] else "redone"


def plot(points: list[dict], path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = [n for q in points for n in q["variants"]]
    for name in dict.fromkeys(names):  # first-seen order
        rows = [
            (q["parameters"] / 1e9, q["variants"][name]) for q in points if name in q["variants"]
        ]
        xs, ys = [x for x, _ in rows], [r["regained_s"] for _, r in rows]
        ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == BASELINE else "-")
        for x, r in rows:
            steps = next(iter(r["record"].get("trainers", {}).values()), {})
            why = _interrupted(r, steps)
            note = " (iteration redone)" if why == "redone" else ""
            y = r["regained_s"]
            ax.annotate(
                f"{y:.2f} s{note}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
            )
    ax.set_yscale("log")
    ax.set_xlabel("parameters (billions; 16 bytes each retained)")
    ax.set_ylabel("failure → progress regained (s)")
    ax.set_title("HOF recovery time against state size, one GPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench.recovery_speed --json-out files")
    ap.add_argument("--png", default=None, help="write the plot here")
    args = ap.parse_args(argv)
    points = load(args.results)
    Console(width=200).print(table(points))
    if args.png:
        print(f"plot: {plot(points, args.png)}")


if __name__ == "__main__":
    main()
