"""The resumable chunk pass (``chunk_pass.ItemLog``; chunk_pass.cu's ``chunk_pass_rf_h*``):
no undo copy of a chunk, each item's old values kept in slots as it is written.

* Item by item: any mixture of items that had not started, stopped in any unit with
  that unit half written, or finished — resumed, gives the uninterrupted pass's bytes
  (parameters, moments, scratch parity), and the PARITY mode gives the parity change of
  the state the crash left. On the CPU twin and (gpu marker) the CUDA kernel.
* In the updater: no undo copy and no UNDO_DONE on the update's path, except for the
  chunk the update recheck samples; a crash inside the pass with data pages of the
  in-flight chunk lost, or its authoritative parity buffer lost, resumes to the bytes of
  a run with undo copies; the item log lost while a chunk is in flight is a fatal
  failure that names it.
"""

from __future__ import annotations

import pytest
import torch

from leto.errors import RetainedStateLost
from leto.memory.client import PoolClient
from leto.memory.config import PoolConfig
from leto.memory.launch import start_state_manager
from leto.update.chunk_pass import DONE, FRESH, PARITY, RESUMABLE_ENV, RESUME, STEP_UNITS
from leto.update.rmu import Updater, UpdaterConfig
from leto.update.user_optim import UserOptimizer
from tests import rmu_harness as h
from tests import test_user_optim as u
from tests.pool_helpers import small_config

faultkit_hooks = pytest.importorskip("faultkit.hooks")

DIMS = (60, 1031, 37)
KW = {"dims": DIMS, "chunk_units": 4}
ITERS = u.ITERS


@pytest.fixture
def pool():
    sm = start_state_manager(small_config(data_pages=12, tier1_pages=3))
    yield sm
    sm.stop()


