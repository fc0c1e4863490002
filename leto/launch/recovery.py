"""What a node's agent does about a failure: in-place recovery (fence, lose what the
fault plan says, promote the shadows or start cold) and the checkpoint fallback for a
fatal failure; each produces a typed ``RecoveryRecord``.

Runs in the agent. Every node fences its active trainers and waits until every node
has, then promotes its shadows together into the next generation (with shadows off,
starts trainers cold as torchrun would). A fatal failure (retained state beyond
parity, or a dead state manager) restarts every rank cold on a fresh pool from the
newest complete DCP checkpoint. After the job, ``collect`` adds what the recovered
trainers reported (their steps and times) and why each rank failed.
"""

from __future__ import annotations

import enum
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field

from leto import plugins
from leto.errors import LetoError
from leto.job import keys
from leto.job import store as job_store
from leto.job.config import RunConfig
from leto.launch.cell import Cell
from leto.launch.shadows import Shadows

log = logging.getLogger("leto.agent")


class FailureClass(str, enum.Enum):
    HOF = "HOF"  # hardware-operable: recovered in place
    FF = "FF"  # fatal: the checkpoint fallback


@dataclass
class RecoveryRecord:
    generation: int  # the generation that failed
    failure_class: FailureClass
    detected_at: float  # wall clock, when the agent saw the failure
    fencing_s: float  # this node's trainers fenced
    promotion_s: float  # until the next generation's trainers were running
    level: str | None  # the shadows promoted ("checkpoint" for a fallback, None: cold)
    local_ranks: list[int]
    all_nodes_fenced_s: float | None = None  # HOF: until every node had fenced
    pages_lost: dict | None = None  # HOF: what the fault plan lost
    # HOF: the time this node's agent took to lose those pages (faultkit's emulation of
    # the hardware's loss, inside promotion_s and I; a real loss costs no such time)
    losing_s: float | None = None
    older_checkpoints: int | None = None  # FF: newest checkpoints passed over
    repeats: list[int] | None = None  # generations that failed the same way before
    # Set once known: what the failure was, where Leto could not tell at the time (a
    # script error it recovered from as a possible hardware failure, then saw again).
    cause: str | None = None
    # Added by ``collect`` after the job:
    failed_ranks: list[int] = field(default_factory=list)
    failures: dict = field(default_factory=dict)  # rank -> exit code / hang / error file
    trainers: dict = field(default_factory=dict)  # rank -> the recovered trainer's timings
    recovery_s: float | None = None  # failure -> the slowest rank's leto.Run resumed
    # Recovery as the paper measures it (leto.trainer.first_iteration.regained), for the
    # rank that took longest: I (failure -> the loop body runs), R (-> the interrupted
    # iteration completed again, less what a fault-free run still had ahead of it), I + R.
    init_s: float | None = None
    recompute_s: float | None = None
    regained_s: float | None = None
    first_iteration_s: float | None = None  # that rank's first iteration after recovery
    steady_iteration_s: float | None = None  # the failed generation's, for comparison

    def as_dict(self) -> dict:
        """The JSON form in ``nodeN.recovery.json`` and ``leto run --json``."""
        d = {k: v for k, v in asdict(self).items() if v is not None}
        d["class"] = d.pop("failure_class").value
        return d


