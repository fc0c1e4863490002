"""Issue 47: the multi-rank GPU paths verified without a second GPU — world 2 (and 4)
on one GPU, the ranks sharing it over gloo (``leto run --ranks-per-gpu``), in targets
that each fit one 10-minute device call (``bash bench/gpu_suite.sh world2-<target>``):

* ``certify``  — the example job killed at every phase with pages lost (faultkit certify);
* ``matrix``   — faultkit's dp matrix: kill at every phase, the four page losses within
  H1 taking turns; copy-corrupt and kernel-abort at their phases; pages lost beyond H1
  (the fatal path); every rank failing at once; at world 4, kill at four phases;
* ``sdc``      — sdc-update, sdc-grad, sdc-activation: EXACT, detected, rank 0 named;
  with the replica check or the replay off: NOT EXACT; at world 4 (a majority names the
  rank): sdc-update and sdc-grad;
* ``parallel`` — which collectives gloo carries for CUDA tensors (``bench.gloo_cuda``);
  faultkit certify of ZeRO-1, FSDP2, TP, EP and EP + FSDP2 at world 2 and FSDP2 x TP at
  world 4; the pipeline refused before anything starts (faultkit, and leto.Run);
* ``ports``    — the Llama and nanoGPT ports against torchrun + DDP, both ranks on
  cuda:0 over gloo, killed with pages lost (the ``cuda-shared`` tests);
* ``costs``    — the user path at world 2 (bench.user_path): the replica check, gradient
  replay and the loss guard each off, replay on every iteration, all off, as ratios;
* ``megatron`` — Megatron-Core's example at tensor parallel 2 (world 2) and tensor 2 x
  data 2 (world 4) certified; its own DDP refused by name (gloo does not carry its
  coalesced collectives for CUDA tensors). Needs megatron-core installed.

A target is lanes of steps: the lanes run at once (``--lanes``: at most that many), the
steps of a lane one after another, all under one deadline (``--budget-s``); a step still
running then is stopped (SIGTERM to its session, SIGKILL 30 s later) and a step not yet
started is reported not run. Each step writes ``<out>/<target>/<step>.json`` (its
stdout: faultkit's ``--json``) and ``.log``; the target a table and
``<out>/<target>.json``. Exit code 1 if any step failed or did not run.

    python -m bench.world2 matrix --out out/w2                     # one GPU
    python -m bench.world2 sdc --device cpu --lanes 1 --out /tmp/w2  # the same steps on the CPU

``--device cpu`` runs the same command lines without ``--ranks-per-gpu`` (on the CPU
every rank is its own process anyway) and leaves out the steps that only a GPU can
answer (gloo's collectives on CUDA, leto.Run's refusal): it checks that the steps parse
and work. Not covered: more than one GPU (``leto run --ranks-per-gpu`` over several is
the same placement, ``tests/test_processes_integ.py``), speed as users would see it
(every collective goes through host memory: the costs are ratios against a gloo-bound
iteration).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEGATRON = "examples/megatron/gpt_leto.py"
STOP_GRACE_S = 30.0  # after SIGTERM: faultkit stops its job's agents in this time
MIN_START_S = 45.0  # a step is not started with less of the budget left


@dataclass(frozen=True)
class Step:
    """One command (``python -m <argv>``) and what it must show: ``expect`` is "exact"
    (exit 0, the JSON's verdict EXACT), "not exact" (exit 1, a divergence found: a check
    turned off lets the fault through), "refused" (a nonzero exit before anything ran,
    ``words`` in its stderr) or "ok" (exit 0). ``check``: "sdc" (also detected, rank 0
    named), "fatal" (every case took the fatal path), "pytest" (tests passed, none
    skipped), "costs" (bench.user_path: every run worked)."""

    name: str
    argv: tuple[str, ...]
    expect: str = "exact"
    words: tuple[str, ...] = ()
    check: str = ""
    cuda_only: bool = False  # a question only a GPU answers: left out with --device cpu


@dataclass
class Result:
    name: str
    passed: bool | None  # None: not run
    detail: str
    seconds: float = 0.0
    returncode: int | None = None
    command: str = ""
    lane: int = 0
    data: dict = field(default_factory=dict)


def _fk(device: str, world: int, command: str, *args: str) -> tuple[str, ...]:
    """faultkit's command line for ``world`` ranks on ``device`` (sharing the GPU)."""
    ranks = "--nproc-per-node" if command == "certify" else "--world-size"
    shared = ("--ranks-per-gpu", str(world)) if device == "cuda" else ()
    return ("faultkit.cli", command, "--device", device, ranks, str(world), *shared,
            "--json", *args)  # fmt: skip


