"""Gradient replay: one micro-batch of every rank recomputed on another rank's GPU and
compared bit for bit, every K iterations — a wrong gradient or activation (silent data
corruption in the computation) found before the update reads it.

Runs in the trainer (``leto.Run``, data-parallel jobs of two or more ranks). Replicas
hold the same parameters before the update, and training is bit-for-bit deterministic,
so rank r+1 recomputing rank r's first micro-batch must produce rank r's local gradient
to the last bit. In an iteration due for replay (``t % K == 0``):

* **capture** (hooks on the model): at its first forward with autograd on, the
  arguments, the CPU and device generators' states and the autocast state; each output
  is handed back as a view of itself, whose gradient is exactly the one the script's
  code after the model seeds it with (the loss divided by the micro-batches, the
  GradScaler's scale...) — not what flows through the model's own paths;
* **the original's digest**: the micro-batch's local gradient, summed as integer words
  (every single flipped bit changes the sum) at the last moment before anything changes
  it — each bucket just before its all-reduce launches, or the whole buffer before the
  next micro-batch's forward or the unbucketed all-reduce. Faultkit's ``sdc-grad`` flips
  its bit at the same places (``leto.plugins.SDC_GRAD_POINT``), before the digest;
* **verify** (after the reduction, before the update): the ranks pass their captures
  around a ring (point to point on a gloo group, a few hundred KiB of tokens), each
  replays its predecessor's with ``torch.autograd.grad`` (the retained gradients and
  the generators are left as they were) and the ranks ``all_gather`` the results.

A mismatch is checked by a third computation: at world >= 3 on rank r+2 (a third GPU),
which names the rank that computed wrong (the original or the replayer); at world 2 the
original rank recomputes its own micro-batch — right for a transient fault, while a
persistently defective GPU would reproduce its wrong result there and the other rank
would be named. Then ``ReplayMismatch`` (a ``RecoverableFailure``) on every rank: the
update of the iteration has not run, the retained state is untouched, and the in-place
recovery redoes the iteration. The same mismatch again (same iteration, same rank named)
stops the job, as any error that repeats after a recovery does: a GPU that computes wrong
every time is a hardware failure. Each mismatch is a line of ``rank<r>.replay.jsonl``.

Cost: one micro-batch's forward and backward more per rank every K iterations (plus a
host synchronisation); K is ``leto run --replay-every`` (default ``REPLAY_EVERY_DEFAULT``, 200).
Nothing between: two hook calls per forward that return at once.

Not covered: a flip in a gradient after the replayed micro-batch (later micro-batches
of an accumulation, the reduced sum: every replica shares it); activations and gradients
of micro-batches not replayed (detection is sampled: 1 / (K x micro-batches) of a
transient flip's chances); jobs without ``torch.use_deterministic_algorithms(True)``
(recomputation would not be bit-exact, so replay is skipped, and said once); outputs
seeded with more than ``MAX_SEED_BYTES`` (logits whose loss is computed outside the
model: return the loss from the model); outputs not tensors, tuples, lists or dicts;
generators the model makes itself; sharded or rank-local parameters (FSDP2, TP,
pipeline stages, experts) — no other rank holds them.
"""

from __future__ import annotations

import copy
import io
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from leto import rank_log
from leto.errors import RecoverableFailure, WrongComputation
from leto.job.config import REPLAY_EVERY_DEFAULT

ENV_REPLAY_EVERY = "LETO_REPLAY_EVERY"  # leto run --replay-every K (0: off)
MAX_SEED_BYTES = 64 << 20

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def every() -> int:
    """K: replay every K-th iteration (0: never)."""
    return int(os.environ.get(ENV_REPLAY_EVERY, REPLAY_EVERY_DEFAULT))


class ReplayMismatch(WrongComputation, RecoverableFailure):
    """A micro-batch's gradient differs from its recomputation on another GPU: the
    iteration is redone in place (its update has not run)."""


