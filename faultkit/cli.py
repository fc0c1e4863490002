"""The ``faultkit`` command.

faultkit probe       which fault mechanisms this machine has (real or emulated)
faultkit inject      fault-free and faulted runs of the example job, bit-exact verdict
faultkit matrix      every phase x lost pages x host parity x mode, one shared reference
faultkit plan        write a failure schedule (JSON): every X s, Poisson, trace window
faultkit run-plan    replay a schedule against the example job, bit-exact verdict
faultkit certify     your own Leto script, fault-free and killed at every phase: EXACT?

Every argument is checked before anything runs (exit 2, the flag and its range named).
inject, matrix and run-plan print a line per stage on stderr as they go (the table or
the JSON on stdout at the end) and write their runs to a temporary work directory that
is removed at the end, also on SIGTERM or Ctrl-C (``--keep``, ``--workdir DIR`` or a
verdict that is not EXACT keep it: DIR/reference/train and DIR/<run>/train are what
``verifiers compare`` reads).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from faultkit.certify_cli import register as register_certify
from faultkit.cli_common import (
    UNDO_HELP,
    keep_if_not_exact,
    progress,
    refuse,
    workdir,
    workdir_flags,
)
from faultkit.schedule_cli import register as register_plan
from leto.job.config import DEFAULT_SHADOW_LEVEL, UNDO_MODES
from leto.memory.mechanisms import probe


def cmd_probe(args: argparse.Namespace) -> int:
    m = probe()
    if args.json:
        print(json.dumps(m.as_dict()))
        return 0
    table = Table(title="faultkit probe: mechanisms on this machine")
    table.add_column("fault")
    table.add_column("mechanism used")
    table.add_column("why")
    table.add_row("host page poisoning", m.host_poison, m.host_poison_why)
    table.add_row("device page loss", m.device_page_loss, m.device_page_loss_why)
    Console().print(table)
    return 0


def _config(args: argparse.Namespace):
    from faultkit.inject import InjectConfig

    return InjectConfig(
        phase=getattr(args, "phase", "any"),
        pages=getattr(args, "pages", 0),
        host_parity_pages=getattr(args, "host_parity_pages", 0),
        mode=getattr(args, "mode", "kill"),
        rank=getattr(args, "rank", 0),
        iterations=args.iterations,
        seed=args.seed,
        world_size=args.world_size,
        device=args.device,
        ranks_per_gpu=getattr(args, "ranks_per_gpu", 1),
        all_ranks=getattr(args, "all_ranks", False),
        every=getattr(args, "every", 0),
        shadow_level=args.shadow_level,
        abort_after_blocks=getattr(args, "abort_after_blocks", 3),
        parallel=getattr(args, "parallel", "dp"),
        replica_check=not getattr(args, "no_replica_check", False),
        replay=not getattr(args, "no_replay", False),
        undo=getattr(args, "undo", "chunk"),
    )


def cmd_inject(args: argparse.Namespace) -> int:
    from faultkit.inject import check, inject

    cfg = _config(args)
    try:
        check(cfg)  # before the work directory, before anything runs
    except ValueError as e:
        return refuse("inject", e, args)
    with progress("inject") as say, workdir(args, say) as (work, keep):
        try:
            v = inject(cfg, work)
        except (ValueError, RuntimeError) as e:
            return refuse("inject", e, args)
        keep_if_not_exact(keep, v["exact"])
        v["workdir_kept"] = bool(keep["why"])
    if args.json:
        print(json.dumps(v))
        return 0 if v["exact"] else 1
    return _verdict_table(v, "faultkit inject")


def cmd_matrix(args: argparse.Namespace) -> int:
    from faultkit.inject import matrix, matrix_cases

    cases = {
        "phases": tuple(args.phases.split(",")) if args.phases else None,
        "modes": tuple(args.modes.split(",")),
        "corrupt_pages": args.corrupt_pages,
        "losses": args.losses,
    }
    try:
        matrix_cases(_config(args), **cases)  # every case checked before anything runs
    except ValueError as e:
        return refuse("matrix", e, args)
    with progress("matrix") as say, workdir(args, say) as (work, keep):
        try:
            rows = matrix(_config(args), work, **cases)
        except (ValueError, RuntimeError) as e:
            return refuse("matrix", e, args)
        keep_if_not_exact(keep, all(r["exact"] for r in rows))
    bad = [r for r in rows if not r["exact"]]
    if args.json:
        print(json.dumps({"exact": not bad, "cases": rows}))
        return 0 if not bad else 1
    t = Table(
        title=f"faultkit matrix ({args.parallel}"
        + (", every rank failing at once" if args.all_ranks else "")
        + f"): {len(rows) - len(bad)} of {len(rows)} EXACT"
    )
    for c in ("phase", "mode", "pages/group", "host parity", "rebuilt", "recovery", "verdict"):
        t.add_column(c)
    for r in rows:
        c = r["config"]
        t.add_row(
            r["phase"],
            r["mode"],
            str(c["pages"]),
            str(c["host_parity_pages"]),
            f"{r['pages_rebuilt']} dev, {r['host_pages_rebuilt']} host",
            f"{r['recovery_s']:.2f} s" if r["recovery_s"] else "-",
            (
                "[green]EXACT[/]"
                if r["exact"]
                else f"[red]NOT EXACT[/] {r['first_divergence'] or r['fatal_detail']}"
            )
            + (f" — scrub: {r['scrub']}" if r.get("scrub") else "")
            + (_unseen(r) if r["mode"].startswith("corrupt") and not r.get("scrub") else ""),
        )
    Console().print(t)
    mech = rows[0]["poison_mechanism"] if rows else None
    if mech:
        Console().print(f"page loss: device {mech['device']}; host {mech['host']}")
    return 0 if not bad else 1


def cmd_run_plan(args: argparse.Namespace) -> int:
    from faultkit.inject import plan_faults, run_plan
    from leto.errors import InvalidInput
    from leto.sim.schedule import Schedule

    try:
        schedule = Schedule.from_json(Path(args.schedule).read_text())
        plan_faults(schedule, _config(args), args.iteration_s)  # every failure checked
    except (OSError, InvalidInput, ValueError) as e:
        return refuse("run-plan", e, args)
    with progress("run-plan") as say, workdir(args, say) as (work, keep):
        try:
            v = run_plan(schedule, _config(args), args.iteration_s, work)
        except (InvalidInput, ValueError, RuntimeError) as e:
            return refuse("run-plan", e, args)
        keep_if_not_exact(keep, v["exact"])
        v["workdir_kept"] = bool(keep["why"])
    v.setdefault("mode", "from schedule")
    v.setdefault("phase", "from schedule")
    v.setdefault("point", ", ".join(v["points"]))
    v.setdefault("config", {"rank": "from schedule"})
    if args.json:
        print(json.dumps(v))
        return 0 if v["exact"] else 1
    return _verdict_table(v, f"faultkit run-plan ({v['ff']} FF, {v['not_replayed']} past the end)")


def _unseen(v: dict) -> str:
    """What a corrupt run whose scrub found nothing means: harmless when the run is
    exact (the bytes were overwritten before anything read them); otherwise the flip
    was absorbed into consistent parity — a page whose chunk was in flight in the
    update, the window parity cannot see (docs/integrity.md)."""
    n = sum(len(f["pages"]) for f in v.get("flipped", []))
    if v["exact"]:
        return f" — {n} page(s) flipped, nothing found (overwritten before anything read it)"
    return (
        " — nothing found: absorbed into consistent parity (a page whose chunk was in "
        "flight; docs/integrity.md)"
    )


def _verdict_table(v: dict, title: str) -> int:
    verdict = "[bold green]EXACT[/]" if v["exact"] else "[bold red]NOT EXACT[/]"
    if v["fatal"]:
        verdict = f"[bold yellow]FATAL FAILURE, checkpoint fallback[/], {verdict}"
    t = Table(title=f"{title}: {verdict}")
    t.add_column("item")
    t.add_column("value")
    rows = [
        (
            "fault",
            f"{v['mode']} "
            + ("every rank" if v["config"].get("all_ranks") else f"rank {v['config']['rank']}")
            + f" at {', '.join(v['points'])}",
        ),
        ("job", f"{v['config']['parallel']}, world size {v['config']['world_size']}"),
        ("injections / recoveries", f"{v['injections']} / {v['recoveries']}"),
        (
            "device pages lost / rebuilt (all ranks)",
            f"{v['pages_lost_device']} / {v['pages_rebuilt']}",
        ),
        ("host parity pages lost / rebuilt", f"{v['pages_lost_host']} / {v['host_pages_rebuilt']}"),
        (
            "pages asked per group",
            f"{v.get('pages_asked_per_group', 0)}"
            + (
                "; smaller groups (rank, group, pages held, all lost): "
                + ", ".join(f"{r}/{g}/{n}" for r, g, n in v["groups_smaller_than_asked"])
                if v.get("groups_smaller_than_asked")
                else ""
            ),
        ),
        (
            "page-loss mechanism",
            f"device: {v['poison_mechanism']['device']}; host: {v['poison_mechanism']['host']}"
            if v["poison_mechanism"]
            else "-",
        ),
        (
            f"recovery (failure until the interrupted iteration completed again, I + R; "
            f"the slowest of {v['recoveries']}; shadows {v['shadow_level']})",
            f"{v['recovery_s']:.2f} s" if v["recovery_s"] else "-",
        ),
        ("first divergence", v["first_divergence"] or "none"),
        (
            "runs",
            f"reference {v['reference_run_s']:.1f} s, faulted {v['faulted_run_s']:.1f} s, in "
            f"{v['workdir']}" + ("" if v.get("workdir_kept", True) else " (removed)"),
        ),
    ]
    for a in v.get("kernel_abort") or []:
        state = "partial output" if a["partial"] else "complete: fewer blocks than N"
        rows.append(
            (
                "kernel abort",
                f"{a['mechanism']}: {a['after_blocks']} of {a['blocks_launched']} blocks ran "
                f"({state}), then SIGKILL",
            )
        )
    if v["mode"].startswith("corrupt"):
        rows.append(("scrub", v.get("scrub") or _unseen(v)[3:]))
    if v["mode"].startswith("sdc"):
        rows.append(("detection", _replica_row(v)))
    for f in v.get("faulty", []):
        its = ", ".join(str(d["iteration"]) for d in f["detections"])
        rows.append(
            ("faulty device", f"rank {f['rank']} ({f['device']}): named in iterations {its}")
        )
    if v["fatal_detail"]:
        rows.append(("fatal", v["fatal_detail"]))
    for k, val in rows:
        t.add_row(k, str(val))
    Console().print(t)
    return 0 if v["exact"] else 1


def _replica_row(v: dict) -> str:
    cfg = v["config"]
    if not v.get("detected"):
        off = [
            f for f, on in (("--no-replica-check", cfg.get("replica_check", True)),
                            ("--replay-every 0", cfg.get("replay", True))) if not on
        ]  # fmt: skip
        return "nothing detected" + (f" ({', '.join(off)})" if off else "")
    who = (
        f"rank {v['named_rank']} named"
        if v["named_rank"] is not None
        else f"ranks {v['suspects']} disagree (no majority names one)"
    )
    if v.get("detected_by") == "recheck":
        return (
            f"update recheck (a chunk recomputed from its undo copy), iteration "
            f"{v['detected_at']}: {who}; rolled back to iteration {v['rolled_back']}"
        )
    if v.get("detected_by") == "replay":
        return (
            f"gradient replay, in iteration {v['detected_at']} before its update: {who}; "
            f"the iteration was redone in place"
        )
    return (
        f"replica check, after the update of iteration {v['detected_at']}: {who}; rolled "
        f"back to iteration {v['rolled_back']}"
    )


PARALLEL_HELP = (
    "the job's parallelism: dp (the example GPT, data parallel), or the parallel example "
    "(examples/parallel/gpt_parallel_leto.py; each rank retains its shards) as fsdp "
    "(FSDP2), tp (tensor-parallel MLPs over every rank) or fsdp+tp (TP over pairs of "
    "ranks, FSDP2 across them: world size 4 or more), or pp (gpt_pipeline_leto.py: one "
    "pipeline stage per rank, GPipe over 4 micro-batches), ep (gpt_moe_leto.py: a "
    "mixture of experts, 8 experts a layer sharded over the ranks and tokens dispatched by "
    "all-to-all, the rest data parallel; a world size dividing 8) or ep+fsdp (the same, "
    "the rest sharded by FSDP2, the experts DTensors outside it); dp-loader "
    "(examples/porting/loader_leto.py: data parallel, batches from a shuffled two-worker "
    "StatefulDataLoader handed to leto.Run(data=...)); titan (examples/titan/debug_job.py: "
    "torchtitan's Llama 3 debug model under leto.titan's LetoTrainer; torchtitan 0.2 "
    "installed; world size 1 on the CPU)"
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="faultkit", description="fault injection for Leto and PyTorch jobs"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "probe", help="show which fault mechanisms this machine has (real or emulated)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(fn=cmd_probe)
    p = sub.add_parser(
        "inject", help="run the example job fault-free and faulted, and compare bit for bit"
    )
    p.add_argument(
        "--phase",
        default="update",
        help="compute, allreduce, grad-parity, sync, update, parity, parity-copy, tier2 or any",
    )
    p.add_argument(
        "--pages",
        type=int,
        default=0,
        help="device pages lost per protection group (more than H1=16 is fatal)",
    )
    p.add_argument(
        "--host-parity-pages",
        type=int,
        default=0,
        help="tier-1 host parity pages lost in the first group",
    )
    p.add_argument(
        "--mode",
        default="kill",
        help="kill (SIGKILL at the phase), copy-corrupt (garble the parity copy in progress, "
        "then SIGKILL; phases grad-parity, parity-copy) or kernel-abort (the next of Leto's "
        "kernels stops after --abort-after-blocks blocks and the rank dies with it in "
        "flight; phases grad-parity, update, parity, parity-copy, tier2), corrupt-data or "
        "corrupt-parity (flip one bit in each of --pages retained pages — device pages of the "
        "last group, or the first group's host tier 1 — silently: no death, no loss), or "
        "sdc-grad (phase allreduce: one bit of the rank's local gradient flipped before the "
        "all-reduce; world 2+: the job replays the struck iteration), sdc-activation (phase "
        "compute: one bit of the model's first nn.Linear output flipped in the rank's "
        "forward; world 2+, replayed the same way), or "
        "sdc-update (phase update: one bit of the rank's freshly updated parameters flipped "
        "before parity absorbs them — a wrong computation; the verdict says whether the "
        "replica check detected it)",
    )
    p.add_argument(
        "--no-replica-check",
        action="store_true",
        help="run the job with leto run --no-replica-check (sdc-update must then end NOT "
        "EXACT: what shows the check is what finds it)",
    )
    p.add_argument(
        "--no-replay",
        action="store_true",
        help="sdc-grad / sdc-activation: run the job with leto run --replay-every 0 (the "
        "run must then end NOT EXACT: what shows the replay is what finds it)",
    )
    p.add_argument(
        "--abort-after-blocks",
        type=int,
        default=3,
        help="kernel-abort: blocks of the aborted kernel that run",
    )
    p.add_argument(
        "--every", type=int, default=0, help="one fault every K iterations (0: one, mid-run)"
    )
    p.add_argument("--rank", type=int, default=0, help="the rank that fails")
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help="every rank fails at the point at once, one failure (kill, copy-corrupt, "
        "kernel-abort; its page losses taken once)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=6,
        help="training iterations (the fault hits the middle one)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the job and of the fault draw")
    p.add_argument("--world-size", type=int, default=2, help="data-parallel ranks")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        help="ranks sharing each GPU over gloo (leto run --ranks-per-gpu; testing)",
    )
    p.add_argument("--shadow-level", default=DEFAULT_SHADOW_LEVEL, help="leto run's shadows: L1, L2, L3, off")
    p.add_argument("--parallel", default="dp", help=PARALLEL_HELP)
    p.add_argument("--undo", choices=UNDO_MODES, default="chunk", help=UNDO_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    workdir_flags(p)
    p.set_defaults(fn=cmd_inject)

    def job_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--iterations", type=int, default=6, help="training iterations")
        p.add_argument("--seed", type=int, default=0, help="seed of the job and the fault draws")
        p.add_argument("--world-size", type=int, default=2, help="data-parallel ranks")
        p.add_argument("--device", default="cpu", help="cpu or cuda")
        p.add_argument(
            "--ranks-per-gpu",
            type=int,
            default=1,
            help="ranks sharing each GPU over gloo (leto run --ranks-per-gpu; testing)",
        )
        p.add_argument(
            "--shadow-level", default=DEFAULT_SHADOW_LEVEL, help="leto run's shadows: L1, L2, L3, off"
        )
        p.add_argument("--parallel", default="dp", help=PARALLEL_HELP)
        p.add_argument("--undo", choices=UNDO_MODES, default="chunk", help=UNDO_HELP)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        workdir_flags(p)

    p = sub.add_parser(
        "matrix",
        help="every phase x {0, H1} pages x host parity page x modes, "
        "against one fault-free reference (exit 0 only if all EXACT)",
    )
    job_flags(p)
    p.add_argument("--phases", default=None, help="comma-separated subset of phases (default all)")
    p.add_argument(
        "--modes",
        default="kill,copy-corrupt",
        help="comma-separated modes: kill, copy-corrupt, kernel-abort, corrupt-data, "
        "corrupt-parity (corrupt modes: 1 and H1 flipped pages, no loss), sdc-update, "
        "sdc-grad, sdc-activation (one case each, at its own phase: update, allreduce, "
        "compute; the last two at world 2+)",
    )
    p.add_argument(
        "--corrupt-pages",
        default="both",
        choices=("both", "alternate"),
        help="corrupt modes: 1 and H1 flipped pages at every phase (both), or 1 and H1 "
        "taking turns along phases and modes (alternate: half the cases, each phase and "
        "mode still sees both counts)",
    )
    p.add_argument(
        "--losses",
        default="all",
        choices=("all", "pairs", "alternate", "beyond"),
        help="kill/copy-corrupt/kernel-abort: every loss ({0, H1} pages x host parity page "
        "or not) at every phase (all); two per phase, {none, both} or {host, device} taking "
        "turns (pairs); or one per phase, the four taking turns (alternate); or one per "
        "phase beyond parity (beyond: H1+1 device pages per group and every tier-1 host page "
        "of the first group: the fatal path, the checkpoint fallback)",
    )
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help="every case fails every rank at once (kill, copy-corrupt, kernel-abort modes)",
    )
    p.set_defaults(fn=cmd_matrix)
    register_plan(sub)
    p = sub.add_parser("run-plan", help="replay a failure schedule (JSON) against the example job")
    p.add_argument("schedule", help="a schedule written by faultkit plan")
    p.add_argument(
        "--iteration-s",
        type=float,
        required=True,
        help="seconds per iteration: a failure at t s strikes iteration floor(t / this)",
    )
    job_flags(p)
    p.set_defaults(fn=cmd_run_plan)
    register_certify(sub)
    return ap


def _terminated(signum, frame):
    # Unwinds like Ctrl-C: the job's agents are stopped and the temporary work
    # directory removed (the finally clauses of finish_job and cli_common.workdir).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print(
            f"faultkit {args.command}: interrupted (Ctrl-C); nothing left running", file=sys.stderr
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(main())