def _certify(device: str, world: int, script: str, *args: str) -> tuple[str, ...]:
    return (*_fk(device, world, "certify"), "--", script, *args, "--iterations", "9")


def targets(device: str) -> dict[str, list[list[Step]]]:
    """Every target's lanes of steps, for ``device`` (cuda: ranks sharing GPU 0)."""
    fk = lambda world, *a: _fk(device, world, *a)  # noqa: E731
    cert = lambda world, *a: _certify(device, world, *a)  # noqa: E731
    m4 = ("matrix", "--iterations", "4")
    phases = os.environ.get("LETO_W2_PHASES") or ",".join(_phases())
    # ZeRO-1 shards units (a CUDA pool's are 2 MiB pages): the example job's default
    # model is one unit there, which cannot be sharded 2 ways (leto.Run refuses it).
    zero1_shape = ("--n-embd", "256", "--n-layer", "4", "--n-head", "4", "--chunk-units", "1")
    zero1_shape = zero1_shape if device == "cuda" else ()
    return {
        "certify": [[
            Step("certify", (*fk(2, "certify", "--phases", phases), "--", "examples/train_gpt.py",
                             "--iterations", "9")),
        ]],
        "matrix": [
            [Step("kill", fk(2, *m4, "--modes", "kill", "--losses", "alternate"))],
            [Step("abort-corrupt", fk(2, *m4, "--modes", "copy-corrupt,kernel-abort",
                                      "--losses", "alternate"))],
            [Step("beyond-h1", fk(2, *m4, "--modes", "kill", "--losses", "beyond",
                                  "--phases", "compute,update,parity-copy"), check="fatal"),
             Step("all-ranks", fk(2, *m4, "--modes", "kill,kernel-abort", "--all-ranks",
                                  "--losses", "alternate", "--phases", "compute,allreduce,update"))],
            [Step("kill-w4", fk(4, *m4, "--modes", "kill", "--losses", "alternate",
                                "--phases", "compute,allreduce,update,parity-copy"))],
        ],
        "sdc": [
            [Step("sdc", fk(2, *m4, "--modes", "sdc-update,sdc-grad,sdc-activation"),
                  check="sdc")],
            [Step("sdc-update-off", fk(2, "inject", "--mode", "sdc-update", "--phase", "update",
                                       "--no-replica-check"), expect="not exact"),
             Step("sdc-grad-off", fk(2, "inject", "--mode", "sdc-grad", "--phase", "allreduce",
                                     "--no-replay"), expect="not exact")],
            [Step("sdc-activation-off", fk(2, "inject", "--mode", "sdc-activation", "--phase",
                                           "compute", "--no-replay"), expect="not exact"),
             Step("sdc-update-w4", fk(4, "inject", "--mode", "sdc-update", "--phase", "update"),
                  check="sdc")],
            [Step("sdc-grad-w4", fk(4, "inject", "--mode", "sdc-grad", "--phase", "allreduce"),
                  check="sdc")],
        ],
        "parallel": [
            [Step("gloo", ("bench.gloo_cuda", "--world-size", "2", "--json", "{json}"),
                  expect="ok", cuda_only=True),
             Step("zero1", cert(2, "examples/train_gpt.py", "--zero1", *zero1_shape)),
             Step("pp-refused", fk(2, "inject", "--parallel", "pp"), expect="refused",
                  words=("pipeline parallelism", "send/recv"), cuda_only=True),
             Step("pp-refused-by-leto-run", (
                 "leto.cli", "run", "--device", device, "--nproc-per-node", "2",
                 "--ranks-per-gpu", "2", "--shadow-level", "off", "--no-checkpoints",
                 "--log-dir", "{dir}/pp-logs",
                 "examples/parallel/gpt_pipeline_leto.py", "--iterations", "2", "--out",
                 "{dir}/pp-out"), expect="refused",
                 words=("data_parallel=False", "send/recv"), cuda_only=True)],
            [Step("fsdp", cert(2, "examples/parallel/gpt_parallel_leto.py", "--tp", "1")),
             Step("ep", cert(2, "examples/parallel/gpt_moe_leto.py"))],
            [Step("tp", cert(2, "examples/parallel/gpt_parallel_leto.py", "--tp", "2")),
             Step("ep-fsdp", cert(2, "examples/parallel/gpt_moe_leto.py", "--fsdp"))],
            [Step("fsdp-tp-w4", cert(4, "examples/parallel/gpt_parallel_leto.py", "--tp", "2"))],
        ],
        "ports": [[
            Step("ports", ("pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           "tests/test_porting.py", "tests/test_nanogpt.py", "-k",
                           "cuda-shared" if device == "cuda" else "identical and cpu"),
                 expect="ok", check="pytest"),
        ]],
        "costs": [[Step("costs", _costs(device), expect="ok", check="costs")]],
        # Megatron-Core (issue 58; megatron-core installed): tensor parallel 2 with torch's
        # DDP, and tensor 2 x data 2 at world 4 (gloo carries their collectives for CUDA
        # tensors); Megatron's own DDP refused by name before anything is retained.
        "megatron": [
            [Step("mg-tp2", cert(2, MEGATRON, "--tp", "2"))],
            [Step("mg-tp2-dp2-w4", cert(4, MEGATRON, "--tp", "2"))],
            [Step("mg-ddp-refused", (*fk(2, "certify", "--phases", "update"), "--", MEGATRON,
                                     "--megatron-ddp", "--iterations", "4"),
                  expect="refused", cuda_only=True,
                  words=("Megatron's DistributedDataParallel", "all_reduce_coalesced"))],
        ],
    }  # fmt: skip