def digest(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s elements read as signed integers of their width, modulo 2^64,
    as a 0-d int64 tensor on ``t``'s device. A single flipped bit changes it by ±2^k."""
    return t.reshape(-1).view(_WORD[t.element_size()]).sum(dtype=torch.int64)


def grads_digest(grads) -> int:
    """``digest`` of gradients as they land in a zeroed buffer (0 + g: a -0.0 lands as
    +0.0), summed over tensors: what the flat retained buffer's digest is for them."""
    total = None
    for g in grads:
        if g is None:
            continue
        d = digest(torch.zeros(g.shape, dtype=g.dtype, device=g.device).add_(g))
        total = d if total is None else total + d
    return 0 if total is None else int(total)


def _leaves(out) -> list:
    """The tensors of a model output, in a fixed order (tensor, tuple/list, dict)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _leaves(o)]
    if isinstance(out, dict):
        return [x for o in out.values() for x in _leaves(o)]
    return []


def _map(out, fn):
    """``out`` with each tensor replaced by ``fn(tensor)``; None: a type it cannot rebuild."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        items = [_map(o, fn) for o in out]
        if any(i is None and o is not None for i, o in zip(items, out, strict=True)):
            return None
        if hasattr(out, "_make"):  # a namedtuple
            return out._make(items)
        return type(out)(items)
    if isinstance(out, dict):
        new = copy.copy(out)
        for k, v in out.items():
            new[k] = _map(v, fn)
            if new[k] is None and v is not None:
                return None
        return new
    return out if not _leaves(out) else None


def _to(obj, device):
    """Tensors in ``obj`` (args, kwargs) copied to ``device``, the rest as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def judge(o: int, rows: list[list[int]], thirds: list[list[int]], w: int) -> dict:
    """Rank ``o``'s micro-batch differed from its replay on rank o+1: ``rows[r]`` is rank
    r's (status, own digest, digest of its replay of r-1), ``thirds[r][0]`` rank r's third
    computation (of o's micro-batch on rank o+2, at world 2 on o itself). The third names
    whom it disagrees with: the original when it agrees with the replay, the replayer when
    it agrees with the original, nobody when it agrees with neither."""
    replayer, checker = (o + 1) % w, (o + 2) % w
    orig, again, d3 = rows[o][1], rows[replayer][2], thirds[checker][0]
    named = o if d3 == again else replayer if d3 == orig else None
    return {
        "original": o, "replayer": replayer, "checker": checker, "named": named,
        "digests": {"original": orig, "replay": again, "third": d3},
    }  # fmt: skip


class GradReplay:
    def __init__(
        self,
        model: torch.nn.Module,
        params: dict[str, torch.nn.Parameter],
        grad: torch.Tensor,
        rank: int,
        world: int,
        k: int,
        log: Path | None = None,
        timeout_s: float = 600.0,
        group=None,
        generators=None,
    ):
        """Collective (makes a gloo group, unless ``group`` is given). ``params``: the retained parameters; ``grad``
        the flat retained gradient buffer they point into (zeroed at each iteration's
        start); ``k``: replay every k-th iteration. ``generators``: ``(get, set)`` of
        more generator states a forward draws from (Megatron's RNG tracker), captured
        and replayed with torch's."""
        self.model, self.grad = model, grad
        self.generators = generators
        seen, self.params = set(), []
        for p in params.values():
            if p.requires_grad and id(p) not in seen:  # tied parameters: one slot
                seen.add(id(p))
                self.params.append(p)
        self.rank, self.world, self.k, self.log = rank, world, k, log
        self.device = grad.device
        self.pg = group or dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.replaying = False
        self.replays = 0  # micro-batches this rank recomputed
        self.replay_s = 0.0
        self.skipped: str | None = None  # why a due replay was skipped (first reason)
        self._said: set[str] = set()
        self._t: int | None = None
        self._reset()
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, with_kwargs=True)

    def _reset(self) -> None:
        self._cap: dict | None = None
        self._phase: str | None = None  # forward, armed, buckets, lazy, done, off
        self._seeds: dict[int, torch.Tensor] = {}
        self._acc: torch.Tensor | None = None

    def _say(self, why: str) -> None:
        self.skipped = self.skipped or why  # the closing line says it, not a count
        if why not in self._said:
            self._said.add(why)
            rank_log.say(self.rank, f"gradient replay: {why}")

    # -- capture (the hooks) ------------------------------------------------------------

    def begin(self, t: int) -> None:
        self._reset()
        self._t = t if t % self.k == 0 else None

    def _pre(self, module, args, kwargs):
        if self.replaying or self._t is None or not torch.is_grad_enabled():
            return None
        if self._phase == "lazy":  # the next micro-batch: the first one's gradient is whole
            self.whole()
        if self._phase is not None:
            return None
        dev = self.device.type
        self._cap = {
            "args": _to(args, self.device), "kwargs": _to(kwargs, self.device),
            "cpu_rng": torch.get_rng_state(),
            "dev_rng": torch.cuda.get_rng_state(self.device) if dev == "cuda" else None,
            "more_rng": self.generators[0]() if self.generators else None,
            "autocast": (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)),
            "training": module.training,
        }  # fmt: skip
        self._phase = "forward"
        return None

    def _post(self, module, args, kwargs, out):
        if self.replaying or self._phase != "forward":
            return None
        index = [0]

        def view(x: torch.Tensor) -> torch.Tensor:
            i = index[0]
            index[0] += 1
            if not x.requires_grad:
                return x
            v = x.view_as(x)
            v.register_hook(self._seed_hook(i))
            return v

        new = _map(out, view)
        if new is None or index[0] == 0:
            self._phase = "off"
            self._say(f"the model returned a {type(out).__name__}, not tensors in tuples, "
                      "lists or dicts: its micro-batches are not replayed")  # fmt: skip
            return None
        self._phase = "armed"
        return new

    def _seed_hook(self, i: int):
        def hook(g: torch.Tensor) -> None:
            self._seeds[i] = g.detach().clone()
            if self._phase == "armed":  # the first output's gradient: backward begins
                b = self.buckets
                syncs = b is not None and b._sync and b.forward_sync
                self._phase = "buckets" if syncs else "lazy"
                if syncs:
                    self._left = len(b.ranges)

        return hook

    buckets = None  # leto.trainer.buckets.GradBuckets, when gradients are bucketed
    # Called before the whole buffer is digested (leto.trainer.grad_landing's finish: a
    # parameter the first micro-batch did not reach has its view zeroed first, as the
    # zeroed buffer had it; its later micro-batches add to the zeros).
    before_whole = None

    def local(self, view: torch.Tensor) -> None:
        """``view`` (a bucket, or the whole buffer) is about to be reduced: a bucket of the
        first micro-batch's gradient when its backward reduces, else the whole buffer."""
        if self._phase == "buckets":
            d = digest(view)
            self._acc = d if self._acc is None else self._acc + d
            self._left -= 1
            if self._left == 0:
                self._phase = "done"
        else:
            self.whole()

    def whole(self) -> None:
        """The whole buffer is the first micro-batch's local gradient now (before the next
        micro-batch's backward, or before an unbucketed all-reduce)."""
        if self._phase == "lazy":
            if self.before_whole is not None:
                self.before_whole()
            self._acc = digest(self.grad)
            self._phase = "done"

    # -- verify (after the reduction, before the update) -------------------------------

    def _payload(self) -> dict | None:
        if self._phase != "done" or self._cap is None:
            return None
        if not torch.are_deterministic_algorithms_enabled():
            self._say("torch.use_deterministic_algorithms(True) is off, so a recomputation "
                      "need not be bit-exact: replay is skipped")  # fmt: skip
            return None
        size = sum(s.numel() * s.element_size() for s in self._seeds.values())
        if size > MAX_SEED_BYTES:
            self._say(f"the model's outputs are seeded with {size >> 20} MiB of gradient "
                      f"(over {MAX_SEED_BYTES >> 20}): replay is skipped — return the loss "
                      "from the model to have it replayed")  # fmt: skip
            return None
        cap = dict(self._cap)
        cap["args"], cap["kwargs"] = _to(cap["args"], "cpu"), _to(cap["kwargs"], "cpu")
        cap["seeds"] = {i: s.cpu() for i, s in self._seeds.items()}
        cap["digest"] = int(self._acc)
        cap["rank"] = self.rank
        return cap

    def _compute(self, cap: dict) -> int:
        """``cap``'s micro-batch forward and backward here, from its generators' states;
        the digest of the gradients it gives. This rank's generators, buffers, mode and
        retained gradients are as they were after."""
        dev = self.device.type
        cpu_rng = torch.get_rng_state()
        dev_rng = torch.cuda.get_rng_state(self.device) if dev == "cuda" else None
        more_rng = self.generators[0]() if self.generators else None
        buffers = [(b, b.clone()) for b in self.model.buffers()]
        training = self.model.training
        self.replaying = True
        try:
            torch.set_rng_state(cap["cpu_rng"])
            if dev == "cuda":
                torch.cuda.set_rng_state(cap["dev_rng"], self.device)
            if self.generators and cap.get("more_rng") is not None:
                self.generators[1](cap["more_rng"])
            self.model.train(cap["training"])
            enabled, dtype = cap["autocast"]
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                out = self.model(*_to(cap["args"], self.device), **_to(cap["kwargs"], self.device))
            leaves = _leaves(out)
            idx = sorted(cap["seeds"])
            grads = torch.autograd.grad(
                [leaves[i] for i in idx], self.params,
                [cap["seeds"][i].to(self.device) for i in idx], allow_unused=True,
            )  # fmt: skip
            return grads_digest(grads)
        finally:
            self.replaying = False
            self.model.train(training)
            for b, saved in buffers:
                b.copy_(saved)
            torch.set_rng_state(cpu_rng)
            if dev == "cuda":
                torch.cuda.set_rng_state(dev_rng, self.device)
            if more_rng is not None:
                self.generators[1](more_rng)

    def _exchange(self, obj, dst: int | None, src: int | None):
        """Send ``obj`` (pickled) to ``dst`` and receive one from ``src`` (either None)."""
        reqs, size = [], torch.zeros(1, dtype=torch.int64)
        if dst is not None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            reqs.append(dist.isend(torch.tensor([data.numel()]), dst, group=self.pg))
        if src is not None:
            reqs.append(dist.irecv(size, src, group=self.pg))
        for r in reqs:
            r.wait()
        reqs, got = [], None
        if dst is not None:
            reqs.append(dist.isend(data, dst, group=self.pg))
        if src is not None:
            got = torch.empty(int(size), dtype=torch.uint8)
            reqs.append(dist.irecv(got, src, group=self.pg))
        for r in reqs:
            r.wait()
        if got is None:
            return None
        return torch.load(io.BytesIO(got.numpy().tobytes()), weights_only=False)

    def _gather(self, *words: int) -> list[list[int]]:
        mine = torch.tensor(words, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.pg)
        return [e.tolist() for e in every]

    def verify(self, t: int) -> None:
        """Every rank, in iteration ``t`` (after the gradients' reduction, before the
        update): replay the predecessor's micro-batch; ``ReplayMismatch`` on every rank
        if any replay differs."""
        if self._t != t:
            return
        t0 = time.perf_counter()
        w, r = self.world, self.rank
        mine = self._payload()
        theirs = self._exchange(mine, (r + 1) % w, (r - 1) % w)
        status, rep = 0, 0  # 0 nothing compared, 1 equal, 2 different
        if theirs is not None:
            rep = self._compute(theirs)
            status = 1 if rep == theirs["digest"] else 2
        rows = self._gather(status, mine["digest"] if mine else 0, rep)
        if status:  # counted only when this rank recomputed a micro-batch
            self.replays += 1
            self.replay_s += time.perf_counter() - t0
        bad = [(o - 1) % w for o in range(w) if rows[o][0] == 2]  # originals that differ
        if not bad:
            return
        # A third computation of each: on rank o+2 (the replayer passes it on), or, at
        # world 2, by the original rank itself.
        third = 0
        if w == 2:
            if r in bad:
                third = self._compute(mine)
        else:
            send = theirs if (r - 1) % w in bad else None
            got = self._exchange(send, (r + 1) % w if send else None,
                                 (r - 1) % w if (r - 2) % w in bad else None)  # fmt: skip
            if got is not None:
                third = self._compute(got)
        thirds = self._gather(third)
        found = [judge(o, rows, thirds, w) for o in bad]
        named = sorted({f["named"] for f in found if f["named"] is not None})
        if self.log is not None:
            rec = {"iteration": t, "named": named, "world": w, "found": found, "time": time.time()}
            with open(self.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        who = "; ".join(
            f"rank {f['original']}'s first micro-batch recomputed on rank {f['replayer']} "
            f"gave a different gradient, and a third computation on rank {f['checker']} "
            + (f"names rank {f['named']}" if f["named"] is not None else "agrees with neither")
            for f in found
        )
        raise ReplayMismatch(
            f"iteration {t}: gradient replay: {who}"
            + (f" — rank(s) {named} computed wrong" if named else "")
            + ". The iteration's update has not run: every rank redoes it from the retained "
            "state (in place)",
            iteration=t,
            named=named,
        )
