"""Nothing lazy on the promoted path (issue 37): a parked shadow imports ahead what its
promoted trainer would import lazily — torch's (``torch._dynamo`` behind every optimizer,
3.65 s of a 3.87 s recovery on 2 CPU cores), Leto's, and what the rank's active trainer
published — so a promoted trainer's recovery record lists no module it imported between
its promotion and the end of its first iteration (``promoted_imports``).

Fast: the import-timing finder (``ImportWatch``) on modules written for the test, the
published list, and a shadow's imports ahead in a fresh interpreter (the script's
optimizer then imports nothing; the RNG states are as before). Integration (``integ``):
the example GPT and the ported Llama, each killed mid-update at L2 on 2 ranks. Their
bytes after such a recovery are compared elsewhere (tests/test_runtime_integ.py,
tests/test_porting.py); here only the records are read, so no reference run is paid.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from faultkit.job import JobFault, run_job
from leto.trainer import imports
from leto.trainer.imports import ImportWatch
from leto.workload.train import TrainConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """``write(name, source)``: a module importable as ``name`` (removed after the test)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, source: str = "") -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_the_watch_times_what_is_imported_after_it_starts_and_nothing_before(modules):
    modules("l37_before")
    modules("l37_inner", "import time\ntime.sleep(0.05)\n")
    modules("l37_outer", "import l37_inner\n")
    modules("l37_broken", "raise RuntimeError('broken at import')\n")
    import l37_before  # noqa: F401

    watch = ImportWatch().start()
    try:
        import l37_before  # noqa: F401, F811 - already loaded: not an import
        import l37_outer  # noqa: F401

        with pytest.raises(RuntimeError):
            import l37_broken  # noqa: F401
        with pytest.raises(ModuleNotFoundError):
            import l37_missing  # noqa: F401
    finally:
        got = watch.stop()
    assert watch not in sys.meta_path, "the watch stayed installed after stop()"
    assert [g["module"] for g in got] == ["l37_outer"], got
    (outer,) = got
    assert outer["modules"] == 2, outer  # itself and l37_inner, nested
    assert outer["s"] >= 0.05, f"the nested import's 50 ms sleep was not counted ({outer})"
    assert watch.modules == ["l37_outer", "l37_inner"], watch.modules
    # The module runs, and stays, with its own loader: the watch leaves no trace on it.
    loader = type(sys.modules["l37_outer"].__loader__).__name__
    assert loader == "SourceFileLoader", loader
    assert sys.modules["l37_outer"].__spec__.loader is sys.modules["l37_outer"].__loader__


def test_what_a_trainer_publishes_its_next_shadow_imports_while_parked(modules, capsys):
    store = dist.HashStore()
    modules("l37_lazy_in_the_script")
    timings = {"imports_learned": -1}
    cpu = torch.device("cpu")
    assert not imports.import_learned(store, 3, cpu, timings), "nothing published yet"
    imports.publish(store, 3, [{"module": "l37_lazy_in_the_script", "s": 0.1, "modules": 1}])
    imports.publish(store, 3, [])  # a trainer that imported nothing adds nothing
    assert imports.learned(store, 3) == ["l37_lazy_in_the_script"]
    assert imports.learned(store, 2) == [], "another rank's list"
    assert imports.import_learned(store, 3, cpu, timings)
    assert "l37_lazy_in_the_script" in sys.modules
    assert timings["imports_learned"] == 1 and timings["imports_learned_s"] >= 0, timings
    assert "imported ahead what its trainers imported: l37_lazy_in_the_script" in (
        capsys.readouterr().err
    )


# In a fresh interpreter (this one has imported torch._dynamo long ago): a shadow's
# imports ahead, then the script's optimizer, scheduler and scaler under a watch.
_FRESH = """
import json, random, sys
import torch
import torch.distributed as dist
from leto.trainer import imports
torch.manual_seed(7); random.seed(7)
cpu_state, py_state = torch.random.get_rng_state(), random.getstate()
before = "torch._dynamo" in sys.modules
out = imports.warm_imports(dist.HashStore(), 0, torch.device("cpu"))
kept = torch.equal(torch.random.get_rng_state(), cpu_state) and random.getstate() == py_state
watch = imports.ImportWatch().start()
p = torch.nn.Parameter(torch.zeros(4, 4))
opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
torch.amp.GradScaler("cpu", enabled=False)
print(json.dumps({"before": before, "out": out, "kept": kept, "after": watch.stop()}))
"""


def test_a_shadow_imports_ahead_what_the_scripts_optimizer_would_and_keeps_the_rng():
    p = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert not got["before"], "torch._dynamo was loaded before: the test shows nothing"
    assert got["after"] == [], f"the script's optimizer still imported {got['after']}"
    assert got["kept"], "importing ahead changed torch's or Python's RNG state"
    out = got["out"]
    assert "imports_warmup_failed" not in out and out["imports_learned"] == -1, out


# -- end to end ------------------------------------------------------------------------

ITERS = 4
KILL = "update.optimizer@2#1"  # rank 1, mid-update: the promoted trainers finish it


def _promoted_imports(summary: dict) -> dict[str, list]:
    (rec,) = summary["recoveries"]
    trainers = rec["trainers"]
    assert set(trainers) == {"0", "1"}, rec
    assert all(t["role"] == "promoted" for t in trainers.values()), trainers
    for r, t in trainers.items():
        assert "imports_warmup_s" in t and "imports_warmup_failed" not in t, (r, t)
        assert "promoted_imports_s" in t, f"rank {r}'s record has no promoted_imports: {t}"
    return {r: t["promoted_imports"] for r, t in trainers.items() if t["promoted_imports"]}


@pytest.mark.integ
def test_the_example_gpt_promoted_at_l2_imports_nothing_on_its_way_to_training(tmp_path):
    t0 = time.monotonic()
    # A page of every protection group lost as well: the rebuild is on the path too.
    fault = JobFault(1, KILL, lose_pages=1)
    got = run_job(2, TrainConfig(iterations=ITERS), tmp_path, [fault], shadow_level="L2")
    lazy = _promoted_imports(got)
    assert not lazy, f"modules imported after promotion (rank: module, s): {lazy}"
    took = time.monotonic() - t0
    print(f"job {took:.1f} s")


@pytest.mark.integ
def test_the_ported_llama_promoted_at_l2_imports_nothing_on_its_way_to_training(
    ported_llama_killed,
):
    # The job tests/test_porting.py compares with DDP (tests/conftest.py): rank 1 killed
    # at KILL, L2 shadows, pages of every kind lost (the rebuild on the path too).
    got, _ = ported_llama_killed
    lazy = _promoted_imports(got)
    assert not lazy, f"modules imported after promotion (rank: module, s): {lazy}"