class Recovery:
    def __init__(
        self, cfg: RunConfig, cells: list[Cell], store, shadows: Shadows, faults: list[dict]
    ):
        self.cfg, self.cells, self.store = cfg, cells, store
        self.shadows, self.faults = shadows, faults

    def fault(self, generation: int, rank: int) -> dict | None:
        """The fault plan's entry for a trainer of ``generation`` (faultkit arms it)."""
        for f in self.faults:
            if f["generation"] == generation and f["rank"] == rank:
                return f
        return None

    def _fence_all(self, gen: int, drop_shadows: bool = False) -> tuple[float, float]:
        t0 = time.time()
        for cl in self.cells:
            cl.fence()
            if drop_shadows:
                cl.drop_shadow()  # its generation's process group (L3) has no future
        if not drop_shadows and self.shadows.on:
            self.shadows.ask_before_promotion(gen)  # (seen by every node past the barrier)
        t_fenced = time.time()
        self.store.add(keys.fenced(gen), 1)
        job_store.wait_count(
            self.store, keys.fenced(gen), self.cfg.nnodes, self.cfg.timeout_s, "every node to fence"
        )
        return t0, t_fenced

    def in_place(self, gen: int, detected_at: float) -> RecoveryRecord:
        t0, t_fenced = self._fence_all(gen)
        log.info("generation %d: fenced in %.3f s (every node: %.3f s)", gen,
                 t_fenced - t0, time.time() - t0)  # fmt: skip
        t_all = time.time()
        lost = self.lose(gen)
        t_lost = time.time()
        if lost.get("device") or lost.get("host"):
            log.info("generation %d: %s", gen, said_lost(lost))
        new = gen + 1
        if self.shadows.on:
            self.shadows.restart_if_asked(gen)  # (L3: a shadow was missing on some node)
        promoted = self.shadows.level if self.shadows.on else None
        for cl in self.cells:
            if promoted is None:
                cl.drop_shadow()
                cl.start_active(new, self.fault(new, cl.rank))
                continue
            if cl.shadow is None or cl.shadow.poll() is not None:
                cl.start_shadow(new, promoted)  # none ready: promote a fresh one
            cl.promote(self.fault(new, cl.rank))
        t_promoted = time.time()
        log.info("generation %d: %s in %.3f s", new,
                 f"{promoted} shadows promoted" if promoted else "cold restarts",
                 t_promoted - t0)  # fmt: skip
        self.shadows.after_recovery(new)
        return RecoveryRecord(
            generation=gen,
            failure_class=FailureClass.HOF,
            detected_at=detected_at,
            fencing_s=t_fenced - t0,
            all_nodes_fenced_s=t_all - t0,
            promotion_s=t_promoted - t0,
            level=promoted,
            local_ranks=[cl.rank for cl in self.cells],
            pages_lost=lost,
            losing_s=(t_lost - t_all) if lost.get("device") or lost.get("host") else None,
        )

    def fallback(self, gen: int, detected_at: float, skip: int = 0) -> RecoveryRecord:
        """A fatal failure: every rank restarts cold on a fresh pool from the newest
        complete checkpoint (torchrun-style, but only for FFs) — or, with ``skip``, an
        older one (the newest ``skip`` passed over: the last fallback failed the same
        way)."""
        t0, t_fenced = self._fence_all(gen, drop_shadows=True)
        for cl in self.cells:
            cl.reset_pool()
            cl.checkpoint_skip = skip
            # The dropped L3 shadows formed their group under the next generation; the
            # cold trainers must not find those addresses (seen in a trace replay: gloo
            # connectFullMesh refused).
            cl.fallbacks += 1
            cl.pg_attempt = f"{cl.fallbacks}.0"
        new = gen + 1
        for cl in self.cells:
            cl.start_active(new, self.fault(new, cl.rank))
        log.info("generation %d: fresh pools, cold trainers from the newest checkpoint", new)
        self.shadows.after_recovery(new)
        return RecoveryRecord(
            generation=gen,
            failure_class=FailureClass.FF,
            detected_at=detected_at,
            fencing_s=t_fenced - t0,
            promotion_s=time.time() - t0,
            level="checkpoint",
            local_ranks=[cl.rank for cl in self.cells],
            older_checkpoints=skip or None,
        )

    def lose(self, gen: int) -> dict:
        """A fault plan's page losses for this failure, on every local rank's pool, while
        no trainer runs (faultkit's mechanism: the pools must allow fault injection):
        ``lose_pages`` random data pages per protection group, ``host_parity_pages``
        tier-1 pages, and ``inject``, explicit ``[kind, name, [pages]]`` losses."""
        plan = [f for f in self.faults if f["generation"] == gen]
        pages = sum(f.get("lose_pages", 0) for f in plan)
        host = sum(f.get("host_parity_pages", 0) for f in plan)
        explicit = [e for f in plan for e in f.get("inject", [])]
        lost = {"device": 0, "host": 0}
        if not (pages or host or explicit):
            return lost
        from leto.memory.client import PoolClient

        for cl in self.cells:
            rng = random.Random(gen * 1_000 + cl.rank)
            with PoolClient.connect(cl.sm.socket_path, cl.sm.token, role="faultkit") as f:
                try:
                    if pages or host:
                        for k, v in plugins.lose_pages(f, pages, host, rng).items():
                            if isinstance(v, list):  # e.g. groups smaller than asked
                                lost.setdefault(k, []).extend([cl.rank, *x] for x in v)
                            else:
                                lost[k] += v
                    for kind, name, idx in explicit:
                        f.inject_loss(kind, name, list(idx))
                        lost["host" if kind.startswith("tier") else "device"] += len(idx)
                except LetoError as e:
                    # E.g. a trainer that died before it attached its state: the pool has
                    # nothing (or not that) to lose. The failure is still recovered.
                    log.warning("rank %d: the fault plan's page loss was refused: %s", cl.rank, e)
                    lost.setdefault("refused", []).append(f"rank {cl.rank}: {e}")
        return lost

    def collect(self, records: list[RecoveryRecord]) -> None:
        """Trainer-side timings of each recovery, as the promoted trainers reported,
        and why each rank failed (exit code or hang, the uncaught exception's file)."""
        for rec in records:
            g = rec.generation + 1
            for r in rec.local_ranks:
                key = keys.resumed(g, r)
                if self.store.check([key]):
                    rec.trainers[r] = json.loads(self.store.get(key))
            for r in range(self.cfg.world_size):
                k = keys.failure(rec.generation, r)
                if self.store.check([k]):
                    rec.failures[str(r)] = json.loads(self.store.get(k))
            rec.failed_ranks = sorted(int(r) for r in rec.failures)
            if rec.trainers:
                rec.recovery_s = max(v["time"] for v in rec.trainers.values()) - rec.detected_at
            self._regained(rec)

    def _regained(self, rec: RecoveryRecord) -> None:
        """I, R and their sum for the slowest local rank, from what its promoted trainer
        reported after its first iteration and its failed generation's last pace (an
        in-place recovery: its first iteration is the interrupted one, or the next)."""
        if rec.failure_class is not FailureClass.HOF:
            return  # a fallback recomputes from its checkpoint: many iterations, not one
        figures = []
        for r, tr in rec.trainers.items():
            loop_at = tr.get("loop_at")
            if loop_at is None and tr.get("resumed_by") == "finish" and "time" in tr:
                # The interrupted iteration was the loop's last: done once leto.Run resumed.
                loop_at = tr["time"]
            if loop_at is None:
                continue  # the job ended before this trainer's loop ran an iteration
            k = keys.pace(rec.generation, r)
            pace = json.loads(self.store.get(k)) if self.store.check([k]) else None
            done = loop_at if tr.get("resumed_by") == "finish" else tr["first_iteration_end"]
            fig = regained(pace, rec.detected_at, loop_at, done)
            fig["first_iteration_s"] = tr.get("first_iteration_s")
            fig["steady_iteration_s"] = pace.get("steady_s") if pace else None
            figures.append(fig)
        if figures:
            slow = max(figures, key=lambda f: f["regained_s"])
            rec.init_s, rec.recompute_s = slow["init_s"], slow["recompute_s"]
            rec.regained_s = slow["regained_s"]
            rec.first_iteration_s = slow["first_iteration_s"]
            rec.steady_iteration_s = slow["steady_iteration_s"]