def _mixture(pool_or_cfg, device: str) -> None:
    """Build a state of every kind of item, run PARITY then RESUME on it, compare."""
    sm = start_state_manager(pool_or_cfg)
    try:
        tr = u.Trainer(sm, "adamw-fused", dims=(1024, 2400, 7) if device == "cuda" else DIMS,
                       chunk_units=4)  # fmt: skip
        tr.iteration()  # moments that are not zero
        up, st = tr.up, tr.up.state
        assert up.log is not None, up.undo_path
        up.chunk_pass.prepare(UserOptimizer.hparams(up.user), 2, frozenset())
        h.grads_for(tr.model, 1)
        gi = 0
        units, pages, _ = up._chunk(gi, 0)
        n = units[1] - units[0]
        assert n >= 3, n  # a stop in a middle unit exists
        first, _ = st.chunk_pages(gi, units)
        live = up._pages(("chunk", gi, 0), pages).pages
        code = up.code(up.groups[gi]).tier1
        pb, ue = st.page_bytes, st.unit_elems
        items = pb // 16
        scratch = [torch.zeros(pb, dtype=torch.uint8, device=device) for _ in range(up.h1)]
        log, tag = up.log, up.log_tag(1, gi, 0)

        def run(mode, out, u1=None):
            for part in up.parts(resumable=True):
                up.chunk_pass.run((units[0], u1 or units[1]), part, first, out, code, live, None,
                                  log=log, tag=tag, mode=mode)  # fmt: skip

        def words(ps):  # [pages, items, 4] int32 of the chunk's pages
            return torch.stack([p.view(torch.int32).view(items, 4) for p in ps]).clone()

        s0 = words(live)
        run(FRESH, scratch)
        s1, y1 = words(live), [y.clone() for y in scratch]
        assert not torch.equal(s0, s1)
        # The sums before unit k of every item: the pass over the chunk's first k units.
        sums = [torch.zeros(up.h1, items, 4, dtype=torch.int32, device=device)]
        dummy = [torch.zeros(pb, dtype=torch.uint8, device=device) for _ in range(up.h1)]
        for k in range(1, n + 1):
            for w, s in zip(live, s0, strict=True):
                w.view(torch.int32).view(items, 4).copy_(s)
            run(FRESH, dummy, units[0] + k)
            sums.append(torch.stack([log.sums(2, r) for r in range(up.h1)]).clone())
        # A crash finds the parts before the one in flight finished, the parts after it not
        # started, and in it every fate: not started, stopped in the step from unit k (the
        # step's units each untouched, half written or written), finished. Each part in
        # turn is the one in flight (its slots are at the item's place in the part).
        G = STEP_UNITS
        gen = torch.Generator().manual_seed(5)
        steps = -(-n // G)
        idx = torch.arange(items, device=device)
        inside = torch.zeros(n, items, dtype=torch.bool, device=device)
        for row in up.chunk_pass.table:  # the units with values to change, item by item
            e = (units[0] + torch.arange(n, device=device)[:, None]) * ue + 4 * idx[None, :]
            inside |= (e >= int(row["start"])) & (e < int(row["end"]))
        q = torch.arange(n, device=device).repeat_interleave(3)[:, None]  # page -> unit
        is_param = (torch.arange(3 * n, device=device) % 3 == 0)[:, None]
        part_list = up.parts(resumable=True)
        assert len(part_list) > 1, part_list
        for lo, hi in part_list:
            i0, i1 = lo // 4, hi // 4
            fate = torch.randint(-1, steps + 1, (items,), generator=gen) * G  # < 0: not started
            fate = torch.where(fate >= steps * G, n, fate).to(device)
            fate[:i0], fate[i1:] = n, -1
            done = fate == n
            stopped = (fate >= 0) & (fate < n)
            restored = torch.where(((q < fate) | done)[..., None], s1, s0)
            in_step = (q >= fate) & (q < fate + G) & stopped
            how = torch.randint(0, 3, (3 * n, items), generator=gen).to(device)  # 0 untouched
            written = in_step & ((how == 2) | ((how == 1) & is_param))
            state = torch.where(written[..., None], s1, restored)
            # What the crash left in the log.
            prog = torch.full((items,), (tag + 1) << 24, dtype=torch.int64, device=device)
            slot = torch.randint(0, 2, (items,), generator=gen).to(device)
            mask = torch.zeros(items, dtype=torch.int64, device=device)
            for j in range(G):
                unit = (fate + j).clamp(0, n - 1)
                bit = stopped & (fate + j < n) & inside[unit, idx]
                mask |= bit.long() << j
            code_of = (fate.clamp(min=0) << 10) | (mask << 2) | (slot << 1) | 1
            prog = torch.where(stopped, (tag << 24) | code_of, prog)
            prog = torch.where(done, torch.full_like(prog, (tag << 24) | DONE), prog)
            log.progress.copy_(prog)
            for t_ in (log.slots, log.fin):
                t_.copy_(torch.randint(-(2**31), 2**31 - 1, t_.shape, generator=gen))
            here = slice(i0, i1)  # the part's items; its slots at [0, i1 - i0)
            for k in range(0, n, G):
                for sl in (0, 1):
                    at = (stopped & (fate == k) & (slot == sl))[here]
                    for j in range(min(G, n - k)):
                        mine = at & ((mask[here] >> j) & 1 == 1)
                        for a in range(3):
                            log.data(sl, j, a)[: i1 - i0][mine] = s0[3 * (k + j) + a][here][mine]
                    for r in range(up.h1):
                        log.sums(sl, r)[: i1 - i0][at] = sums[k][r][here][at]
            for r in range(up.h1):
                log.sums(2, r)[done] = sums[n][r][done]
            assert bool(stopped.any() and done.any() and (fate < 0).any() and written.any())
            for w, st_ in zip(live, state, strict=True):
                w.view(torch.int32).view(items, 4).copy_(st_)
            # PARITY: the change from the old chunk to the state left, units restored.
            delta = [torch.zeros(pb, dtype=torch.uint8, device=device) for _ in range(up.h1)]
            run(PARITY, delta)
            assert torch.equal(words(live), restored), "PARITY mode restores each stopped unit"
            want = [torch.zeros(pb, dtype=torch.uint8, device=device) for _ in range(up.h1)]
            old = [s.reshape(-1).view(torch.uint8) for s in s0]
            code.update(want, first, old, [w.clone() for w in live], group=up.groups[gi].gid)
            for r in range(up.h1):
                assert torch.equal(delta[r], want[r]), f"PARITY row {r}, part {(lo, hi)}"
            assert torch.equal(log.progress, prog), "PARITY mode writes no progress"
            # RESUME: from the state the crash left to the uninterrupted pass's bytes.
            for w, s in zip(live, state, strict=True):
                w.view(torch.int32).view(items, 4).copy_(s)
            out = [torch.zeros(pb, dtype=torch.uint8, device=device) for _ in range(up.h1)]
            run(RESUME, out)
            assert torch.equal(words(live), s1), f"RESUME ends uninterrupted, part {(lo, hi)}"
            for r in range(up.h1):
                assert torch.equal(out[r], y1[r]), f"parity row {r}, part {(lo, hi)}"
            assert bool((log.progress == (tag << 24) | DONE).all())
        tr.client.close()
    finally:
        sm.stop()


def test_any_mixture_of_stopped_items_resumes_to_the_uninterrupted_bytes():
    _mixture(small_config(data_pages=12, tier1_pages=3), "cpu")


@pytest.mark.gpu
def test_on_the_gpu_any_mixture_of_stopped_items_resumes_to_the_uninterrupted_bytes():
    _mixture(PoolConfig.for_cuda(0, data_pages=12, tier1_pages=4), "cuda")


@pytest.fixture(scope="module")
def with_undo_copies():
    """Fault-free, an undo copy of every chunk: what every resumable run must give."""
    mp = pytest.MonkeyPatch()
    mp.setenv(RESUMABLE_ENV, "0")
    sm = start_state_manager(small_config(data_pages=12, tier1_pages=3))
    try:
        return u.train(sm, "adamw-fused", None, **KW)
    finally:
        sm.stop()
        mp.undo()


def _same(got, want, what):
    for k in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[k][: want[k].numel()].view(torch.uint8),
                           want[k].view(torch.uint8)), f"{what}: {k}"  # fmt: skip


