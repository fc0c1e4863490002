"""The unfused optimizer steps on one chunk, which the updater runs where the fused chunk
pass does not apply (``leto.update.chunk_pass`` says when): the updater's own AdamW or
Muon (``optimizer``, ``adamw``), or the script's optimizer (``user_step`` over the chunk's
two halves, ``user_halves``). Each takes the chunk in two halves with the
``update.optimizer`` crash point between them, so a crash can leave a chunk half updated
(the undo copy reverts it).

Runs in the trainer, inside the updater's chunk transaction (``leto.update.rmu``), on
its state; ``upd`` is the ``Updater``. Not covered: the parity change (the updater's
next step), crash consistency (the transaction's).
"""

from __future__ import annotations

import torch

from leto.plugins import point
from leto.update.optim import CUT_ELEMS, adamw_fused, adamw_piece, muon_layer
from nvbit_tools import tripwire


def optimizer(upd, it: int, units: tuple[int, int], clip: torch.Tensor) -> None:
    if upd.user is not None:
        upd._user_step(it, units)
        return
    e0, e1 = upd.state.element_range(units)
    f = upd.state.flat
    lr = upd.schedule(it)
    pieces = upd.state.pieces(e0, e1)
    if upd.cfg.adamw.impl == "fused" and not any(upd.state.slot_at(a).layerwise for a, _ in pieces):
        # Every piece of the chunk in one fused call per half chunk; the crash point
        # between the halves leaves the chunk half updated.
        if len(pieces) == 1:
            a, b = pieces[0]
            start = upd.state.slot_at(a).offset - upd.state.shard_start
            mid = start + ((a + b) // 2 - start) // CUT_ELEMS * CUT_ELEMS
            pieces = [(a, mid), (mid, b)] if a < mid < b else pieces
        half = len(pieces) // 2
        halves = [pieces[:half], pieces[half:]] if half else [[], pieces]
        for k, ranges in enumerate(halves):
            if k == 1:
                point("update.optimizer", it)  # a crash here leaves the chunk half updated
            upd._adamw(adamw_fused, it, lr, ranges, clip)
        return
    if (
        len(pieces) == 1
        and pieces[0][1] - pieces[0][0] > 1
        and not upd.state.slot_at(pieces[0][0]).layerwise
    ):
        # Element-wise: cutting a piece changes no bit, and gives the crash point
        # below a half-updated chunk to interrupt.
        a, b = pieces[0]
        pieces = [(a, (a + b) // 2), ((a + b) // 2, b)]
    for k, (a, b) in enumerate(pieces):
        if k == 1:
            point("update.optimizer", it)  # a crash here leaves the chunk half updated
        slot = upd.state.slot_at(a)
        if slot.layerwise:
            if (a, b) != (slot.offset, slot.offset + slot.numel):
                raise AssertionError(f"layer {slot.name} was cut into pieces")
            if k == 0 and len(pieces) == 1:
                point("update.optimizer", it)
            names = ["param", "exp_avg"] + (["master"] if upd.state.master else [])
            live = {n: f[n][a:b].view(slot.shape) for n in names}
            out = {n: v.clone() for n, v in live.items()} if tripwire.armed() else live
            muon_layer(
                upd.cfg.muon,
                lr=lr * upd.cfg.muon.lr_scale,
                param=out["param"],
                grad=upd.state.grad[a:b].view(slot.shape),
                momentum=out["exp_avg"],
                clip=clip,
                master=out.get("master"),
            )
            if out is not live:  # kernel-abort: see the AdamW piece below
                tripwire.land([live[n] for n in names], [out[n] for n in names])
            continue
        upd._adamw(adamw_piece, it, lr, [(a, b)], clip)


def user_step(upd, it: int, units: tuple[int, int], points: bool = True) -> None:
    """The script's optimizer on a chunk: its trainable pieces, in two halves (the
    crash point between them leaves the chunk half updated; ``points=False``: none,
    the recheck's second computation)."""
    if upd.hparams is None:
        raise RuntimeError("the updater has no hyperparameters for this iteration")
    halves = upd._user_halves(units)
    for k, (groups, live, grads) in enumerate(halves):
        if k == 1 and points:
            point("update.optimizer", it)  # a crash here leaves the chunk half updated
        if not groups:
            continue
        # faultkit kernel-abort: computed into scratch, landed through the trip-wire.
        armed = tripwire.armed()
        out = {n: [v.clone() for v in vs] for n, vs in live.items()} if armed else live
        step = upd.user_step if upd.user_step is not None else it + 1
        upd.user.step(upd.hparams, step, groups, out, grads, upd.user_skip)
        if armed:
            names = upd.state.set_names
            tripwire.land([t for n in names for t in live[n]], [t for n in names for t in out[n]])


def user_halves(upd, units: tuple[int, int]) -> list:
    """A chunk's two halves as (group numbers, {state: piece views}, gradient views),
    built once per chunk (the layout never moves): per-chunk Python stays off the
    GPU's critical path. A layer-wise (Muon) piece is a whole layer, in its shape."""
    key = ("user", units)
    got = upd._page_lists.get(key)
    if got is not None:
        return got
    e0, e1 = upd.state.element_range(units)
    pieces = []
    for a, b in upd.state.pieces(e0, e1):
        slot = upd.state.slot_at(a)
        gi = upd.user.group_of.get(slot.name) if slot.trainable else None
        if gi is not None:
            pieces.append((a, b, gi, slot))
    if len(pieces) == 1 and not pieces[0][3].layerwise:
        a, b, gi, slot = pieces[0]
        start = slot.offset - upd.state.shard_start
        mid = start + ((a + b) // 2 - start) // CUT_ELEMS * CUT_ELEMS
        if a < mid < b:
            pieces = [(a, mid, gi, slot), (mid, b, gi, slot)]
    half = len(pieces) // 2
    f, s0 = upd.state.flat, upd.state.shard_start
    out = []
    for part in (pieces[:half], pieces[half:]):
        shapes = [sl.shape if sl.layerwise else (b - a,) for a, b, _, sl in part]
        live = {
            n: [f[n][a:b].view(sh) for (a, b, _, _), sh in zip(part, shapes, strict=True)]
            for n in upd.state.set_names
        }
        grads = [
            upd.state.grad[a + s0 : b + s0].view(sh)
            for (a, b, _, _), sh in zip(part, shapes, strict=True)
        ]
        out.append(([gi for _, _, gi, _ in part], live, grads))
    upd._page_lists[key] = out
    return out


def adamw(upd, fn, it: int, lr: float, ranges: list, clip: torch.Tensor) -> None:
    """AdamW on shard-local element ranges: ``adamw_fused`` takes them all at once,
    ``adamw_piece`` one range."""
    if not ranges:
        return
    f, s0 = upd.state.flat, upd.state.shard_start
    names = ["param", "exp_avg", "exp_avg_sq"] + (["master"] if upd.state.master else [])
    live = {n: [f[n][a:b] for a, b in ranges] for n in names}
    # faultkit kernel-abort: torch's AdamW computes into scratch and the result
    # lands through the trip-wire, which stops after N blocks (nvbit_tools).
    armed = tripwire.armed()
    out = {n: [v.clone() for v in vs] for n, vs in live.items()} if armed else live
    one = fn is adamw_piece
    fn(
        upd.cfg.adamw,
        lr=lr,
        step=it + 1,
        clip=clip,
        **{
            n: (v[0] if one else v)
            for n, v in {
                "param": out["param"],
                "grad": [upd.state.grad[a + s0 : b + s0] for a, b in ranges],
                "exp_avg": out["exp_avg"],
                "exp_avg_sq": out["exp_avg_sq"],
                "master": out.get("master"),
            }.items()
            if v is not None
        },
    )
    if armed:
        tripwire.land([t for n in names for t in live[n]], [t for n in names for t in out[n]])
