"""``bench.world2`` (issue 47: world 2 and 4 on one GPU, ``bash bench/gpu_suite.sh
world2-<target>``): every step's command line parses with the real parsers, on the GPU
and in its CPU form, and the verdicts are judged as the steps expect. Nothing is run
here; the CPU form of each target was run by hand (docs/runtime.md)."""

from __future__ import annotations

import json

import pytest

from bench import world2


def _parse(argv: tuple[str, ...]) -> None:
    module, *args = argv
    args = [a.replace("{json}", "/tmp/x.json").replace("{dir}", "/tmp") for a in args]
    if module == "faultkit.cli":
        from faultkit.cli import build_parser

        build_parser().parse_args(args)
    elif module == "leto.cli":
        from leto.cli import build_parser

        build_parser().parse_args(args)
    elif module in ("bench.gloo_cuda", "bench.user_path", "pytest"):
        assert args, module  # (their parsers run their work: checked by the CPU runs)
    else:
        raise AssertionError(f"a step runs {module}, which this test does not know")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_step_parses_and_shares_the_gpu_only_on_cuda(device):
    steps = [s for lanes in world2.targets(device).values() for lane in lanes for s in lane]
    assert len({s.name for s in steps}) == len(steps), "step names repeat (their files would)"
    for s in steps:
        _parse(s.argv)
        shared = "--ranks-per-gpu" in s.argv
        if s.argv[0] == "faultkit.cli":
            assert shared == (device == "cuda"), s
        assert s.expect in ("exact", "not exact", "refused", "ok"), s


def test_verdicts_are_judged_as_each_step_expects():
    exact = world2.Step("m", ("faultkit.cli",))
    cases = [{"phase": "update", "mode": "kill", "exact": True, "fatal": True}]
    ok, line, _ = world2.judge(exact, 0, json.dumps({"exact": True, "cases": cases}), "", "")
    assert ok and "1 of 1 exact" in line, line
    fatal = world2.Step("b", ("faultkit.cli",), check="fatal")
    ok, line, _ = world2.judge(fatal, 0, json.dumps({"exact": True, "cases": [
        {**cases[0], "fatal": False}]}), "", "")  # fmt: skip
    assert not ok and "0 of 1 took the fatal path" in line, line
    off = world2.Step("o", ("faultkit.cli",), expect="not exact")
    ok, line, _ = world2.judge(off, 1, json.dumps({"exact": False, "first_divergence": "rank 0"}), "", "")
    assert ok and "NOT EXACT as it must be" in line, line
    ok, _, _ = world2.judge(off, 1, json.dumps({"exact": False, "first_divergence": None}), "", "")
    assert not ok, "a run that crashed is no proof a check was needed"
    sdc = world2.Step("s", ("faultkit.cli",), check="sdc")
    v = {"exact": True, "mode": "sdc-grad", "detected": True, "named_rank": 1}
    assert not world2.judge(sdc, 0, json.dumps(v), "", "")[0], "the struck rank is 0"
    ok, line, _ = world2.judge(sdc, 0, json.dumps({**v, "named_rank": 0, "verdict": {}}), "", "")
    assert ok and line.startswith("EXACT, 1 of 1 exact; sdc-grad"), line
    refused = world2.Step("r", ("faultkit.cli",), expect="refused", words=("send/recv",))
    assert world2.judge(refused, 2, "", "faultkit inject: ... send/recv ...", "")[0]
    assert not world2.judge(refused, 0, "", "send/recv", "")[0]
