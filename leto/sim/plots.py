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


def scenario_bars(rows: list[dict], path: str | Path) -> Path:
    """Bars of ETTR (%) per (deployment, HOF ratio), one bar per system, one panel per
    MTTF (all the table's, top to bottom). Each tick is a HOF ratio; the deployment is
    named once under its group of ticks (repeated under each, the names overlapped)."""
    mttfs = sorted({r["mttf_s"] for r in rows})
    systems = sorted({r["system"] for r in rows})
    deployments = list(dict.fromkeys(r["deployment"] for r in rows))
    hofs = sorted({r["hof_ratio"] for r in rows})
    gap = 0.6  # between deployments' groups of bars, in ticks
    xs = {
        (d, h): i * (len(hofs) + gap) + k
        for i, d in enumerate(deployments)
        for k, h in enumerate(hofs)
    }
    width = 0.8 / max(len(systems), 1)
    low = min(r["ettr"] for r in rows) * 100
    fig, axes = plt.subplots(
        len(mttfs), 1, figsize=(max(6.0, len(xs) * 0.75), 2.6 * len(mttfs) + 0.6),
        sharex=True, squeeze=False,
    )  # fmt: skip
    for ax, mttf in zip(axes[:, 0], mttfs, strict=True):
        at = [r for r in rows if r["mttf_s"] == mttf]
        for k, s in enumerate(systems):
            pts = [
                (xs[(r["deployment"], r["hof_ratio"])], r["ettr"] * 100)
                for r in at
                if r["system"] == s
            ]
            ax.bar([x + (k - (len(systems) - 1) / 2) * width for x, _ in pts], [y for _, y in pts],
                   width, label=s, color=f"C{k}")  # fmt: skip
        ax.set_ylabel("ETTR (%)")
        ax.set_ylim(max(0, min(50, low - 5)), 100)
        ax.set_title(f"MTTF {mttf / 60:.0f} min", fontsize=9, loc="left")
        ax.grid(axis="y", alpha=0.3)
    # Above the panels: inside one, it covered bars.
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", bbox_to_anchor=(0.97, 0.995),
               ncol=len(systems), fontsize=8, frameon=False)  # fmt: skip
    bottom = axes[-1, 0]
    bottom.set_xticks(list(xs.values()))
    bottom.set_xticklabels([f"{h:.0%}" for _, h in xs], fontsize=8)
    bottom.annotate("HOF ratio", (0, 0), xycoords="axes fraction", xytext=(-4, -4),
                    textcoords="offset points", ha="right", va="top", fontsize=8)  # fmt: skip
    for i, d in enumerate(deployments):
        mid = i * (len(hofs) + gap) + (len(hofs) - 1) / 2
        bottom.annotate(d, (mid, 0), xycoords=("data", "axes fraction"), xytext=(0, -20),
                        textcoords="offset points", ha="center", va="top", fontsize=9)  # fmt: skip
    fig.suptitle("Simulated ETTR (paper Fig. 14/15)", x=0.05, ha="left")
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
