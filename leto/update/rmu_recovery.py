"""The updater's recovery after a crash: the marker read back (rebuilt from its parity if
its page was lost), an in-flight chunk reverted from its undo copy, lost pages rebuilt
from whichever parity the marker names authoritative (``recover``); the job-wide rule
then decides between finishing and redoing the iteration (``leto.update.rmu.decide``).

Runs in the trainer, once the pool is localized and everything attached; ``upd`` is the
``Updater``. Not covered: losses beyond what parity can rebuild (``RetainedStateLost``,
the checkpoint fallback).
"""

from __future__ import annotations

import torch

from leto.errors import RetainedStateLost
from leto.memory.client import GroupView
from leto.update.chunk_pass import PARITY
from leto.update.marker import BUFFERS, MarkerState, Phase, Step, scratch_buffer


def recover(upd, report: dict) -> MarkerState | None:
    """Rebuild this rank's retained state to the state its marker names."""
    lost = {int(k): v for k, v in report.get("groups", {}).items()}
    failed_allocs = report.get("allocations", {})
    done: set[int] = set()
    if upd.record_group.gid in lost:
        upd.client.reconstruct(report, only={upd.record_group.gid})
        done.add(upd.record_group.gid)
    m = upd.marker.read()
    upd.marker.state = m
    if m is None:
        if any(lost):
            raise RetainedStateLost("the pool holds state but no readable progress marker")
        return None
    grad_gids = {g.gid for g in upd.grad_groups}
    grads_needed = m.phase in (Phase.GRADS_PROTECTED, Phase.SYNCED, Phase.UPDATE)
    # Every group rebuilt from its host parity goes in one call: the host queues each
    # group's staging and decoding while the device runs the last, and waits once (a
    # call a group waited for the device and asked the state manager each time).
    rebuild: set[int] = set()
    for gid in grad_gids & set(lost):
        if grads_needed:
            rebuild.add(gid)
        done.add(gid)  # otherwise the gradients are recomputed: contents do not matter
    in_flight = m.phase is Phase.UPDATE and upd.cfg.transactions
    for gi, g in enumerate(upd.groups):
        if in_flight and gi == m.group and m.step is not Step.LOAD:
            m = upd._recover_in_flight(m, g, lost.get(g.gid), failed_allocs)
            done.add(g.gid)
        elif g.gid in lost:
            rebuild.add(g.gid)
            done.add(g.gid)
    rebuild |= set(lost) - done
    if rebuild:
        upd.client.reconstruct(report, only=rebuild)
    done_marks = sorted(done & set(lost))
    if done_marks:
        upd.client.mark_rebuilt(done_marks)
    return m


