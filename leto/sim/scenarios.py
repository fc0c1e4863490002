"""Scenario grids and sweeps built from profiles: the paper's Fig. 14/15 grid (deployment x
MTTF x HOF ratio, Leto beside Gemini+), the checkpoint-interval sweep (Fig. 9) and the
HOF-ratio sweep (Fig. 10), each as plain rows (dicts) for tables, JSON and plots.

Runs in any process. Intervals follow the paper's method (``model.choose_interval``);
an explicit interval overrides it. Not covered: MoEvement's sparse windows and
JIT-Checkpointing, which the paper's simulations do not use.
"""

from __future__ import annotations

from dataclasses import replace

from leto.errors import InvalidInput
from leto.sim.events import simulate
from leto.sim.model import Job, choose_interval, predict
from leto.sim.profiles import SCENARIOS, load_deployment, load_systems, published
from leto.sim.schedule import Schedule

MTTFS_S = (600.0, 1800.0, 3600.0)  # §8.6 and Appendix B: 10 min, 30 min, 1 h
HOF_RATIOS = (0.0, 0.5, 1.0)  # §8.6
SYSTEMS = ("leto", "gemini+")


def _row(dep, system, job, interval: int) -> dict:
    p = predict(job, system, interval)
    return {
        "deployment": dep.name,
        "system": system.name,
        "mttf_s": job.mttf_s,
        "hof_ratio": job.hof_ratio,
        "interval": interval,
        "t_iter_s": dep.t_iter_s,
        "ckpt_p": dep.ckpt_p,
        "t_eff_s": p.t_eff_s,
        "t_rec_s": p.t_rec_s,
        "ettr": p.ettr,
    }


def scenario_grid(
    deployments=SCENARIOS, mttfs_s=MTTFS_S, hof_ratios=HOF_RATIOS, systems=SYSTEMS
) -> list[dict]:
    """Analytic ETTR for every (deployment, MTTF, HOF ratio, system), with the paper's
    published value beside it where Fig. 14 gives one (``paper_ettr``, else None)."""
    sys_by_name = load_systems()
    pub = published()["fig14_mttf_600s"]
    rows = []
    for name in deployments:
        dep = load_deployment(name)
        for m in mttfs_s:
            for h in hof_ratios:
                job = Job(dep.t_iter_s, dep.ckpt_p, m, h)
                for s in systems:
                    system = sys_by_name[s]
                    row = _row(dep, system, job, choose_interval(job, system, dep.max_interval))
                    cell = pub.get(dep.name, {}).get(str(float(h))) if m == 600.0 else None
                    row["paper_ettr"] = (
                        cell[SYSTEMS.index(s)] / 100 if cell and s in SYSTEMS else None
                    )
                    rows.append(row)
    return rows


def sweep_interval(
    deployment: str, intervals, mttf_s: float = 600.0, hof_ratio: float = 1.0, systems=SYSTEMS
) -> list[dict]:
    """ETTR against the checkpoint interval (Fig. 9: one HOF every 10 minutes)."""
    dep = load_deployment(deployment)
    sys_by_name = load_systems()
    job = Job(dep.t_iter_s, dep.ckpt_p, mttf_s, hof_ratio)
    return [_row(dep, sys_by_name[s], job, int(i)) for s in systems for i in intervals]


def sweep_hof(deployment: str, hof_ratios, mttf_s: float = 600.0, systems=SYSTEMS) -> list[dict]:
    """ETTR against the HOF ratio (Fig. 10), intervals re-chosen per ratio (§8.1)."""
    dep = load_deployment(deployment)
    sys_by_name = load_systems()
    rows = []
    for s in systems:
        for h in hof_ratios:
            job = Job(dep.t_iter_s, dep.ckpt_p, mttf_s, float(h))
            rows.append(
                _row(
                    dep, sys_by_name[s], job, choose_interval(job, sys_by_name[s], dep.max_interval)
                )
            )
    return rows