def regained(pace: dict | None, detected_at: float, loop_at: float, redone_end: float) -> dict:
    """Recovery as the paper measures it, for one rank. ``pace``: the failed generation's
    last ``Pace`` record (None: unknown); ``detected_at``: the failure seen; ``loop_at``:
    the promoted trainer's loop body began; ``redone_end``: the interrupted iteration
    completed again (``loop_at`` when the recovery finished its update before the loop).
    I = failure → the loop body; R = → the interrupted iteration done again, less the
    part of it a fault-free run still had ahead at the failure (never below 0)."""
    init_s = loop_at - detected_at
    remainder = 0.0
    if pace is not None and pace.get("steady_s") is not None:
        remainder = max(0.0, pace["began_at"] + pace["steady_s"] - detected_at)
    recompute = max(0.0, redone_end - loop_at - remainder)
    return {
        "init_s": init_s,
        "recompute_s": recompute,
        "fault_free_remainder_s": remainder if pace is not None else None,
        "regained_s": init_s + recompute,
    }


def said_lost(lost: dict) -> str:
    """The fault plan's page losses in words: the device pages count every rank's
    groups (a plan's ``lose_pages`` is per protection group, on every rank), and groups
    that held fewer pages than asked are named."""
    text = (
        f"the fault plan took {lost.get('device', 0)} device page(s) (all ranks' "
        f"protection groups together) and {lost.get('host', 0)} host parity page(s)"
    )
    short = lost.get("short") or []
    if short:
        text += "; smaller than asked, so wholly lost: " + ", ".join(
            f"rank {r} group {g} ({n} pages)" for r, g, n in short
        )
    return text