def recover_in_flight(
    upd, m: MarkerState, g: GroupView, lost: dict | None, failed: dict
) -> MarkerState:
    gi = m.group
    lost_data = set(lost["data"]) if lost else set()
    undo_lost = bool(failed.get("rmu.undo"))
    par_lost = set(failed.get("rmu.parity", {}).get("failed_pages", []))
    buf_lost = {b: any(p // upd.h1 == k for p in par_lost) for k, b in enumerate(BUFFERS)}
    upd._stale = {b for b, gone in buf_lost.items() if gone}
    code = upd.code(g)
    if upd.log is not None and m.step is Step.START and m.chunk < len(upd.state.chunks(gi)):
        return _recover_resumable(upd, m, g, lost_data, buf_lost, failed)
    steps = (Step.UNDO_DONE, Step.UPDATE_DONE, Step.PARITY_DONE)
    # Under --undo ahead the fused pass writes no UNDO_DONE: a chunk the marker says is
    # about to start may be half updated, and its undo copy is already in place.
    ahead_start = upd.ahead and m.step is Step.START and m.chunk < len(upd.state.chunks(gi))
    if m.step in steps or ahead_start:
        units, pages, undo = upd._chunk(gi, m.chunk)
        if upd.ahead:
            gone = set(failed.get(upd.AHEAD_NAME, {}).get("failed_pages", []))
            if gone & set(upd.ahead_pages_of(units)):
                raise RetainedStateLost(
                    f"undo copy of chunk {m.chunk} of group {g.gid} lost (--undo ahead) while "
                    f"the chunk was in flight"
                )
        elif undo_lost:
            raise RetainedStateLost(
                f"undo buffer lost while chunk {m.chunk} of group {g.gid} was in flight"
            )
        upd._runs_copy(units, to_undo=False)  # back to the state the authoritative parity covers
        first, count = upd.state.chunk_pages(gi, units)
        lost_data -= set(range(first, first + count))
        if m.step in steps:
            m = m.but(step=Step.UNDO_DONE)
    if m.step is Step.TIER2:
        lost_t1 = list(lost["tier1"]) if lost else []
        if lost_t1 and not buf_lost[m.auth]:
            # Host tier 2 is stale mid-refresh, but the buffer host tier 1 was stored
            # from still holds its bytes: lost host pages cost no erasure budget.
            for j in lost_t1:
                g.tier1[j].copy_(upd.buf[m.auth][j])
            lost_t1 = []
        t1 = torch.stack(g.tier1).to(upd.device)
        if lost_data or lost_t1:
            code.tier1.reconstruct(
                g.data, t1, sorted(lost_data) + [len(g.data) + j for j in lost_t1], group=g.gid
            )
            for j in lost_t1:
                g.tier1[j].copy_(t1[j])
        return m
    parity = upd.buf[m.auth]
    if buf_lost[m.auth]:
        if lost_data:
            raise RetainedStateLost(
                f"group {g.gid}: data pages and the authoritative parity buffer were both lost"
            )
        code.tier1.encode(g.data, out=parity, group=g.gid)
    elif lost_data:
        code.tier1.reconstruct(g.data, parity, sorted(lost_data), group=g.gid)
    return m


def _recover_resumable(upd, m: MarkerState, g: GroupView, lost_data: set, buf_lost: dict,
                       failed: dict) -> MarkerState:  # fmt: skip
    """The chunk the marker names may be cut short item by item by the resumable pass
    (``chunk_pass.ItemLog``): each item's units before its recorded one updated, the
    recorded one restorable from its slot, the rest old. Its parity is the authoritative
    buffer's (the old chunk's) plus the change of the items' recorded units: the pass in
    PARITY mode computes that change D from the log alone (restoring each half-written
    unit from its slot), into the scratch buffer. Lost data pages of the group are then
    rebuilt from x ⊕ D — the state the crash left, which the resumed pass continues; a
    lost authoritative buffer is re-encoded as encode(data) ⊕ D."""
    gi, j = m.group, m.chunk
    if failed.get(upd.LOG_NAME, {}).get("failed_pages"):
        raise RetainedStateLost(
            f"the resumable pass's item log lost while chunk {j} of group {g.gid} may have "
            f"been in flight"
        )
    code, x = upd.code(g), m.auth
    y = scratch_buffer(gi, x)
    units, pages, _ = upd._chunk(gi, j)
    first, _ = upd.state.chunk_pages(gi, units)
    scratch = upd._pages(y, upd.buf[y]).pages
    live = upd._pages(("chunk", gi, j), pages).pages
    delta = upd._buf_flat[y]
    delta.zero_()
    for part in upd.parts(resumable=True):
        upd.chunk_pass.run(units, part, first, scratch, code.tier1, live, None, log=upd.log,
                           tag=upd.log_tag(m.iteration, gi, j), mode=PARITY)  # fmt: skip
    parity = upd._buf_flat[x]
    if buf_lost[x]:
        if lost_data:
            raise RetainedStateLost(
                f"group {g.gid}: data pages and the authoritative parity buffer were both lost"
            )
        code.tier1.encode(g.data, out=upd.buf[x], group=g.gid)
        _xor_into(parity, delta)
    elif lost_data:
        _xor_into(delta, parity)  # the parity of the state the crash left
        code.tier1.reconstruct(g.data, upd.buf[y], sorted(lost_data), group=g.gid)
    return m


def _xor_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    a, b = dst.view(torch.int32), src.view(torch.int32)
    a.bitwise_xor_(b)