def _crash_lose_resume(pool, crash, lose):
    """Train to ``crash`` (a point that raises), lose what ``lose(updater)`` names
    ([(allocation, pages)]) while no trainer is attached, resume and finish."""
    faultkit_hooks.arm(*crash, mode="raise")
    tr = u.Trainer(pool, "adamw-fused", **KW)
    try:
        with pytest.raises(faultkit_hooks.InjectedCrash):
            while tr.t < ITERS:
                tr.iteration()
        losses = lose(tr.up)
    finally:
        faultkit_hooks.disarm()
        tr.client.close()
    with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
        for name, idx in losses:
            f.inject_loss("data", name, idx)
    tr = u.Trainer(pool, "adamw-fused", **KW)
    try:
        while tr.t < ITERS:
            tr.iteration()
        st = tr.up.state
        for g in tr.up.groups:
            assert tr.up.code(g).verify(g.data, g.tier1, g.tier2), f"group {g.gid} stale"
        return {
            k: torch.cat([v[s.offset : s.offset + s.numel] for s in st.slots]).clone()
            for k, v in st.flat.items()
        }
    finally:
        tr.client.close()


def _chunk_pages(up, name: str, gi: int = 0, j: int = 0) -> list[int]:
    """Pages of allocation ``name`` in chunk ``j`` of group ``gi``."""
    u0, u1 = up.state.chunks(gi)[j]
    k = up.state.set_names.index(name)
    per = up.state.unit_pages[k]
    return list(range(u0 * per, u1 * per))