def replay(
    deployment: str, schedule: Schedule, systems=SYSTEMS, interval: int | None = None
) -> list[dict]:
    """Simulate ``schedule`` on ``deployment`` for each system, with the analytic ETTR at
    the schedule's realised failure rate and HOF fraction beside it."""
    dep = load_deployment(deployment)
    sys_by_name = load_systems()
    n = len(schedule.failures)
    mttf = schedule.duration_s / n if n else float("inf")
    h = schedule.hof_count / n if n else 1.0
    rows = []
    for s in systems:
        system = sys_by_name[s]
        job = Job(dep.t_iter_s, dep.ckpt_p, mttf if n else 1e30, h)
        i = interval or choose_interval(job, system, dep.max_interval)
        r = simulate(schedule, system, dep.t_iter_s, dep.ckpt_p, i, dep.gpus)
        rows.append(
            {
                "deployment": dep.name,
                "system": s,
                "interval": i,
                "failures": n,
                "hof": schedule.hof_count,
                "ettr": r.ettr,
                "model_ettr": predict(job, system, i).ettr,
                "mean_recovery_s": r.mean_recovery_s(),
                "mean_hof_recovery_s": r.mean_recovery_s("HOF"),
                "mean_ff_recovery_s": r.mean_recovery_s("FF"),
                "detection_s": sum(x.detection_s for x in r.failures),
                "init_s": sum(x.init_s for x in r.failures),
                "recompute_s": sum(x.recompute_s for x in r.failures),
                "recovery_restarts": r.recovery_restarts,
                "during_recompute": r.during_recompute,
                "wasted_gpu_hours": r.wasted_gpu_hours,
                "recovery_gpu_hours": r.recovery_gpu_hours,
            }
        )
    return rows


# RMU overhead (omega) against tier-1 parity pages, measured on the H200 against the loop
# users run (docs/benchmarks.md, 1.01 B GPT, bf16 autocast, 16 K tokens per iteration):
# H1 = 4: +10.8 %, H1 = 16: +21.7 %. Callers pass their own with --omega.
OMEGA_H200_16K = {4: 0.108, 16: 0.217}


def sweep_h1(
    deployment: str,
    omega_by_h1: dict[int, float],
    pages_per_error: dict[int, float],
    memory_fraction: float,
    mttf_s: float = 600.0,
    hof_ratio: float = 1.0,
) -> list[dict]:
    """What each number of tier-1 parity pages H1 buys (issue 15: the ETTR model picks
    it). A HOF that retires device pages loses ``b`` pages of one protection group, with
    ``P(b) = pages_per_error[b]``; a ``memory_fraction`` of HOFs do. Within ``H1`` pages
    the HOF is recovered in place; beyond, parity cannot rebuild the group and it becomes
    a fatal failure (the checkpoint path). Fewer rows cost less every iteration
    (``omega_by_h1``, measured) but turn more HOFs into FFs:

    ``h_eff(H1) = h * (1 - memory_fraction * P(b > H1))``,
    ``ETTR(H1) = Eq. 6 with omega(H1), h_eff(H1)``, the FF interval by Young at the
    FF-only MTTF ``M / (1 - h_eff)``. The best row has ``best`` set."""
    if not omega_by_h1:
        raise InvalidInput("give at least one H1 with its measured overhead (--omega H1=FRACTION)")
    total = sum(pages_per_error.values())
    if not pages_per_error or abs(total - 1.0) > 1e-6 or min(pages_per_error.values()) < 0:
        raise InvalidInput(
            f"--pages-per-error probabilities must be >= 0 and sum to 1 (got {total:.6g})"
        )
    if not 0.0 <= memory_fraction <= 1.0:
        raise InvalidInput(f"--memory-fraction {memory_fraction}: expected a fraction in [0, 1]")
    dep = load_deployment(deployment)
    leto = load_systems()["leto"]
    rows = []
    for h1, omega in sorted(omega_by_h1.items()):
        beyond = sum(p for b, p in pages_per_error.items() if b > h1)
        h_eff = hof_ratio * (1.0 - memory_fraction * beyond)
        job = Job(dep.t_iter_s, dep.ckpt_p, mttf_s, h_eff)
        system = replace(leto, omega=omega)
        row = _row(dep, system, job, choose_interval(job, system, dep.max_interval))
        row.update(h1=h1, omega=omega, hof_beyond_h1=beyond * memory_fraction * hof_ratio)
        rows.append(row)
    best = max(rows, key=lambda r: r["ettr"])
    for r in rows:
        r["best"] = r is best
    return rows
