"""The overhead users see: a plain torchrun script and its Leto port, started as users
start them, side by side in one run.

Runs (a) ``torchrun --standalone --nproc-per-node N examples/porting/gpt_torchrun.py``
and (b) ``leto run --nproc-per-node N examples/porting/gpt_leto.py`` with ``leto run``'s
default flags — shadows, scrub, checkpoints (the first save once its staging buffers
exist, then Young's interval), all as shipped — and (c) any ``--leto-variant "name=--flag value"``
(leto run flags a user could tune), each in its own folder under ``--work-dir``, with the
same script arguments. ``--repeats R`` runs the list R times, every other time in
reverse order (drift in clocks or caches falls on both sides). Every subprocess has a
time limit (``--timeout-s``); one that runs past it is stopped (SIGTERM to its session,
which ``leto run`` and torchrun pass on to what they started; SIGKILL 30 s later).

Reported per run, from the script's own ``iterations.jsonl`` (rank 0; each iteration
timed end to end with the device waited for, so whatever Leto does between two
iterations is in the next one's time): the median and max iteration time over the steady
iterations (after ``--skip``), every iteration's time (a stall shows), the ratio of the
median to torchrun's, the time from the launch until the first iteration had ended (a
fresh job's wait, where the script logs ``done_at``), the time outside the loop
(start-up, the final save, shutdown),
the script's ``torch.cuda.max_memory_allocated`` and the device-wide used memory
(``nvidia-smi`` sampled every 0.2 s; None on the CPU). Only the device-wide figure
compares the two: Leto's retained state (parameters, gradients, optimizer state, parity
buffers) lives in CUDA VMM memory owned by the state manager, another process, so the
trainer's own allocator never sees it; the device-wide figure also holds the shadow's
CUDA context. Then exactness: each run's final parameters against the torchrun run of
the same repeat (bytes, every rank; the first differing parameter is named) and the
per-iteration losses compared exactly. On CUDA, bit-identity is expected only with
``--script-args=--deterministic`` (torchrun repeated against itself, ``--repeats 2``,
shows what to expect without it: on the H200 its losses part at iteration 1). Prints a
table, writes ``--json``; the exit code is nonzero if any run failed.

    python -m bench.user_path --preset cpu-small --json out/user_path_cpu.json
    python -m bench.user_path --preset h200-1b --iterations 12 --skip 4 \\
        --leto-variant "no-shadow=--shadow-level off"
    python -m bench.user_path --job moe --device cpu --nproc-per-node 2 --iterations 30

``--job megatron`` runs the Megatron-Core pair (``examples/megatron``; its shape from
``--script-args``, e.g. ``--layers 20 --hidden 2048 --heads 16 --vocab 50304 --seq 1024
--micro-batch 4 --micro-batches 4 --megatron-ddp --distributed-optimizer --bf16``).
``--job moe`` runs the mixture-of-experts pair instead (``examples/parallel/gpt_moe.py``
under torchrun, ``gpt_moe_leto.py`` under leto run: experts sharded over the ranks,
all-to-all dispatch); its model is fixed (no shape flags), so the presets' shapes do not
apply to it.

Not covered: recovery (bench/recovery_speed.py), multi-node jobs, the leto run
flags' effects one by one (give them as variants), host memory.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PORTING = REPO / "examples" / "porting"
TORCHRUN_SCRIPT = PORTING / "gpt_torchrun.py"
LETO_SCRIPT = PORTING / "gpt_leto.py"
# --job: the pair of scripts (torchrun, leto run) each run starts.
PARALLEL = REPO / "examples" / "parallel"
JOBS = {
    "gpt": (TORCHRUN_SCRIPT, LETO_SCRIPT),
    "moe": (PARALLEL / "gpt_moe.py", PARALLEL / "gpt_moe_leto.py"),
    "megatron": (REPO / "examples" / "megatron" / "gpt_torchrun.py",
                 REPO / "examples" / "megatron" / "gpt_leto.py"),
}  # fmt: skip
TORCHRUN = "torchrun"
LETO = "leto run"

# The model and batch shape; every field is passed to both scripts explicitly, so these
# defaults, not the scripts', are the ones a run without a preset uses.
SHAPE = dict(n_layer=12, n_embd=768, n_head=12, vocab=50304, seq=1024, batch=8, accum=1)
GPT_1B = dict(n_layer=20, n_embd=2048, n_head=16, vocab=50304, seq=1024)  # 1.11 B parameters
PRESETS = {
    # 4.3 M parameters, 4 K tokens per rank and iteration (2 micro-batches of 8 x 256).
    "cpu-small": {
        "device": "cpu",
        "nproc_per_node": 2,
        "iterations": 8,
        "shape": dict(n_layer=4, n_embd=256, n_head=4, vocab=4096, seq=256, batch=8, accum=2),
    },
    # 16 K tokens per iteration.
    "h200-1b": {
        "device": "cuda",
        "nproc_per_node": 1,
        "iterations": 12,
        "shape": {**GPT_1B, "batch": 16, "accum": 1},
    },
    # 128 K tokens per iteration: 8 micro-batches of 16 K.
    "h200-1b-128k": {
        "device": "cuda",
        "nproc_per_node": 1,
        "iterations": 12,
        "shape": {**GPT_1B, "batch": 16, "accum": 8},
    },
}
STOP_GRACE_S = 30.0  # after SIGTERM, before SIGKILL: leto run stops its cells in this time


@dataclass(frozen=True)
class Launch:
    """One way to start the job: torchrun, or leto run with ``leto_flags`` (none: its
    defaults)."""

    name: str
    launcher: str  # TORCHRUN or LETO
    leto_flags: tuple[str, ...] = field(default=())
    env: tuple[tuple[str, str], ...] = field(default=())  # added to the job's environment


def parse_variant(text: str) -> Launch:
    """``"name=--flag value ..."`` -> a leto run launch with those flags; leading
    ``KEY=VALUE`` words (upper-case keys) go to its environment instead, e.g.
    ``"unfused=LETO_CHUNK_PASS=0"`` (the benchmarks' switches)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: a variant is NAME=FLAGS, e.g. 'no-shadow=--shadow-level off'"
        )
    words, env = shlex.split(flags), []
    while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env.append((key, value))
    return Launch(f"{LETO} [{name.strip()}]", LETO, tuple(words), tuple(env))