@pytest.mark.parametrize("crash", [("update.optimizer", 2, 1), ("update.optimizer", 3, 2),
                                   ("update.undo", 2, 2), ("update.parity", 1, 1)],
                         ids=lambda c: f"{c[0]}@{c[1]}#{c[2]}")  # fmt: skip
def test_a_crash_in_the_pass_with_pages_of_its_chunk_lost_resumes_exactly(
    pool, with_undo_copies, crash
):
    # The crash leaves the in-flight chunk half written item by item; a parameter page
    # and a second-moment page of that chunk are lost: rebuilt from the authoritative
    # parity plus the recorded change, then the pass resumes.
    def lose(up):
        gi, j = up.marker.state.group, up.marker.state.chunk
        return [("param", _chunk_pages(up, "param", gi, j)[1:2]),
                ("exp_avg_sq", _chunk_pages(up, "exp_avg_sq", gi, j)[2:3])]  # fmt: skip

    _same(_crash_lose_resume(pool, crash, lose), with_undo_copies, f"{crash}")


def test_the_authoritative_parity_lost_mid_pass_is_made_again_from_the_state_left(
    pool, with_undo_copies
):
    def lose(up):
        m = up.marker.state
        k = ["A", "B", "C"].index(m.auth.name)
        return [("rmu.parity", [k * up.h1 + i for i in range(up.h1)])]

    _same(_crash_lose_resume(pool, ("update.optimizer", 2, 1), lose), with_undo_copies, "auth")


def test_the_item_log_lost_while_a_chunk_is_in_flight_is_a_fatal_failure_naming_it(pool):
    with pytest.raises(RetainedStateLost, match=r"item log lost while chunk 0 of group \d+"):
        _crash_lose_resume(pool, ("update.optimizer", 2, 1), lambda up: [(Updater.LOG_NAME, [0])])


def test_the_update_takes_no_undo_copy_but_the_rechecked_chunks(pool):
    tr = u.Trainer(pool, "adamw-fused", **KW)
    try:
        assert tr.up.log is not None and "none: the fused pass keeps" in tr.up.undo_path
        # Why not --undo ahead, in memory: the whole-state copy it would hold.
        whole = sum(t.numel() * t.element_size() for t in tr.up._alloc_pages.values())
        assert f"--undo ahead would hold a whole-state copy of {whole / 2**30:.2f} GiB" in tr.up.undo_path
        assert ("GiB of the device free now" in tr.up.undo_path) == (tr.up.device.type == "cuda")
        tr.iteration()
        with h.watched_update(tr.up) as (copies, steps):
            tr.iteration()
        assert copies == [], f"chunk copies on the update's path: {copies}"
        assert "UNDO_DONE" not in steps, steps
        assert len(steps) == h.update_steps_without_copies(tr.up), steps

        class Every:  # a recheck of every chunk: each takes its undo copy again
            off, every, to_settle = None, True, set()

            def due(self, t, ordinal):
                return True

            def must_settle(self, t, gi, j):
                return False

            def compared(self, *a):
                pass

        tr.up.recheck = Every()
        with h.watched_update(tr.up) as (copies, steps):
            tr.iteration()
        chunks = [c for gi in range(len(tr.up.groups)) for c in tr.up.state.chunks(gi)]
        assert set(copies) == set(chunks), copies  # every chunk copied (and restored)
        assert steps.count("UNDO_DONE") == len(chunks), steps
    finally:
        tr.client.close()


def test_a_code_with_more_parity_rows_than_the_horner_scheme_copies_each_chunk():
    sm = start_state_manager(small_config(data_pages=12, tier1_pages=5))
    try:
        client = PoolClient.connect(sm.socket_path, sm.token)
        model = h.build_model(dims=DIMS)
        names = {id(p): n for n, p in model.named_parameters()}
        up = Updater(client, model, None, UpdaterConfig(chunk_units=4),
                     user=UserOptimizer(u.make("adamw-fused", model), names))  # fmt: skip
        assert up.log is None
        assert "not resumable: 5 tier-1 pages" in up.undo_path, up.undo_path
        client.close()
    finally:
        sm.stop()


