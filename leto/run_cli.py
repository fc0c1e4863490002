"""``leto run``: launch a training script as torchrun does, with state managers, shadow
trainers and in-place recovery — its flags (``register``), its start (``cmd_run``) and
the console summary at its end (``_print_summary``).

Runs in the ``leto`` command's process, which becomes node n's agent
(``leto.launch.agent``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leto.errors import InvalidInput
from leto.job.config import DEFAULT_SHADOW_LEVEL
from leto.job.config import REPLAY_EVERY_DEFAULT as DEFAULT_REPLAY_EVERY

NVIDIA_DRIVER = "/proc/driver/nvidia"  # present where NVIDIA's kernel driver is loaded

ENV_OMP = "OMP_NUM_THREADS"


def _ranks(text: str) -> tuple[int, ...] | None:
    """``--local-ranks-filter``'s list (None: every rank)."""
    if not text.strip():
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter {text!r}: expected local ranks, comma-separated (0,1)"
        ) from None


def _missing_module(name: str) -> str | None:
    """Why ``python -m name`` would not start, or None. Looked up as the trainers will
    (the working directory first on the path, as ``python -m`` puts it)."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        return f"module {name} cannot be found ({e})"
    finally:
        sys.path.pop(0)
    if spec is None:
        return f"module {name} cannot be found (on the working directory or sys.path)"
    return None


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu`` — asked of the driver, not of torch
    where it can be: this process imports torch after the zygote has started
    (``cmd_run``), so the two imports overlap; asking torch first put one after the other
    on every run that gives no ``--device``. Without cuda-python: no NVIDIA driver, no
    GPU (``/proc/driver/nvidia``); with one, torch decides, as before."""
    from leto.memory.backends.cuda import visible_gpus

    n = visible_gpus()
    if n is None:
        if not os.path.exists(NVIDIA_DRIVER):
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    # (a CPU build of torch on a GPU machine sees no GPU, as torch.cuda.is_available())
    return "cuda" if n > 0 and torch_builds_cuda() else "cpu"