def shape_flags(shape: dict) -> list[str]:
    return [a for k, v in shape.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def split_script_args(text: str, shape: dict) -> tuple[dict, list[str]]:
    """``--script-args``: its shape flags update ``shape``; the rest pass through as
    given. ``--out`` and ``--iterations`` are the benchmark's."""
    ap = argparse.ArgumentParser(add_help=False)
    for k in shape:
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=shape[k])
    ap.add_argument("--out")
    ap.add_argument("--iterations")
    ns, rest = ap.parse_known_args(shlex.split(text))
    if ns.out is not None or ns.iterations is not None:
        raise SystemExit(
            "--script-args: --out and --iterations are the benchmark's (use --iterations); "
            "nothing was run"
        )
    return {k: getattr(ns, k) for k in shape}, rest


def load_model_module():
    """The ``nanogpt_model.py`` both scripts import, as a module."""
    if "nanogpt_model" in sys.modules:
        return sys.modules["nanogpt_model"]
    spec = importlib.util.spec_from_file_location("nanogpt_model", PORTING / "nanogpt_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up while it loads)
    spec.loader.exec_module(mod)
    return mod


def parameters(shape: dict) -> int:
    """The script's GPT's parameter count (tied weights once), built on the meta device
    from the same ``nanogpt_model.py`` the scripts import."""
    import torch

    mod = load_model_module()
    cfg = mod.GPTConfig(shape["vocab"], shape["seq"], shape["n_layer"], shape["n_head"],
                        shape["n_embd"])  # fmt: skip
    with torch.device("meta"):
        return sum(p.numel() for p in mod.GPT(cfg).parameters())


def moe_size(nproc: int) -> dict:
    """The mixture-of-experts example's parameters (every expert once) and tokens per
    iteration over ``nproc`` ranks."""
    spec = importlib.util.spec_from_file_location("gpt_moe", PARALLEL / "gpt_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    whole = mod.MoEGPT(0, 1, None)  # one rank holding all the experts
    return {
        "parameters": sum(p.numel() for p in whole.parameters()),
        "tokens_per_iteration": nproc * mod.BATCH * mod.SEQ,
    }


def megatron_size(nproc: int, script_args: list[str]) -> dict:
    """Tokens per iteration of the Megatron-Core example as ``script_args`` shape it (its
    own defaults otherwise); its parameter count is not derived here (None)."""
    ap = argparse.ArgumentParser(add_help=False)
    for flag, default in (("--tp", 1), ("--pp", 1), ("--seq", 32), ("--micro-batch", 4),
                          ("--micro-batches", 2)):  # fmt: skip
        ap.add_argument(flag, type=int, default=default)
    ns, _ = ap.parse_known_args(script_args)
    data_parallel = nproc // (ns.tp * ns.pp)
    return {
        "parameters": None,
        "tokens_per_iteration": data_parallel * ns.micro_batches * ns.micro_batch * ns.seq,
    }


def shared_gpu(launches: list[Launch], ranks_per_gpu: int) -> list[Launch]:
    """``launches`` with ranks sharing GPUs ``ranks_per_gpu`` at a time (issue 47): leto
    run's ``--ranks-per-gpu``, and for torchrun the variable its scripts read (gloo on
    the shared GPU, as leto run's trainers get)."""
    n = str(ranks_per_gpu)
    return [
        replace(x, env=(*x.env, ("LETO_RANKS_PER_GPU", n)))
        if x.launcher == TORCHRUN
        else replace(x, leto_flags=("--ranks-per-gpu", n, *x.leto_flags))
        for x in launches
    ]


def leto_device_flags(device: str) -> list[str]:
    """``--device`` for leto run only where its default would not pick ``device``: older
    versions default to cpu; newer ones (default None) pick cuda when torch sees a GPU,
    and a CPU run here hides the GPUs."""
    from leto.cli import build_parser

    default = build_parser().parse_args(["run", "script.py"]).device
    return [] if default in (None, device) else ["--device", device]


def command(
    launch: Launch, nproc: int, device: str, script_args: list[str], out: Path, job: str = "gpt"
) -> list[str]:
    """The command line a user would type (through this interpreter)."""
    plain, port = JOBS[job]
    if launch.launcher == TORCHRUN:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), str(plain), *script_args,
                "--out", str(out)]  # fmt: skip
    from leto.job.store import free_port

    # --master-port: leto run's fixed default (29500) could be held by another job on the
    # machine; torchrun --standalone picks a free one too. It changes nothing else.
    return [sys.executable, "-m", "leto.cli", "run", "--json", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), *leto_device_flags(device), *launch.leto_flags,
            str(port), *script_args, "--out", str(out)]  # fmt: skip


