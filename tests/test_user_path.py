"""The user path (``bench/user_path.py``): a nanoGPT-style torchrun script and its Leto
port (``examples/porting/gpt_torchrun.py``, ``gpt_leto.py``). The port changes 7 lines
(its ``model.no_sync()`` kept: ``run.model`` is DDP-shaped); started as users start
them — torchrun, and ``leto run`` with its default flags — on two gloo ranks, the two
end with the same bytes in every parameter and log the same loss every iteration. The benchmark's summary (median, max, skip, ratio) and
its comparisons are checked on synthetic files first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import user_path
from tests.test_porting import changed_lines

TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab=256, seq=32, batch=4, accum=2)
ITERS = 4


def test_the_port_changes_at_most_7_lines():
    changed = changed_lines(user_path.TORCHRUN_SCRIPT, user_path.LETO_SCRIPT)
    assert 0 < changed <= 7, f"{changed} lines changed"


def _log(path: Path, walls: list[float], losses: list[float] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    losses = losses or [1.0 + i for i in range(len(walls))]
    lines = [
        json.dumps({"iteration": i, "wall_s": w, "loss": x, "peak_allocated_bytes": 100 * i})
        for i, (w, x) in enumerate(zip(walls, losses, strict=True))
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_summary_skips_warmup_and_keeps_every_iteration(tmp_path):
    # A slow first iteration (skipped), a stall at iteration 4 (the max, not the median).
    walls = [9.0, 1.0, 3.0, 2.0, 7.0, 2.5]
    s = user_path.summarize(user_path.read_iterations(_log(tmp_path / "a.jsonl", walls)), skip=2)
    assert s["median_s"] == 2.75, s  # of 3.0, 2.0, 7.0, 2.5
    assert s["max_s"] == 7.0, s
    assert s["steady_iterations"] == 4 and s["iterations"] == 6, s
    assert s["iteration_s"] == walls, "every iteration is reported, the skipped ones too"
    assert s["loop_s"] == sum(walls)
    assert s["peak_allocated_bytes"] == 500
    assert user_path.ratio(s["median_s"], 2.2) == pytest.approx(1.25)
    assert user_path.ratio(None, 2.2) is None and user_path.ratio(1.0, None) is None


def test_summary_of_a_run_with_no_steady_iteration_has_no_figures():
    s = user_path.summarize([{"iteration": 0, "wall_s": 1.0, "loss": 2.0}], skip=3)
    assert (s["median_s"], s["max_s"], s["steady_iterations"]) == (None, None, 0), s


def test_losses_compare_exactly(tmp_path):
    a = user_path.read_iterations(_log(tmp_path / "a.jsonl", [1.0] * 3, [2.5, 2.25, 2.0]))
    same = user_path.read_iterations(_log(tmp_path / "b.jsonl", [5.0] * 3, [2.5, 2.25, 2.0]))
    off = [2.5, 2.25 + 2**-50, 2.0]  # the last bit of a double
    b = user_path.read_iterations(_log(tmp_path / "c.jsonl", [1.0] * 3, off))
    assert user_path.compare_losses(a, same) is None
    why = user_path.compare_losses(a, b)
    assert why is not None and why.startswith("iteration 1:"), why
    assert "logged iterations differ" in user_path.compare_losses(a, a[:2])


def test_params_comparison_names_the_first_differing_parameter(tmp_path):
    state = {"wte.weight": torch.randn(4, 3), "h.0.ln_1.weight": torch.ones(3)}
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    torch.save(state, tmp_path / "a" / "rank0.params.pt")
    torch.save({k: v.clone() for k, v in state.items()}, tmp_path / "b" / "rank0.params.pt")
    other = {k: v.clone() for k, v in state.items()}
    other["h.0.ln_1.weight"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    torch.save(other, tmp_path / "c" / "rank0.params.pt")
    assert user_path.compare_params(tmp_path / "a", tmp_path / "b", 1) is None
    why = user_path.compare_params(tmp_path / "a", tmp_path / "c", 1)
    assert why == "rank 0: h.0.ln_1.weight differs first at byte 4", why
    assert "missing" in user_path.compare_params(tmp_path / "a", tmp_path / "b", 2)


def test_variants_and_script_args_parse():
    v = user_path.parse_variant("no shadow=--shadow-level off --scrub-mib-per-iteration 0")
    assert v.launcher == user_path.LETO
    assert v.leto_flags == ("--shadow-level", "off", "--scrub-mib-per-iteration", "0")
    with pytest.raises(Exception, match="NAME=FLAGS"):
        user_path.parse_variant("--shadow-level off")
    v = user_path.parse_variant("inline=LETO_UNDO_AHEAD=0 LETO_CHUNK_PASS=1 --no-checkpoints")
    assert v.env == (("LETO_UNDO_AHEAD", "0"), ("LETO_CHUNK_PASS", "1"))
    assert v.leto_flags == ("--no-checkpoints",)
    shape, rest = user_path.split_script_args("--accum 4 --deterministic --seed 3", dict(TINY))
    assert shape == {**TINY, "accum": 4} and rest == ["--deterministic", "--seed", "3"]
    with pytest.raises(SystemExit, match="benchmark's"):
        user_path.split_script_args("--out elsewhere", dict(TINY))


def test_ranks_sharing_a_gpu_reach_both_launchers(capsys):
    # Issue 47 (world 2 on one GPU): leto run gets --ranks-per-gpu, torchrun's scripts the
    # variable they read; refused on the CPU before anything runs.
    plain, leto, v = user_path.shared_gpu(
        [user_path.Launch("t", user_path.TORCHRUN), user_path.Launch("l", user_path.LETO),
         user_path.parse_variant("off=--no-loss-guard")], 2,
    )  # fmt: skip
    assert plain.env == (("LETO_RANKS_PER_GPU", "2"),) and plain.leto_flags == ()
    assert leto.leto_flags == ("--ranks-per-gpu", "2") and leto.env == ()
    assert v.leto_flags == ("--ranks-per-gpu", "2", "--no-loss-guard")
    with pytest.raises(SystemExit):
        user_path.main(["--device", "cpu", "--nproc-per-node", "2", "--ranks-per-gpu", "2"])
    assert "needs --device cuda" in capsys.readouterr().err


@pytest.mark.integ
@pytest.mark.timeout(240)
def test_the_port_under_leto_run_defaults_is_bit_identical_to_torchrun(tmp_path):
    # leto run with no flags but the port (torchrun --standalone picks one too): what a
    # user types. No OMP_NUM_THREADS here: the launchers decide it, as for users.
    launches = [
        user_path.Launch("torchrun", user_path.TORCHRUN),
        user_path.Launch("leto", user_path.LETO),
    ]
    args = [*user_path.shape_flags(TINY), "--iterations", str(ITERS), "--warmup", "2"]
    torchrun, leto = user_path.run_all(launches, tmp_path, 2, "cpu", args, ITERS, 1, 180)
    if "error" in torchrun and "error" not in leto:
        # The reference alone failed — seen once in CI, a rank of plain torchrun + gloo
        # aborting (SIGABRT) while faultkit's matrices killed jobs beside it on the same
        # two cores. Both once more, so the comparison stays within one pass; a second
        # failure, or any failure of leto run's, fails the test.
        print(f"the torchrun reference failed; both run again: {torchrun['error'][:800]}")
        torchrun, leto = user_path.run_all(
            launches, tmp_path / "again", 2, "cpu", args, ITERS, 1, 180
        )
    for r in (torchrun, leto):
        assert "error" not in r, f"{r['name']}: {r['error']}"
        assert r["iterations"] == ITERS, r
    assert leto["params_identical"], f"final parameters differ: {leto['params_difference']}"
    assert leto["losses_equal"], f"losses differ: {leto['losses_difference']}"
