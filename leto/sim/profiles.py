"""Profile files: the simulator's inputs, each value with where it came from.

Owns loading and checking ``leto/sim/profiles/*.json``. Every leaf is
``{"value": ..., "source": "..."}`` where the source names a paper section or table, or
starts with ``"assumed:"`` and says why; a leaf without a source is refused. A
deployment profile gives either ``t_iter_s`` directly (a measured job) or an
``iteration`` block for ``leto.sim.iteration``, and either ``ckpt_p`` directly or a
``checkpoint`` block (``p = exposed_fraction * bytes_per_gpu / bytes_per_s / T_iter``).
``systems.json`` holds the recovery costs of each system; ``published.json`` the
paper's reported ETTR, for side-by-side display only (never an input).

Runs in any process. Not covered: writing profiles from measurements (the profiler is
not part of this package); docs/sim.md documents every field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leto.errors import InvalidInput
from leto.sim.iteration import Collective, IterationBreakdown, IterationProfile, breakdown
from leto.sim.model import System

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
SCENARIOS = ("deepseek_v2_1k", "deepseek_v3_16k", "deepseek_v4_128k")


def _leaf(doc: dict, key: str, where: str) -> Any:
    if key not in doc:
        raise InvalidInput(f"{where}: missing field {key!r}")
    leaf = doc[key]
    if not (
        isinstance(leaf, dict)
        and "value" in leaf
        and isinstance(leaf.get("source"), str)
        and leaf["source"].strip()
    ):
        raise InvalidInput(f"{where}.{key}: expected {{'value': ..., 'source': '...'}}")
    return leaf["value"]


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidInput(f"profile {path}: cannot read it as JSON ({e})") from e


def _resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return p
    p = PROFILES_DIR / f"{name_or_path.replace('-', '_')}.json"
    if not p.exists():
        known = sorted(x.stem for x in PROFILES_DIR.glob("*.json"))
        raise InvalidInput(f"no profile {name_or_path!r}; known: {known} or a .json path")
    return p


def load_systems(path: Path | None = None) -> dict[str, System]:
    """The recovery systems of ``systems.json`` (or ``path``), by name."""
    path = path or PROFILES_DIR / "systems.json"
    doc = _read(path)
    out = {}
    for name, body in doc.items():
        if name == "source":
            continue
        where = f"{path.name}:{name}"
        fields = {k: _leaf(body, k, where) for k in body}
        out[name] = System(name=name, **fields)
    return out


def iteration_profile(doc: dict, where: str) -> IterationProfile:
    it = doc["iteration"]
    coll = it.get("grad_collective", {})
    values = {k: _leaf(it, k, f"{where}.iteration") for k in it if k != "grad_collective"}
    values["stage_brackets_s"] = tuple(values["stage_brackets_s"])
    values["grad_collective"] = Collective(
        _leaf(coll, "alpha_s", f"{where}.grad_collective"),
        _leaf(coll, "bus_bytes_per_s", f"{where}.grad_collective"),
    )
    model = doc["model"]
    values["pp"] = _leaf(model, "pp", f"{where}.model")
    values["dp"] = _leaf(model, "dp", f"{where}.model")
    values["optimizer_sharded"] = _leaf(model, "optimizer_sharded", f"{where}.model")
    try:
        return IterationProfile(**values)
    except TypeError as e:
        raise InvalidInput(f"{where}.iteration: {e}") from e


@dataclass(frozen=True)
class Deployment:
    """One simulated deployment: its iteration time, checkpoint cost and GPU count."""

    name: str
    title: str
    gpus: int
    t_iter_s: float
    ckpt_p: float
    max_interval: int
    iteration: IterationBreakdown | None  # None when T_iter was measured, not modelled


def load_deployment(name_or_path: str) -> Deployment:
    path = _resolve(name_or_path)
    doc = _read(path)
    where = path.name
    brk = None
    if "t_iter_s" in doc:
        t_iter = float(_leaf(doc, "t_iter_s", where))
    elif "iteration" in doc:
        brk = breakdown(iteration_profile(doc, where))
        t_iter = brk.t_iter_s
    else:
        raise InvalidInput(f"{where}: needs 't_iter_s' or an 'iteration' block")
    if "ckpt_p" in doc:
        p = float(_leaf(doc, "ckpt_p", where))
    elif "checkpoint" in doc:
        ck = doc["checkpoint"]
        w = f"{where}.checkpoint"
        t_ckpt = (
            _leaf(ck, "exposed_fraction", w)
            * _leaf(ck, "bytes_per_gpu", w)
            / _leaf(ck, "bytes_per_s", w)
        )
        p = t_ckpt / t_iter
    else:
        raise InvalidInput(f"{where}: needs 'ckpt_p' or a 'checkpoint' block")
    return Deployment(
        name=doc.get("name", path.stem),
        title=doc.get("title", path.stem),
        gpus=int(_leaf(doc, "gpus", where)),
        t_iter_s=t_iter,
        ckpt_p=p,
        max_interval=int(_leaf(doc, "max_interval", where)),
        iteration=brk,
    )


def published() -> dict:
    """The paper's reported ETTR (``published.json``), for comparison tables only."""
    return _read(PROFILES_DIR / "published.json")
