"""Page descriptors against the open-file limit (``leto.memory.fdlimit``): processes
raise the limit as far as they may, and a reply whose descriptors cannot fit is refused
by name — drained, so the connection stays in step — instead of failing with EMFILE
half-way through an attach."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from leto.memory import fdlimit
from leto.memory import protocol as P
from leto.memory.errors import PoolFdLimit
from tests.pool_helpers import seqpacket_pair


def test_a_reply_whose_descriptors_do_not_fit_is_refused_and_drained(monkeypatch):
    # The first FD_BATCH ride on the reply, the rest in FDS batches.
    with seqpacket_pair(600) as (a, b, pages):
        before = len(os.listdir("/proc/self/fd"))
        P.send(a, P.Fds(len(pages)), pages)
        P.send(a, P.Fds(0))  # the next message must still be read in step
        monkeypatch.setattr(fdlimit, "room", lambda: 100)
        _, first = P.recv(b)
        with pytest.raises(PoolFdLimit, match=r"carries 600 page descriptors.*ulimit -n"):
            P.recv_fds(b, len(pages), first)
        assert len(os.listdir("/proc/self/fd")) == before, "received descriptors leaked"
        msg, fds = P.recv(b)
        assert isinstance(msg, P.Fds) and msg.count == 0 and fds == []


def test_a_reply_that_fits_is_received_whole():
    with seqpacket_pair(300) as (a, b, pages):
        P.send(a, P.Fds(len(pages)), pages)
        _, first = P.recv(b)
        got = P.recv_fds(b, len(pages), first)
        assert len(got) == 300
        for fd in got:
            os.close(fd)


def test_the_limit_is_raised_to_the_hard_one_at_least():
    # A fresh process with a low soft limit (as many shells set: 1,024) ends up with at
    # least its hard limit — or WANT, where it may raise the hard limit too.
    code = (
        "import resource; from leto.memory import fdlimit; "
        "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, h)); "
        "print(fdlimit.raise_limit(), h)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    now, hard = map(int, out.stdout.split())
    assert now >= min(hard, fdlimit.WANT) and now > 256


def test_a_reply_of_any_size_holds_one_batch_of_descriptors_open_on_either_side():
    # The state manager gives openers (protocol.send opens each as its batch goes out,
    # closes it after); the client imports each fd as it arrives (recv_fds' take). A
    # 5 B-parameter pool's ~40,000 pages then pass a hard limit of 20,000.
    n = 3 * P.FD_BATCH + 7
    with seqpacket_pair() as (a, b, _):
        before = len(os.listdir("/proc/self/fd"))
        P.send(a, P.Fds(n), [lambda i=i: os.memfd_create(f"page{i}") for i in range(n)])
        assert len(os.listdir("/proc/self/fd")) == before, "the sender kept what it opened"
        peak = []

        def take(i: int, fd: int) -> int:
            peak.append(len(os.listdir("/proc/self/fd")))
            size = os.fstat(fd).st_size
            os.close(fd)
            return i + size

        _, first = P.recv(b)
        got = P.recv_fds(b, n, first, take)
        assert got == list(range(n))
        assert max(peak) <= before + P.FD_BATCH + 1, max(peak) - before
        assert len(os.listdir("/proc/self/fd")) == before


def test_a_host_pool_at_its_open_file_limit_refuses_the_allocation_and_keeps_the_rest(
    monkeypatch,
):
    # CPU pools keep a memfd per page open in the state manager: at the limit the
    # allocation is refused by name, the pages it made are released, and what was
    # allocated before is untouched.
    from leto.memory import host_pages
    from leto.memory.backends.host import HostPageOwner
    from leto.memory.config import AllocationKind
    from leto.memory.errors import remote_error
    from leto.memory.state_manager.table import Table
    from tests.pool_helpers import PAGE, small_config

    owner = HostPageOwner(PAGE)
    table = Table(small_config(), owner, owner, owner)
    kept, _ = table.alloc("w", AllocationKind.PROTECTED.value, 3 * PAGE)
    real, made = host_pages.new_page, []

    def new_page(page_bytes, name="leto-page"):
        if len(made) == 5:
            raise OSError(24, "Too many open files")
        made.append(real(page_bytes, name))
        return made[-1]

    monkeypatch.setattr(host_pages, "new_page", new_page)
    with pytest.raises(PoolFdLimit, match=r"open-file limit .* not made .*--page-bytes"):
        table.alloc("big", AllocationKind.PROTECTED.value, 9 * PAGE)
    assert list(table.allocations) == ["w"] and table.allocations["w"] is kept
    for fd in made:  # every page made for the refused allocation was closed
        with pytest.raises(OSError):
            os.fstat(fd)
    err = remote_error("fd-limit", "…")
    assert isinstance(err, PoolFdLimit)