class DeviceMemory:
    """Used memory of every GPU, device-wide, from ``nvidia-smi -lms 200`` read on a
    thread while a job runs (every process's memory: the trainers', a shadow's, the
    state manager's VMM pool)."""

    def __init__(self, period_ms: int = 200):
        self.peak_mib: dict[int, int] = {}
        self.before_mib: dict[int, int] = {}
        self.samples = 0
        exe = shutil.which("nvidia-smi")
        self.proc = None
        if exe is None:
            return
        self.proc = subprocess.Popen(
            [exe, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
             "-lms", str(period_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                gpu, used = (int(v) for v in line.split(","))
            except ValueError:
                continue  # "[N/A]" or a message: not a sample
            self.before_mib.setdefault(gpu, used)
            self.peak_mib[gpu] = max(used, self.peak_mib.get(gpu, 0))
            self.samples += 1

    def stop(self) -> dict | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=5)
        if not self.samples:
            return None
        return {
            "peak_mib": max(self.peak_mib.values()),
            "per_gpu_peak_mib": self.peak_mib,
            "before_mib": self.before_mib,  # each GPU's first sample, as the job started
            "samples": self.samples,
        }


def _stop(p: subprocess.Popen) -> None:
    """Stop a job run past its time: SIGTERM to its session (leto run's agent and
    torchrun stop what they started), SIGKILL if it is still there after the grace."""
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


def run_one(
    launch: Launch,
    work: Path,
    nproc: int,
    device: str,
    script_args: list[str],
    timeout_s: float,
    job: str = "gpt",
    extra_env: dict[str, str] | None = None,
) -> dict:
    """Start one job in ``work`` (its cwd: leto run's default log folder and checkpoints
    land there) and wait for it; what it measured, as a dict. ``script_args`` hold
    everything but ``--out`` (``work/out``); ``extra_env`` is added to the job's
    environment (e.g. a profiler's variables, bench.update_breakdown)."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    cmd = command(launch, nproc, device, script_args, out, job)
    env = {**os.environ, **dict(launch.env), **(extra_env or {})}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the scripts take a GPU whenever they see one
    memory = DeviceMemory() if device == "cuda" else None
    res = {"name": launch.name, "launcher": launch.launcher, "leto_flags": list(launch.leto_flags),
           "env": dict(launch.env),
           "command": shlex.join(cmd), "work": str(work), "timed_out": False}  # fmt: skip
    with open(work / "stdout.txt", "w") as so, open(work / "stderr.txt", "w") as se:
        t0, res["launched_at"] = time.perf_counter(), time.time()
        p = subprocess.Popen(cmd, cwd=work, env=env, stdout=so, stderr=se, start_new_session=True)
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            res["timed_out"] = True
            _stop(p)
        res["wall_s"] = time.perf_counter() - t0
    res["returncode"] = p.returncode
    res["device_memory"] = memory.stop() if memory is not None else None
    log = out / "iterations.jsonl"
    res["records"] = read_iterations(log) if log.exists() else []
    if launch.launcher == LETO:
        res["leto_summary"] = _last_json_line(work / "stdout.txt")
    if res["returncode"] != 0 or res["timed_out"]:
        err = (work / "stderr.txt").read_text()
        res["error"] = (
            f"{'timed out after ' + str(timeout_s) + ' s, ' if res['timed_out'] else ''}"
            f"exit code {res['returncode']}; {_first_errors(err)}stderr ends: {err[-1500:]}"
        )
    return res


_ERROR_LINE = re.compile(r"error|exception|terminate|abort|what\(\)|signal|killed", re.I)


def _first_errors(stderr: str, n: int = 6) -> str:
    """The first lines of ``stderr`` that name an error: a launcher's summary at its end
    says only which rank died of what signal; why is above it."""
    lines = [ln.strip() for ln in stderr.splitlines() if _ERROR_LINE.search(ln)][:n]
    return "first error lines: " + " | ".join(lines) + "; " if lines else ""


def _last_json_line(path: Path) -> dict | None:
    for line in reversed(path.read_text().strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def read_iterations(path: Path) -> list[dict]:
    """A script's ``iterations.jsonl``: one dict per iteration, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(records: list[dict], skip: int, launched_at: float | None = None) -> dict:
    """Iteration times of one run: the median, max and mean over the iterations after the
    first ``skip`` (warm-up: allocator growth, cuDNN/cuBLAS choices, lazy set-up), and
    every iteration's time. A run with no steady iteration has None for the three.
    ``first_done_s``: from the launch (``launched_at``) until the first iteration had
    ended, where the script logs ``done_at`` (a fresh job's wait for its first step)."""
    times = [r["wall_s"] for r in records]
    steady = times[skip:]
    first_done = records[0].get("done_at") if records else None
    return {
        "first_done_s": None if first_done is None or launched_at is None
        else first_done - launched_at,
        "iterations": len(times),
        "steady_iterations": len(steady),
        "median_s": statistics.median(steady) if steady else None,
        "max_s": max(steady) if steady else None,
        "mean_s": statistics.fmean(steady) if steady else None,
        "iteration_s": times,
        "loop_s": sum(times),
        "peak_allocated_bytes": max((r.get("peak_allocated_bytes", 0) for r in records), default=0),
    }


def ratio(median_s: float | None, base_s: float | None) -> float | None:
    if median_s is None or not base_s:
        return None
    return median_s / base_s


def compare_losses(a: list[dict], b: list[dict]) -> str | None:
    """None if both runs logged the same iterations with exactly the same losses, else
    what differs first. (JSON keeps a float's every bit: it writes the shortest repr.)"""
    la = {r["iteration"]: r["loss"] for r in a}
    lb = {r["iteration"]: r["loss"] for r in b}
    if la.keys() != lb.keys():
        return f"logged iterations differ: {sorted(la)} vs {sorted(lb)}"
    for it in sorted(la):
        if la[it] != lb[it]:
            return f"iteration {it}: loss {la[it]!r} vs {lb[it]!r}"
    return None


def compare_params(a: Path, b: Path, world: int) -> str | None:
    """None if every rank's final parameters in folder ``b`` have the bytes of those in
    ``a``, else the first difference: rank, parameter, byte offset."""
    import torch

    for r in range(world):
        fa, fb = a / f"rank{r}.params.pt", b / f"rank{r}.params.pt"
        for f in (fa, fb):
            if not f.exists():
                return f"rank {r}: {f} is missing"
        x = torch.load(fa, map_location="cpu", weights_only=True)
        y = torch.load(fb, map_location="cpu", weights_only=True)
        if x.keys() != y.keys():
            return f"rank {r}: parameter names differ: {sorted(x.keys() ^ y.keys())}"
        for k in x:
            if x[k].shape != y[k].shape or x[k].dtype != y[k].dtype:
                was, now = (f"{t[k].dtype} {tuple(t[k].shape)}" for t in (x, y))
                return f"rank {r}: {k} is {was} vs {now}"
            u = x[k].contiguous().view(torch.uint8).flatten()
            v = y[k].contiguous().view(torch.uint8).flatten()
            if not torch.equal(u, v):
                at = int((u != v).nonzero()[0])
                return f"rank {r}: {k} differs first at byte {at}"
    return None


def _prune(work: Path) -> None:
    """Drop a finished run's checkpoints (a 1 B model's DCP save is 13 GB; leto run's
    default folder is under its cwd)."""
    for d in work.rglob("checkpoints"):
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def _machine(device: str) -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else None
    return {"host": platform.node(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": gpu,
            # Other processes share the cores (a CPU run is slowed by them): the load says.
            "load_avg_1_5_15": os.getloadavg()}  # fmt: skip


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def print_table(res: dict) -> None:
    """The table, then each run's every iteration (stalls show there) and what differs."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        title=f"The user path: {res['nproc_per_node']} rank(s) on {res['device']}, "
        f"{_params_text(res)}, {res['tokens_per_iteration']} tokens "
        f"per iteration; median, mean and max of iterations {res['skip']}+ (the mean "
        f"carries what comes every so often: a checkpoint's scrub and staging)"
    )
    cols = ("run", "median ms", "mean ms", "max ms", "x torchrun", "mean x", "to 1st iteration s",
            "outside loop s", "peak alloc GiB", "device GiB", "params", "losses")  # fmt: skip
    for c in cols:
        t.add_column(c)
    for r in res["runs"]:
        mem = r.get("device_memory")
        t.add_row(
            escape(f"{r['name']} #{r['repeat']}"),  # a variant's "[name]" is not markup
            _ms(r.get("median_s")),
            _ms(r.get("mean_s")),
            _ms(r.get("max_s")),
            "-" if r.get("ratio") is None else f"{r['ratio']:.3f}",
            "-" if r.get("mean_ratio") is None else f"{r['mean_ratio']:.3f}",
            "-" if r.get("first_done_s") is None else f"{r['first_done_s']:.1f}",
            "-" if r.get("outside_loop_s") is None else f"{r['outside_loop_s']:.1f}",
            _gib(r.get("peak_allocated_bytes")) if res["device"] == "cuda" else "-",
            "-" if mem is None else f"{mem['peak_mib'] / 1024:.1f}",
            _verdict(r.get("params_identical"), "bit-identical"),
            _verdict(r.get("losses_equal"), "equal"),
            style="red" if r.get("error") else None,
        )
    # Piped (a device call's log), rich would cut the table to 80 columns.
    (Console() if sys.stdout.isatty() else Console(width=140)).print(t)
    for r in res["runs"]:
        times = " ".join(_ms(s) for s in r.get("iteration_s", []))
        print(f"{r['name']} #{r['repeat']}: iterations, ms: {times or '-'}")
        for why in ("params_difference", "losses_difference"):
            if r.get(why):
                print(f"  {why.split('_')[0]} differ from {r['compared_with']}: {r[why]}")
        if r.get("error"):
            print(f"  FAILED: {r['error']}", file=sys.stderr)


def _params_text(res: dict) -> str:
    n = res.get("parameters")
    return f"{n / 1e6:.1f} M parameters" if n else f"the {res['job']} job"


def _verdict(ok: bool | None, word: str) -> str:
    return "-" if ok is None else word if ok else "NO"  # -: the reference, or a failed run


def run_all(
    launches: list[Launch],
    work: Path,
    nproc: int,
    device: str,
    script_args: list[str],
    iterations: int,
    skip: int,
    timeout_s: float,
    repeats: int = 1,
    keep_work: bool = True,
    json_path: str | None = None,
    res: dict | None = None,
    job: str = "gpt",
) -> list[dict]:
    """Run ``launches`` (torchrun first) ``repeats`` times, every other time in reverse
    order, each in ``work/rep{i}/<name>``; summarize each run and compare it with the
    torchrun run of its repeat (a later torchrun with the first one): final parameters
    (every rank's bytes) and losses. A failed run has ``error``. Without ``keep_work``
    each run's parameters are removed once compared. With ``json_path``, ``res`` with
    the runs so far is written after every repeat (what is done survives a time limit)."""
    if launches[0].launcher != TORCHRUN:
        raise ValueError("the first launch is the torchrun reference")
    runs: list[dict] = []
    reference = None  # the first torchrun run that worked: later torchrun runs against it
    for rep in range(repeats):
        order = launches if rep % 2 == 0 else launches[::-1]
        done = []
        for launch in order:
            slug = "".join(c if c.isalnum() else "_" for c in launch.name).strip("_")
            r = run_one(
                launch, work / f"rep{rep}" / slug, nproc, device, script_args, timeout_s, job
            )
            _prune(Path(r["work"]))
            r["repeat"] = rep
            r.update(summarize(r.pop("records"), skip, r.get("launched_at")))
            r["outside_loop_s"] = r["wall_s"] - r["loop_s"] if r["iterations"] else None
            if r["iterations"] != iterations and "error" not in r:
                r["error"] = f"logged {r['iterations']} of {iterations} iterations"
            print(
                f"{r['name']} #{rep}: {'FAILED' if 'error' in r else 'ok'} in "
                f"{r['wall_s']:.1f} s, median {_ms(r['median_s'])} ms",
                flush=True,
            )
            done.append(r)
            if json_path:  # what is done survives a time limit
                Path(json_path).write_text(
                    json.dumps({**(res or {}), "runs": runs + done}, indent=2)
                )
        base = next(r for r in done if r["launcher"] == TORCHRUN)
        if reference is None and "error" not in base:
            reference = base
        for r in done:
            r["ratio"] = ratio(r["median_s"], base["median_s"])
            r["mean_ratio"] = ratio(r.get("mean_s"), base.get("mean_s"))
            ref = base if r is not base else reference
            if ref is None or ref is r or "error" in r or "error" in ref:
                continue
            r["compared_with"] = f"{ref['name']} #{ref['repeat']}"
            a, b = Path(ref["work"]) / "out", Path(r["work"]) / "out"
            r["params_difference"] = compare_params(a, b, nproc)
            r["params_identical"] = r["params_difference"] is None
            r["losses_difference"] = compare_losses(
                read_iterations(a / "iterations.jsonl"), read_iterations(b / "iterations.jsonl")
            )
            r["losses_equal"] = r["losses_difference"] is None
        if not keep_work:  # parameters: 4.4 GB a rank at 1 B
            for r in done:
                if r is not reference or rep == repeats - 1:
                    for f in (Path(r["work"]) / "out").glob("rank*.params.pt"):
                        f.unlink()
        runs += done
        if json_path:
            Path(json_path).write_text(json.dumps({**(res or {}), "runs": runs}, indent=2))
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="device, ranks, model and batch")
    ap.add_argument(
        "--job",
        choices=sorted(JOBS),
        default="gpt",
        help="gpt: the nanoGPT-style pair (examples/porting); moe: the mixture-of-experts "
        "pair (examples/parallel/gpt_moe*.py; its model is fixed: no preset or shape flags); "
        "megatron: the Megatron-Core pair (examples/megatron; shaped by --script-args)",
    )
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), help="default: the preset's, else cuda if seen"
    )
    ap.add_argument("--nproc-per-node", type=int, help="ranks (default: the preset's, else 1)")
    ap.add_argument(
        "--iterations", type=int, help="iterations per run (default: the preset's, else 10)"
    )
    ap.add_argument(
        "--skip", type=int, default=3, help="first iterations left out of median and max"
    )
    ap.add_argument(
        "--script-args",
        default="",
        help="more flags for both scripts, one string: shape flags (--n-layer, --n-embd, "
        "--n-head, --vocab, --seq, --batch, --accum) override the preset's; others "
        "(--deterministic, --seed, --lr, --warmup) pass through. Write it with '=' "
        "(--script-args='--deterministic'): a value that starts with a dash",
    )
    ap.add_argument(
        "--leto-variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also run leto run with these flags (repeatable), e.g. 'L1=--shadow-level L1'",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="run the list this many times, alternating its order"
    )
    ap.add_argument(
        "--timeout-s", type=float, default=900.0, help="time limit of each run, seconds"
    )
    ap.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        help="testing on fewer GPUs than ranks: ranks N at a time on a GPU, over gloo (leto "
        "run --ranks-per-gpu N; the torchrun scripts read LETO_RANKS_PER_GPU=N)",
    )
    ap.add_argument("--work-dir", help="runs' folders (default: a new temporary folder)")
    ap.add_argument(
        "--keep-work",
        action="store_true",
        help="keep every run's folder whole (default: checkpoints and parameters are "
        "removed once compared; logs and iterations.jsonl stay)",
    )
    ap.add_argument("--json", dest="json_path", help="write the results as JSON here")
    args = ap.parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    if args.device is None:
        import torch

        args.device = preset.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    nproc = args.nproc_per_node or preset.get("nproc_per_node", 1)
    iterations = args.iterations or preset.get("iterations", 10)
    if args.skip >= iterations:
        ap.error(f"--skip {args.skip} leaves none of {iterations} iterations to measure")
    if args.job != "gpt" and args.preset:
        ap.error(
            f"--job {args.job} has its own model flags: give --device, --nproc-per-node and "
            "--script-args, not --preset"
        )
    shapes = {**SHAPE, **preset.get("shape", {})} if args.job == "gpt" else {}
    shape, passthrough = split_script_args(args.script_args, shapes)
    script_args = [*shape_flags(shape), "--iterations", str(iterations), *passthrough]
    names = [v.name for v in args.leto_variant]
    if len(set(names)) != len(names):
        ap.error(f"--leto-variant: names repeat: {names}")
    launches = [Launch(TORCHRUN, TORCHRUN), Launch(LETO, LETO), *args.leto_variant]
    if args.ranks_per_gpu > 1:
        if args.device != "cuda":
            ap.error(f"--ranks-per-gpu {args.ranks_per_gpu} shares GPUs: it needs --device cuda")
        launches = shared_gpu(launches, args.ranks_per_gpu)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="leto-user-path-")).absolute()
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    res = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m bench.user_path "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": _machine(args.device),
        "preset": args.preset,
        "device": args.device,
        "nproc_per_node": nproc,
        "shape": shape,
        "script_args": script_args,
        "deterministic": "--deterministic" in passthrough,
        "job": args.job,
        **(
            {
                "parameters": parameters(shape),
                "tokens_per_iteration": nproc * shape["accum"] * shape["batch"] * shape["seq"],
            }
            if args.job == "gpt"
            else moe_size(nproc)
            if args.job == "moe"
            else megatron_size(nproc, passthrough)
        ),
        "iterations": iterations,
        "skip": args.skip,
        "work_dir": str(work),
        "runs": [],
    }
    print(
        f"{_params_text(res)}, {res['tokens_per_iteration']} tokens per "
        f"iteration, {nproc} rank(s) on {args.device}; runs in {work}",
        flush=True,
    )
    res["runs"] = run_all(
        launches, work, nproc, args.device, script_args, iterations, args.skip,
        args.timeout_s, args.repeats, args.keep_work, args.json_path, res, args.job,
    )  # fmt: skip
    res["summary"] = _summary(res["runs"])
    res["load_avg_1_5_15_at_end"] = os.getloadavg()
    print_table(res)
    for name, s in res["summary"].items():
        print(f"{name}: median {_ms(s['median_s'])} ms over {s['runs']} run(s), "
              f"{'-' if s['ratio'] is None else format(s['ratio'], '.3f')}x torchrun; "
              f"mean {_ms(s['mean_s'])} ms, "
              f"{'-' if s['mean_ratio'] is None else format(s['mean_ratio'], '.3f')}x")  # fmt: skip
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(res, indent=2))
    return 1 if any("error" in r for r in res["runs"]) else 0


def _summary(runs: list[dict]) -> dict:
    """Per launch, the median of its runs' medians and its ratio to torchrun's."""
    medians: dict[str, list[float]] = {}
    means: dict[str, list[float]] = {}
    for r in runs:
        if "error" not in r and r["median_s"] is not None:
            medians.setdefault(r["name"], []).append(r["median_s"])
            means.setdefault(r["name"], []).append(r["mean_s"])
    base = statistics.median(medians[TORCHRUN]) if medians.get(TORCHRUN) else None
    base_mean = statistics.median(means[TORCHRUN]) if means.get(TORCHRUN) else None
    out = {}
    for name, m in medians.items():
        med, mean = statistics.median(m), statistics.median(means[name])
        out[name] = {"median_s": med, "runs": len(m), "ratio": ratio(med, base),
                     "mean_s": mean, "mean_ratio": ratio(mean, base_mean)}  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