def _phases() -> list[str]:
    from leto.plugins import PHASES

    return list(PHASES)


# The costs' variants: each check off alone, replay on every iteration (its cost per
# replay: leto run's default K is 200), all of them off.
VARIANTS = (
    ("no-replica-check", "--no-replica-check"),
    ("no-replay", "--replay-every 0"),
    ("replay-every-1", "--replay-every 1"),
    ("no-loss-guard", "--no-loss-guard"),
    ("checks-off", "--no-replica-check --replay-every 0 --no-loss-guard"),
)


def _costs(device: str) -> tuple[str, ...]:
    """bench.user_path at world 2: a GPT-2-small-shaped nanoGPT-style job (deterministic:
    replay needs it, and the bytes are compared), torchrun against leto run's defaults
    and each variant; on the CPU a tiny shape."""
    shape = (os.environ.get("LETO_W2_COST_SHAPE") or (
        "--n-layer 12 --n-embd 768 --n-head 12 --vocab 50304 --seq 1024 --batch 8 --accum 1"
        if device == "cuda" else
        "--n-layer 2 --n-embd 64 --n-head 2 --vocab 512 --seq 64 --batch 4 --accum 1"))  # fmt: skip
    shared = ("--ranks-per-gpu", "2") if device == "cuda" else ()
    variants = [f"--leto-variant={n}={flags}" for n, flags in VARIANTS]
    return ("bench.user_path", "--device", device, "--nproc-per-node", "2", *shared,
            "--iterations", os.environ.get("LETO_W2_COST_ITERS", "12"), "--skip", "4",
            "--timeout-s", "200", f"--script-args={shape} --deterministic", *variants,
            "--json", "{json}")  # fmt: skip


def run_step(step: Step, out: Path, deadline: float, lane: int, stop: threading.Event) -> Result:
    """Run ``step`` (its stdout to ``out/<name>.json``, stderr to ``.log``) within the
    deadline; judge it."""
    fmt = {"json": str(out / f"{step.name}.result.json"), "dir": str(out)}
    argv = [a.format(**fmt) if "{" in a else a for a in step.argv]
    cmd = [sys.executable, "-m", *argv]
    res = Result(step.name, None, "", command=" ".join(cmd), lane=lane)
    left = deadline - time.monotonic()
    if stop.is_set() or left < MIN_START_S:
        res.detail = f"not run: {max(0, left):.0f} s of the budget left"
        return res
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")  # fmt: skip
    with open(out / f"{step.name}.json", "w") as so, open(out / f"{step.name}.log", "w") as se:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=so, stderr=se, start_new_session=True)
        timed_out = False
        try:
            p.wait(timeout=max(1.0, left - STOP_GRACE_S - 5))
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(p)
    res.seconds, res.returncode = round(time.monotonic() - t0, 1), p.returncode
    stdout = (out / f"{step.name}.json").read_text()
    stderr = (out / f"{step.name}.log").read_text(errors="replace")
    if timed_out:
        done = stderr.count("verdict: EXACT")
        res.passed, res.detail = False, f"stopped at the budget ({done} EXACT verdicts by then)"
        return res
    res.passed, res.detail, res.data = judge(step, p.returncode, stdout, stderr, fmt["json"])
    return res


