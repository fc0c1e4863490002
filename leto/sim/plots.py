"""PNG plots of simulator rows (matplotlib, Agg backend: no display needed).

Owns the three figures the CLI draws: grouped ETTR bars per deployment and HOF ratio
(the layout of the paper's Fig. 14/15), ETTR against checkpoint interval (Fig. 9) and
ETTR against HOF ratio (Fig. 10). Runs in the CLI process; writes one file per call and
returns its path. Not covered: styling to match the paper's figures exactly.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def scenario_bars(rows: list[dict], mttf_s: float, path: str | Path) -> Path:
    """Bars of ETTR (%) per (deployment, HOF ratio), one bar per system, at ``mttf_s``."""
    rows = [r for r in rows if r["mttf_s"] == mttf_s]
    systems = sorted({r["system"] for r in rows})
    groups = sorted({(r["deployment"], r["hof_ratio"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, len(groups) * 0.9), 3.5))
    width = 0.8 / max(len(systems), 1)
    for k, s in enumerate(systems):
        ys = [
            next(
                r["ettr"]
                for r in rows
                if (r["deployment"], r["hof_ratio"]) == g and r["system"] == s
            )
            * 100
            for g in groups
        ]
        ax.bar([i + k * width for i in range(len(groups))], ys, width, label=s)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{d}\n{h:.0%} HOF" for d, h in groups], fontsize=7)
    ax.set_ylabel("ETTR (%)")
    ax.set_ylim(50, 100)
    ax.set_title(f"Simulated ETTR, MTTF {mttf_s / 60:.0f} min")
    ax.legend()
    return _save(fig, path)


def lines(rows: list[dict], x: str, path: str | Path, xlabel: str, title: str) -> Path:
    """ETTR (%) against column ``x``, one line per system."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for s in sorted({r["system"] for r in rows}):
        pts = sorted((r[x], r["ettr"] * 100) for r in rows if r["system"] == s)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ETTR (%)")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)
