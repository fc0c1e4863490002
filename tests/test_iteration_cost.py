"""What a steady iteration issues does not grow with the pool's pages.

The issue "The overhead users see": a 1 B-parameter script under ``leto run`` made
≈ 16,000 ``cudaMemcpyAsync`` an iteration from Python (parity buffers copied page by
page, 2-unit chunks), and was 4.6x slower than under torchrun. Here the same updater
runs one steady iteration at two model sizes, 16x apart in pages, with the chunk size
``leto.Run`` uses by default, and the copies (``aten::copy_``, under ``torch.profiler``)
and codec/chunk-pass launches are counted: they must be the same.

The CPU build's stand-ins for single CUDA launches (the GF codec's NumPy kernel and the
fused chunk pass's twin) work page by page inside one call; each call counts as one
launch, and the copies made inside them are not counted (on CUDA each is one kernel).
"""

from __future__ import annotations

import collections

import pytest
from torch.profiler import ProfilerActivity, profile, record_function

from leto.erasure.kernels.cpu import CpuKernel
from leto.memory.launch import start_state_manager
from leto.update.chunk_pass import ChunkPass
from tests import test_user_optim as uo
from tests.pool_helpers import small_config

STAND_IN = "cpu stand-in for one launch"


@pytest.fixture
def counted(monkeypatch):
    """Counts the stand-ins' calls, and marks them for the profiler."""
    calls = collections.Counter()

    def wrap(name, fn):
        def inner(*a, **kw):
            calls[name] += 1
            with record_function(STAND_IN):
                return fn(*a, **kw)

        return inner

    # Trainer.iteration counts against test_user_optim's ITERS: raised here only (a
    # module global left raised made that file's tests train a million iterations).
    monkeypatch.setattr(uo, "ITERS", 10**6)
    monkeypatch.setattr(CpuKernel, "_matmul", staticmethod(wrap("codec", CpuKernel._matmul)))
    monkeypatch.setattr(ChunkPass, "_twin", wrap("chunk pass", ChunkPass._twin))
    return calls


def _issued(dims, calls) -> dict:
    # Pages of 4 KiB, every model in one group: only the page count differs.
    sm = start_state_manager(small_config(page_bytes=4096, data_pages=4096, tier1_pages=4))
    try:
        tr = uo.Trainer(sm, "adamw-fused", dims=dims, chunk_units=None)
        tr.iteration()
        tr.iteration()  # steady: page lists and tables built
        calls.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            tr.iteration()
        events = prof.events()
        marked = set()
        for e in events:
            if e.name == STAND_IN:
                marked.add(e.id)

        def inside(e) -> bool:
            p = e.cpu_parent
            while p is not None:
                if p.id in marked:
                    return True
                p = p.cpu_parent
            return False

        copies = sum(1 for e in events if e.name == "aten::copy_" and not inside(e))
        pages = sum(len(g.data) for g in tr.up.groups)
        tr.client.close()
        return {"pages": pages, "copies": copies, **calls}
    finally:
        sm.stop()


def test_a_steady_iteration_issues_the_same_copies_and_launches_at_16x_the_pages(counted):
    small = _issued((64, 64, 64), counted)
    large = _issued((256, 256, 256), counted)
    assert large["pages"] >= 12 * small["pages"], (small, large)
    got = {k: (small.get(k), large.get(k)) for k in ("copies", "codec", "chunk pass")}
    assert all(a == b for a, b in got.values()), (
        f"what an iteration issues grows with the pages ({small['pages']} -> "
        f"{large['pages']} pages): {got}"
    )
    # And it is small: the test's own gradients (6), the loop record (3), ~9 marker
    # writes of 3 copies each, one chunk's undo copies and the group's parity moves.
    assert small["copies"] <= 64, small