def torch_builds_cuda() -> bool:
    """Whether the installed torch is a CUDA build (its ``libtorch_cuda`` library is
    there), without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    lib = Path(spec.submodule_search_locations[0]) / "lib"
    return any(lib.glob("libtorch_cuda*"))


def cmd_run(args: argparse.Namespace) -> int:
    from leto import gpu_kernels
    from leto.job import fault_plan
    from leto.job.config import ENV_FAULT_PLAN, RunConfig
    from leto.launch.zygote import Zygote
    from leto.launch.zygote import enabled as zygote_enabled

    device_note = None
    if args.device is None:
        # As a torchrun user expects: the GPU when there is one (training on the CPU of
        # a GPU machine by default would be silent and slow).
        args.device = default_device()
        seen = "a GPU is" if args.device == "cuda" else "no GPU is"
        device_note = f"--device {args.device} ({seen} visible; --device sets it)"
    try:
        cfg = RunConfig(
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            device=args.device,
            ranks_per_gpu=args.ranks_per_gpu,
            shadow_level=args.shadow_level,
            page_bytes=args.page_bytes,
            data_pages=args.data_pages,
            tier1_pages=args.tier1_pages,
            allow_fault_injection=args.allow_fault_injection,
            timeout_s=args.timeout_s,
            hang_timeout_s=args.hang_timeout_s,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_interval=args.checkpoint_interval,
            checkpointing=not args.no_checkpoints,
            mttf_s=args.mttf_s,
            hof_ratio=args.hof_ratio,
            recovery=args.recovery,
            log_dir=args.log_dir,
            max_failures=args.max_failures,
            log_level=args.log_level,
            verify=args.verify,
            console="stderr" if args.json else "stdout",
            local_ranks_filter=_ranks(args.local_ranks_filter),
            scrub_mib=args.scrub_mib_per_iteration,
            replica_check=not args.no_replica_check,
            loss_guard=not args.no_loss_guard,
            replay_every=DEFAULT_REPLAY_EVERY if args.replay_every is None else args.replay_every,
            undo=args.undo,
            exclude_faulty=args.exclude_faulty,
            beat_poll_s=args.beat_poll_s,
            device_memory_bytes=args.device_memory_bytes,
            preinit_footprints=args.preinit_footprints,
            preinit_margin_bytes=int(args.preinit_margin_mib * (1 << 20)),
            reclaim_below_bytes=int(args.reclaim_below_mib * (1 << 20)),
        )
        if cfg.shadow_level == "auto":
            from leto.preinit.policy import for_run

            for_run(cfg, capacity_bytes=1)  # bad footprints or margins fail before anything starts
    except ValueError as e:
        print(f"leto run: {e}", file=sys.stderr)
        return 2
    if args.module:
        missing = _missing_module(args.script)
        if missing:
            print(f"leto run: {missing}; nothing started", file=sys.stderr)
            return 2
    elif not Path(args.script).is_file():
        print(
            f"leto run: training script {args.script} does not exist; nothing started",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"%(asctime)s %(name)s node {cfg.node_rank} %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("leto.run")
    if device_note:
        log.info(device_note)
    if cfg.nproc_per_node > 1 and ENV_OMP not in os.environ:
        # torchrun's rule: several trainers per node, each with every core's threads,
        # oversubscribe the machine (15-18x slower on 2 cores) — and a kernel's thread
        # count can change its bits (a LayerNorm weight gradient on the CPU), so a port
        # would not be bit-identical to the same script under torchrun.
        os.environ[ENV_OMP] = "1"
        log.info(
            "Setting OMP_NUM_THREADS to 1 for each trainer (%d per node; as torchrun does): "
            "set it yourself to tune it",
            cfg.nproc_per_node,
        )
    try:  # (the agent parses it again; refused here, no zygote was started)
        fault_plan.parse(
            os.environ.get(ENV_FAULT_PLAN, "[]"), cfg.world_size, cfg.allow_fault_injection
        )
    except InvalidInput as e:
        print(f"leto run: {e}", file=sys.stderr)
        return 2
    # The zygote (the trainers' parent, leto.launch.zygote) starts before this process
    # imports the agent and torch with it: the two imports overlap instead of following
    # each other (1.9 s sooner to the first trainer on an idle 2-core VM). Its
    # environment is final by now (OMP_NUM_THREADS above).
    zygote = Zygote(cfg.timeout_s) if zygote_enabled() else None
    # On a GPU, Leto's run-time compiled kernels too, each in a process of its own, where
    # this machine has not built them yet (21 s of NVRTC in a first trainer otherwise).
    prebuilds = gpu_kernels.start_prebuilds(cfg.log_dir) if cfg.device == "cuda" else []
    try:
        return _run_agent(args, cfg, zygote)
    finally:
        if zygote is not None:
            zygote.close()  # (closed by the agent already, unless refused before it ran)
        gpu_kernels.stop_prebuilds(prebuilds)


def _run_agent(args: argparse.Namespace, cfg, zygote) -> int:
    from leto.launch.agent import Agent, SignalStop

    try:
        command = ["-m", args.script] if args.module else [args.script]
        agent = Agent(cfg, [*command, *args.script_args], zygote=zygote)
    except InvalidInput as e:
        print(f"leto run: {e}", file=sys.stderr)
        return 2
    # SIGTERM (a scheduler stopping the job) and Ctrl-C stop the job as its end does:
    # every trainer fenced, shadows and state managers stopped, the record written.
    handlers = {s: signal.signal(s, agent.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = agent.run()
    except InvalidInput as e:  # found before anything started (a busy port)
        print(f"leto run: {e}", file=sys.stderr)
        return 2
    except SignalStop as e:  # before the job's store was up: nothing to stop
        print(f"leto run: stopped by {e} before the job started", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    summary = json.loads((Path(cfg.log_dir) / f"node{cfg.node_rank}.recovery.json").read_text())
    if args.json:
        print(json.dumps(summary))
        return code
    return _print_summary(summary, cfg, code)


def _print_summary(summary: dict, cfg, code: int) -> int:
    """leto run's console: one line when the job ran through without failures; the
    reason first when it stopped (a signal, a script error, a repeated fatal failure);
    the table of recoveries only when there were some."""
    m = summary["measured"]
    if m["ettr"] is None:
        ettr = f"ETTR not measured: {m['why']}"
    elif summary["failures"]:
        ettr = (
            f"ETTR {m['ettr']:.1%} ({m['iterations']} iterations of "
            f"{m['median_iteration_s']:.3f} s in {m['wall_s']:.1f} s; start-up counts "
            "against it, so a short run reads low)"
        )
    else:  # without failures an ETTR measures only the start-up: the figures instead
        ettr = (
            f"{m['iterations']} iterations of {m['median_iteration_s']:.3f} s in "
            f"{m['wall_s']:.1f} s (start-up and shutdown included)"
        )
    shadows = cfg.level()
    if summary.get("preinit"):
        p = summary["preinit"]
        shadows = f"auto → {summary.get('shadow_level') or 'none'} now; " + ", ".join(
            f"rank {r} chose {v['level'] or 'none'} ({v['reclamations']} reclaimed)"
            for r, v in p.items()
        )
        if any(v["emulated_device"] for v in p.values()):
            shadows += " [emulated device memory]"
    head = f"leto run: {summary['failures']} failure(s), shadows {shadows}; {ettr}"
    stopped = summary.get("stopped")
    if stopped in ("SIGTERM", "SIGINT"):
        fenced = len(summary.get("fenced") or [])
        print(
            f"leto run: stopped by {stopped}; {fenced} trainer(s) fenced (logs in {cfg.log_dir})",
            file=sys.stderr,
        )
    elif stopped:
        # A failed job says why in one line (rank, exit code, the error); the agent's
        # ERROR line above it (--log-level shows ERROR at every level) has the
        # traceback's tail, the record all of it.
        first = stopped.splitlines()[0]
        print(f"leto run: the job stopped (exit code {code}): {first}", file=sys.stderr)
    if summary.get("no_loss_ranks"):
        print(
            f"leto run: warning: {summary['no_loss_ranks']} trainer(s) committed iterations "
            "without run.record_loss(loss): the --verify traces and loss logs hold NaN "
            "losses, so the verifiers compare no loss (call it before optimizer.step())",
            file=sys.stderr,
        )
    if summary.get("unprotected_ranks") and not stopped:
        ranks = summary["unprotected_ranks"]
        print(
            f"leto run: warning: rank(s) {', '.join(map(str, ranks))} never reached "
            "leto.Run: nothing of their training was retained or protected, and a failure "
            "would have restarted them from the top — call leto.init() and wrap the model "
            "and optimizer in leto.Run (docs/porting.md)",
            file=sys.stderr,
        )
    for f in summary.get("unfired_faults", []):
        print(
            f"leto run: warning: fault-plan entry for generation {f['generation']} (rank "
            f"{f['rank']} at {f['at']}, {f.get('mode', 'kill')}) never fired: the job "
            f"{'ended' if not stopped else 'stopped'} before it, or the point was not reached",
            file=sys.stderr,
        )
    if not summary["recoveries"]:
        if not stopped:
            print(head)  # no failure: no table of recoveries to print
        return code
    # Fits 80 columns: the slowest trainer's steps go below the table, a line a failure.
    t = Table(title=head, title_justify="left")
    for col in ("#", "kind", "ranks", "level", "resumed", "I", "R", "I + R"):
        t.add_column(col, no_wrap=True)
    steps = {
        "deferred_init_s": "init",
        "attach_localize_s": "attach",
        "map_retained_s": "map",
        "reconstruct_s": "rebuild",
        "agree_s": "agree",
        "finish_update_s": "finish",
    }
    notes = []
    for n, r in enumerate(summary["recoveries"], 1):
        tr = list(r.get("trainers", {}).values())
        slow = max(tr, key=lambda x: x.get("resume_s", 0), default={})
        kind = {"HOF": "in place", "FF": "checkpoint"}.get(r["class"], r["class"])
        if r.get("cause"):
            kind = "script error"  # recovered in place, then known for what it was
            notes.append(f"failure {n}: {r['cause']}; it was recovered in place first")
        t.add_row(
            str(n),
            kind,
            ",".join(map(str, r.get("failed_ranks", []))) or "?",
            str(r.get("level") or "cold"),
            f"{r['recovery_s']:.2f} s" if "recovery_s" in r else "-",
            *(f"{r[k]:.2f} s" if k in r else "-" for k in ("init_s", "recompute_s", "regained_s")),
        )
        said = ", ".join(f"{v} {slow[k]:.2f} s" for k, v in steps.items() if k in slow)
        if said:
            losing = r.get("losing_s")
            notes.append(
                f"failure {n}: fenced in {r['fencing_s'] * 1e3:.0f} ms, shadows promoted in "
                f"{r['promotion_s'] * 1e3:.0f} ms"
                + (
                    f" (of which {losing * 1e3:.0f} ms the fault plan's page loss, emulated)"
                    if losing is not None
                    else ""
                )
                + f"; the slowest trainer's steps: {said}"
            )
        first = max(tr, key=lambda x: x.get("first_iteration_end", 0), default={})
        if first.get("stages"):
            stages = ", ".join(f"{k} {v:.2f} s" for k, v in first["stages"].items())
            steady = r.get("steady_iteration_s")
            notes.append(
                f"failure {n}, promotion to the end of the first iteration: {stages}"
                + (f" (a steady iteration: {steady:.2f} s)" if steady else "")
            )
        ahead = [x for x in tr if x.get("ran_ahead_to")]
        if ahead:  # (leto.trainer.run_ahead: the set-up stage above then reads ~0)
            where = " / ".join(sorted({x["ran_ahead_to"] for x in ahead}))
            notes.append(
                f"failure {n}: {len(ahead)} of {len(tr)} promoted trainer(s) had run the "
                f"script's set-up ahead while parked, to where it {where}"
            )
    Console().print(t)
    legend = (
        "kind: in place (recovered from memory and parity) or checkpoint (a fatal "
        "failure: every rank restarted from the newest checkpoint); level: the shadows "
        "promoted; resumed: failure to "
        "leto.Run's resume; I: failure to the loop running again; R: the interrupted "
        "iteration done again, less what a fault-free run still had ahead of it; I + R: "
        "the time the failure cost, as the paper measures recovery"
    )
    for line in [legend, *notes]:
        print(textwrap.fill(line, 78, initial_indent="  ", subsequent_indent="    "))
    return code


def register(sub) -> None:
    """``leto run``'s parser: its flags in groups, as torchrun's are."""
    p = sub.add_parser(
        "run",
        help="launch a training script like torchrun, with state managers, shadow trainers "
        "and in-place recovery",
    )
    g = p.add_argument_group("the job (as torchrun's)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    g.add_argument("--nproc-per-node", type=int, default=1, help="ranks (trainers) per node")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (job store)")
    g.add_argument("--master-port", type=int, default=29500, help="the job store's port")
    g.add_argument(
        "--device",
        default=None,
        help="cpu (gloo, memfd pool) or cuda (NCCL, VMM); default: cuda when torch sees a "
        "GPU, else cpu",
    )
    g.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        help="testing on fewer GPUs than ranks: local ranks share each GPU N at a time, each "
        "with its own pool, parity and shadow, over gloo (NCCL refuses two ranks on one GPU)",
    )
    g.add_argument(
        "--local-ranks-filter",
        default="",
        metavar="RANKS",
        help="the local ranks whose output is shown on the console, comma-separated (as "
        "torchrun's; default all): every rank's is in its log under --log-dir either way",
    )
    g = p.add_argument_group("shadows and recovery")
    g.add_argument(
        "--shadow-level",
        default=DEFAULT_SHADOW_LEVEL,
        help=f"auto, L1, L2, L3, or off (a failed rank restarts cold, as with torchrun); "
        f"default {DEFAULT_SHADOW_LEVEL}",
    )
    g.add_argument(
        "--recovery",
        default="in-place",
        help="in-place (Leto) or checkpoint (every failure restarts from the last checkpoint, "
        "as torchrun + DCP would: the baseline)",
    )
    g.add_argument(
        "--max-failures", type=int, default=100, help="stop the job after this many failures"
    )
    g.add_argument("--timeout-s", type=float, default=120.0, help="every wait, in seconds")
    g.add_argument(
        "--hang-timeout-s", type=float, default=60.0, help="a stalled heartbeat this long is a hang"
    )
    g.add_argument(
        "--beat-poll-s",
        type=float,
        default=0.25,
        help="read every rank's heartbeat from the store this often (hang detection)",
    )
    g.add_argument(
        "--exclude-faulty",
        action="store_true",
        help="a GPU that the checks name twice as computing wrong (gradient replay, the "
        "replica check, the update recheck) is a hardware failure: the job stops, keeping "
        "its checkpoints, and leto run --exclude-faulty started again with the same "
        "--log-dir leaves the GPUs listed in its faulty-devices.json out of "
        "CUDA_VISIBLE_DEVICES and resumes (without the flag such a GPU is only reported)",
    )
    g = p.add_argument_group("pools and parity")
    g.add_argument("--page-bytes", type=int, default=0, help="pool page size (0: device default)")
    g.add_argument("--data-pages", type=int, default=1024, help="pages per protection group (D)")
    g.add_argument(
        "--tier1-pages",
        type=int,
        default=4,
        help="H1: tier-1 parity pages per group — lost device pages a group survives; each "
        "costs parity arithmetic every iteration (docs/benchmarks.md; `leto sim h1` picks 4)",
    )
    g.add_argument(
        "--allow-fault-injection", action="store_true", help="let faultkit lose pool pages"
    )
    g.add_argument(
        "--undo",
        choices=("chunk", "ahead"),
        default="chunk",
        help="where the update's undo copies (what a crash mid-update reverts to) come "
        "from: chunk — each chunk copied just before its update, on the update's path; "
        "ahead — the whole retained state copied once an iteration while forward and "
        "backward run (as much pool memory again as the parameters and optimizer state; "
        "with the fused chunk pass the update then copies nothing). The checks line says "
        "which a job got",
    )
    g = p.add_argument_group("checkpoints (the fallback for fatal failures)")
    g.add_argument("--checkpoint-dir", default="", help="DCP checkpoints (default: in log-dir)")
    g.add_argument(
        "--no-checkpoints",
        action="store_true",
        help="save no checkpoints: a fatal failure restarts the job from its first "
        "iteration (for measurements; a job that must not lose work keeps them)",
    )
    g.add_argument(
        "--checkpoint-interval",
        type=int,
        default=0,
        help="iterations between checkpoints; 0: Young's formula with the FF-only MTTF "
        "(each save: a full scrub, then DCP staging in the background; the loop waits only "
        "when staging outlasts the next forward and backward, and a save due while the "
        "last one is still written is put off)",
    )
    g.add_argument("--mttf-s", type=float, default=3600.0, help="expected MTTF (for Young)")
    g.add_argument("--hof-ratio", type=float, default=0.5, help="expected HOF fraction")
    g = p.add_argument_group("checks of silent corruption")
    g.add_argument(
        "--scrub-mib-per-iteration",
        type=float,
        default=None,
        help="data MiB of retained state checked against its parity per iteration, a "
        "whole protection group at a time (silent corruption; 0: only the full pass "
        "before each checkpoint; default 64 on cuda, 1 on cpu; on an H200 the default "
        "cost +0.40 %% of a 1 B model's iteration, docs/benchmarks.md)",
    )
    g.add_argument(
        "--no-replica-check",
        action="store_true",
        help="do not compare the data-parallel replicas' retained state after each update "
        "(a digest of each group's tier-1 parity, one all_gather of 8 bytes a group: a "
        "wrong computation on one rank is then not found; sharded jobs skip it anyway)",
    )
    g.add_argument(
        "--replay-every",
        type=int,
        default=None,
        metavar="K",
        help="every K-th iteration, each rank's first micro-batch is recomputed on the next "
        "rank and the gradients compared bit for bit (a wrong gradient or activation is "
        "found before the update; the iteration is redone in place); 0: off; default "
        f"{DEFAULT_REPLAY_EVERY}: one micro-batch's forward and backward every "
        f"{DEFAULT_REPLAY_EVERY} iterations. Data-parallel jobs of 2+ ranks with "
        "torch.use_deterministic_algorithms(True) only",
    )
    g.add_argument(
        "--no-loss-guard",
        action="store_true",
        help="do not fail an iteration whose recorded loss is NaN or infinite on any rank "
        "(by default the job then falls back to its last verified checkpoint and redoes "
        "it; the flag rides in the replica check's all_gather: no extra cost; off anyway "
        "under a GradScaler)",
    )
    g = p.add_argument_group("preinitialization (--shadow-level auto)")
    g.add_argument(
        "--device-memory-bytes",
        type=int,
        default=0,
        help="--shadow-level auto: device memory the trainer and its shadow share (0: the "
        "GPU's total; on --device cpu a positive value emulates a device of that size)",
    )
    g.add_argument(
        "--preinit-footprints",
        default="",
        help="--shadow-level auto: JSON of each level's device bytes (bench/preinit_footprint.py "
        "writes it; default: the paper's A100 figures)",
    )
    g.add_argument(
        "--preinit-margin-mib",
        type=float,
        default=2048,
        help="auto: free memory kept above the peak",
    )
    g.add_argument(
        "--reclaim-below-mib",
        type=float,
        default=1024,
        help="auto: the allocation hook reclaims the shadow when device free memory is below this",
    )
    g = p.add_argument_group("records and output")
    g.add_argument("--log-dir", default="leto-run", help="per-rank logs and recovery records")
    g.add_argument(
        "--log-level",
        default="INFO",
        help="the agent's log of every state transition on stderr: DEBUG, INFO, WARNING, ERROR",
    )
    g.add_argument(
        "--verify",
        action="store_true",
        help="record the verifiers' trace: each iteration's loss and a digest of every "
        "retained tensor (costs a hash of the whole state per iteration; off by default)",
    )
    g.add_argument("--json", action="store_true", help="print the summary as JSON")
    g = p.add_argument_group("the script")
    g.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="the script is a module, run as python -m runs it (torchrun's -m): "
        "leto run -m leto.titan.train ...",
    )
    g.add_argument("script", help="the training script (with -m: a module's dotted name)")
    g.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(fn=cmd_run)