def test_chunks_longer_than_the_record_names_copy_each_chunk(pool, monkeypatch):
    import leto.update.rmu as rmu

    monkeypatch.setattr(rmu, "MAX_CHUNK_UNITS", 2)  # the record's 14 bits, made small
    tr = u.Trainer(pool, "adamw-fused", **KW)
    try:
        assert tr.up.log is None
        assert "not resumable: chunks of 4 units (its record names 2)" in tr.up.undo_path
    finally:
        tr.client.close()


def test_the_twin_under_the_trip_wire_runs_its_first_blocks_and_resumes_the_rest():
    """faultkit's kernel-abort on the CPU: the twin runs the first N blocks of items
    (THREADS each) as the kernel would and holds the rest; resumed, the chunk ends with
    the uninterrupted pass's bytes."""
    from leto.update.chunk_pass import THREADS
    from nvbit_tools import tripwire

    sm = start_state_manager(small_config(data_pages=12, tier1_pages=3, page_bytes=64 << 10))
    try:
        tr = u.Trainer(sm, "adamw-fused", dims=(256, 600, 7), chunk_units=4)
        tr.iteration()
        up, st = tr.up, tr.up.state
        up.chunk_pass.prepare(UserOptimizer.hparams(up.user), 2, frozenset())
        h.grads_for(tr.model, 1)
        units, pages, _ = up._chunk(0, 0)
        first, _ = st.chunk_pages(0, units)
        live = up._pages(("chunk", 0, 0), pages).pages
        code = up.code(up.groups[0]).tier1
        items = st.page_bytes // 16
        log, tag = up.log, up.log_tag(1, 0, 0)
        (lo, hi), *rest = up.parts(resumable=True)
        assert (hi - lo) // 4 > 2 * THREADS  # blocks are held: the test proves something

        def zeros():
            return [torch.zeros(st.page_bytes, dtype=torch.uint8) for _ in range(up.h1)]

        s0 = [p.clone() for p in live]
        want = zeros()
        for part in up.parts(resumable=True):
            up.chunk_pass.run(units, part, first, want, code, live, None, log=log, tag=tag)
        s1 = [p.clone() for p in live]
        for p, s in zip(live, s0, strict=True):
            p.copy_(s)
        log.progress.zero_()
        got = zeros()
        tripwire.arm(2, kill=False)
        try:
            with pytest.raises(tripwire.TripwireFired) as e:
                up.chunk_pass.run(units, (lo, hi), first, got, code, live, None, log=log, tag=tag)
        finally:
            tripwire.disarm()
        assert e.value.report["partial"] and e.value.report["blocks_launched"] > 2
        ran = slice(lo // 4, lo // 4 + 2 * THREADS)
        held = slice(lo // 4 + 2 * THREADS, hi // 4)
        assert bool((log.progress[ran] == (tag << 24) | DONE).all())
        assert bool((log.progress[held] == 0).all())
        changed = False
        for p, s, n in zip(live, s0, s1, strict=True):
            w, w0, w1 = (x.view(torch.int32).view(items, 4) for x in (p, s, n))
            assert torch.equal(w[held], w0[held]) and torch.equal(w[ran], w1[ran])
            changed |= not torch.equal(w0[ran], w1[ran])
        assert changed, "the blocks that ran changed nothing: the test proves nothing"
        got = zeros()  # the resumed pass adds the finished items' saved sums again
        for part in [(lo, hi), *rest]:
            up.chunk_pass.run(units, part, first, got, code, live, None, log=log, tag=tag,
                              mode=RESUME)  # fmt: skip
        for p, s in zip(live, s1, strict=True):
            assert torch.equal(p, s)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        tr.client.close()
    finally:
        sm.stop()
