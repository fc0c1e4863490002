"""Scenario grids and sweeps built from profiles: the paper's Fig. 14/15 grid (deployment x
MTTF x HOF ratio, Leto beside Gemini+), the checkpoint-interval sweep (Fig. 9) and the
HOF-ratio sweep (Fig. 10), each as plain rows (dicts) for tables, JSON and plots.

Runs in any process. Intervals follow the paper's method (``model.choose_interval``);
an explicit interval overrides it. Not covered: MoEvement's sparse windows and
JIT-Checkpointing, which the paper's simulations do not use.
"""

from __future__ import annotations

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
