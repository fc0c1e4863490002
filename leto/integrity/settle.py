"""Settling a disagreement of the update recheck: three computations of one chunk, and
what two of them agree on stays (the alarm policy of ``leto.integrity.recheck``).

Runs in the trainer, inside the updater's chunk transaction (``Updater._settle``), only
on the redo of a chunk whose recheck disagreed before the rollback: it waits for the
device (a rare path). The three: the first computation (the fused pass, or the unfused
steps), the recheck's (the chunk restored from its undo copy, stepped in place by the
script's optimizer) and a third — the script's optimizer on copies of the undo copy,
out of place, in fresh memory: no page of the pool, no undo restore, no fused kernel.

Not covered: a fault that makes two of the three wrong alike (then the wrong pair wins);
chunks the recheck never disagreed on (they are rechecked as before).
"""

from __future__ import annotations

import torch

from leto.integrity.recheck import WrongUpdate


def chunk(upd, it: int, gi: int, j: int, units, fused_bufs, pages, undo) -> None:
    """A chunk whose recheck disagreed before the rollback now redone, settled by three
    computations (leto.integrity.recheck): the first (the fused pass, or the unfused
    steps), the recheck's (restored from the undo copy, stepped in place) and a third
    — torch's step on copies of the undo copy, out of place, through no page of the
    pool. What two agree on stays. ``fused_bufs``: (authoritative, scratch) parity
    buffers when the fused pass ran (its scratch parity has absorbed the first)."""
    rc = upd.recheck
    pb, (u0, u1) = upd.state.page_bytes, units
    names = upd.state.set_names
    regions = [
        upd._alloc_pages[name][u0 * up * pb : u1 * up * pb]
        for name, up in zip(names, upd.state.unit_pages, strict=True)
    ]
    first = [r.clone() for r in regions]
    third = step_out_of_place(upd, it, units)
    upd._runs_copy(units, to_undo=False)
    upd._user_step(it, units, points=False)
    again = [r.clone() for r in regions]

    def same(p, q) -> bool:
        return all(torch.equal(u, v) for u, v in zip(p, q, strict=True))

    fa, fc, ac = same(first, again), same(first, third), same(again, third)
    evidence = evidence_of(names, upd.state.flat, first, again, third)
    what = "the fused chunk pass" if fused_bufs is not None else "the unfused steps"
    where = f"iteration {it}, chunk {j} of state group {gi}"
    if fa and fc:
        rc.settled(it, gi, j, "transient", evidence)  # the redo agrees: kept as it is
        return
    if fc:  # the recheck's own computation is the odd one out: the first stays
        for r, v in zip(regions, first, strict=True):
            r.copy_(v)
        rc.settled(it, gi, j, "recheck", evidence)
        rc.switch_off(
            f"its recomputation of {where} disagreed with {what} and with a third "
            f"computation (torch's step out of place), which agree bit for bit; the job "
            f"goes on, no device is named"
        )
        return
    if ac:  # the first computation is the odd one out, the same after the rollback
        rc.settled(it, gi, j, "first", evidence)
        if fused_bufs is not None:
            # The chunk now holds torch's values; its scratch parity absorbed the fused
            # pass's: made again from the authoritative parity and the undo copy.
            x, y = fused_bufs
            upd._copy(upd._buf_flat[y], upd._buf_flat[x])
            code, (first_page, _) = (
                upd.code(upd.groups[gi]),
                upd.state.chunk_pages(gi, units),
            )
            code.tier1.update(
                upd._pages(y, upd.buf[y]), first_page, upd._pages(("undo", gi, j), undo),
                upd._pages(("chunk", gi, j), pages), group=upd.groups[gi].gid,
            )  # fmt: skip
            upd.chunk_pass, upd._fused = None, None
            upd.chunk_pass_reason = (
                f"the fused pass disagreed with torch's step twice at {where} "
                f"(software, not the device)"
            )
        rc.notice(
            f"{what} disagreed at {where} with two computations by torch's step, which "
            f"agree: their values are kept"
            + (" and the fused pass is off for the rest of the job" if fused_bufs else "")
        )
        return
    rc.settled(it, gi, j, "all-differ", evidence)
    raise WrongUpdate(
        f"iteration {it}: rank {rc.rank}'s update of chunk {j} of state "
        f"group {gi} differs three ways ({what}, its recomputation and a third): a wrong "
        f"computation on this rank. The job falls back to its last verified checkpoint",
        iteration=it,
        named=[rc.rank],
    )


def step_out_of_place(upd, it: int, units) -> list[torch.Tensor]:
    """The chunk's regions (one per state tensor) stepped by the script's optimizer
    from copies of the undo copy, in fresh memory: the pool's pages are not touched."""
    e0, _ = upd.state.element_range(units)
    copies = {name: saved.clone() for name, _, saved in upd.undo_runs(units)}
    f = upd.state.flat
    step = upd.user_step if upd.user_step is not None else it + 1
    for groups, live, grads in upd._user_halves(units):
        if not groups:
            continue
        views = {}
        for name, vs in live.items():
            dt, es = f[name].dtype, f[name].element_size()
            flat = copies[name].view(dt)
            views[name] = [
                flat[(v.data_ptr() - f[name].data_ptr()) // es - e0 :][: v.numel()].view(v.shape)
                for v in vs
            ]  # fmt: skip
        upd.user.step(upd.hparams, step, groups, views, grads, upd.user_skip)
    return [copies[name] for name in upd.state.set_names]


def evidence_of(names, flat, first, again, third) -> dict:
    """Where the three computations of a settled chunk part: per state tensor, the first
    differing element and its three values (bits as hex)."""
    out = {}
    for name, a, b, c in zip(names, first, again, third, strict=True):
        dt = flat[name].dtype
        diff = ((a != b) | (a != c)).nonzero()
        if diff.numel():
            i = int(diff[0]) // flat[name].element_size()
            vals = [x.view(dt)[i].item() for x in (a, b, c)]
            out[name] = {"differing_bytes": int(diff.numel()), "element": i,
                         "first": vals[0], "recheck": vals[1], "third": vals[2]}  # fmt: skip
    return out