def _stop(p: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return None


def judge(step: Step, code: int, stdout: str, stderr: str, json_path: str):
    """(passed, a line saying why, the step's JSON) for a finished step."""
    if "{json}" in step.argv:  # the step writes its results to a file
        v = json.loads(Path(json_path).read_text()) if Path(json_path).exists() else {}
    else:
        v = _last_json(stdout) or {}
    said = (stdout.strip() or stderr.strip()).splitlines() or [""]
    tail = said[-1][:300]
    if step.expect == "refused":
        said = stderr + stdout
        missing = [w for w in step.words if w not in said]
        ok = code not in (0, None) and not missing
        line = next((x for x in said.splitlines() if step.words and step.words[-1] in x), tail)
        return (
            ok,
            (f"refused (exit {code}): " if ok else f"exit {code}, missing {missing}: ")
            + (line.strip()[:300]),
            v,
        )
    if v.get("refused"):
        return False, f"refused: {v.get('error', '')[:300]}", v
    if step.check == "pytest":
        last = (stdout.strip().splitlines() or [""])[-1]
        ok = code == 0 and "passed" in last and "skipped" not in last
        return ok, last[:200], {}
    if step.check == "costs":
        return code == 0, costs_line(v) if v else f"exit {code}: {tail}", v
    if step.expect == "ok":
        return code == 0, (f"exit {code}" + ("" if code == 0 else f": {tail}")), v
    cases = v.get("cases") or v.get("faults") or ([v] if "exact" in v else [])
    exact = v.get("exact")
    if step.expect == "not exact":
        diverged = v.get("first_divergence")
        ok = code == 1 and exact is False and bool(diverged)
        why = f"NOT EXACT as it must be: {diverged}" if ok else (
            f"exit {code}, exact={exact}: {v.get('fatal_detail') or tail}")  # fmt: skip
        return ok, why[:300], v
    n_exact = sum(bool(c.get("exact")) for c in cases)
    ok = code == 0 and bool(exact) and n_exact == len(cases) > 0
    notes = []
    if step.check == "sdc":
        for c in cases:
            good = c.get("detected") and c.get("named_rank") == 0
            ok = ok and bool(good)
            notes.append(f"{c.get('mode')}: {c.get('detected_by')} at {c.get('detected_at')}, "
                         f"rank {c.get('named_rank')} named, back to {c.get('rolled_back')}")  # fmt: skip
    if step.check == "fatal":
        fatal = sum(bool(c.get("fatal")) for c in cases)
        ok = ok and fatal == len(cases)
        notes.append(f"{fatal} of {len(cases)} took the fatal path")
    if any(c.get("config", {}).get("all_ranks") for c in cases):
        notes.append("ranks dead at detection: " + ", ".join(
            f"{c['phase']}/{c['mode']} {c.get('failed_ranks')}" for c in cases))  # fmt: skip
    verdict = v.get("verdict")  # certify's word (inject's is the verifiers' record)
    verdict = verdict if isinstance(verdict, str) else "EXACT" if exact else "NOT EXACT"
    line = f"{verdict}, {n_exact} of {len(cases)} exact" + "".join(f"; {n}" for n in notes)
    if not ok:
        bad = next((c for c in cases if not c.get("exact")), {})
        line += f"; first not exact: {bad.get('phase')} {bad.get('mode', '')} " + str(
            bad.get("first_divergence") or bad.get("fatal_detail") or v.get("reference_error")
            or tail)  # fmt: skip
    return ok, line[:600], v


def costs_line(v: dict) -> str:
    """The costs as ratios: each variant's median iteration against leto run's defaults
    (what turning the check off saves) and torchrun's, and per replay."""
    s = v.get("summary", {})
    base = (s.get("leto run") or {}).get("median_s")
    torch_s = (s.get("torchrun") or {}).get("median_s")
    if not base:
        return "no leto run median"
    parts = [f"leto run {base * 1e3:.1f} ms ({base / torch_s:.3f}x torchrun)" if torch_s else ""]
    for name, _ in VARIANTS:
        m = (s.get(f"leto run [{name}]") or {}).get("median_s")
        if m:
            parts.append(f"{name} {m * 1e3:.1f} ms ({m / base:.3f}x defaults)")
    on, off = (s.get("leto run [replay-every-1]") or {}), (s.get("leto run [no-replay]") or {})
    if on.get("median_s") and off.get("median_s"):
        per = on["median_s"] - off["median_s"]
        parts.append(f"one replay {per * 1e3:.1f} ms (every 200: {per / 200 / base:.4f}x)")
    letos = [r for r in v.get("runs", []) if r.get("launcher") == "leto run"]
    same = [r for r in letos if r.get("params_identical") and r.get("losses_equal")]
    parts.append(f"bit-identical to torchrun (parameters, losses): {len(same)} of {len(letos)}")
    return "; ".join(p for p in parts if p)


def run_target(name: str, device: str, out: Path, budget_s: float, lanes: int,
               only: set[str]) -> list[Result]:  # fmt: skip
    """Every lane of ``name`` at once (at most ``lanes``), within ``budget_s``."""
    plan = [[s for s in lane if (not only or s.name in only) and not (s.cuda_only and device != "cuda")]
            for lane in targets(device)[name]]  # fmt: skip
    plan = [lane for lane in plan if lane]
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    stop = threading.Event()

    def lane_run(k: int) -> list[Result]:
        got = []
        for step in plan[k]:
            r = run_step(step, out, deadline, k, stop)
            got.append(r)
            print(f"world2 {name}: {step.name}: "
                  f"{'PASS' if r.passed else 'NOT RUN' if r.passed is None else 'FAIL'} "
                  f"({r.seconds:.0f} s) {r.detail}", flush=True)  # fmt: skip
        return got

    with ThreadPoolExecutor(max_workers=max(1, min(lanes, len(plan)))) as pool:
        try:
            results = [r for got in pool.map(lane_run, range(len(plan))) for r in got]
        except KeyboardInterrupt:
            stop.set()
            raise
    return results


def report(name: str, device: str, results: list[Result], out: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        title=f"world2 {name} ({device}{', ranks sharing GPU 0 over gloo' if device == 'cuda' else ''})"
    )
    for c in ("step", "verdict", "s", "what"):
        t.add_column(c, overflow="fold")
    for r in results:
        verdict = (
            "[green]PASS[/]" if r.passed else "NOT RUN" if r.passed is None else "[red]FAIL[/]"
        )
        t.add_row(r.name, verdict, f"{r.seconds:.0f}", escape(r.detail))  # logs hold [file:line]
    Console(width=160).print(t)
    summary = {
        "target": name,
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "passed": all(r.passed for r in results),
        "steps": [{k: v for k, v in asdict(r).items() if k != "data"} for r in results],
    }
    (out.parent / f"{name}.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "target", choices=(*targets("cuda"), "all"), help="what to run (all: every target in turn)"
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: ranks share GPU 0 over gloo; cpu: the same steps, each rank a process")  # fmt: skip
    ap.add_argument("--out", default="out/w2", help="folder for each step's JSON and log")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="a target's wall-clock budget (all: each target's)")  # fmt: skip
    ap.add_argument("--lanes", type=int, default=4, help="lanes run at once")
    ap.add_argument("--only", default="", help="comma-separated step names (default: all)")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    names = list(targets(args.device)) if args.target == "all" else [args.target]
    known = {s.name for n in names for lane in targets(args.device)[n] for s in lane}
    if only - known:
        ap.error(
            f"--only: {sorted(only - known)} are no steps of {', '.join(names)} ({sorted(known)})"
        )
    ok = True
    for name in names:
        out = Path(args.out) / name
        results = run_target(name, args.device, out, args.budget_s, args.lanes, only)
        report(name, args.device, results, out)
        ok = ok and all(r.passed for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
