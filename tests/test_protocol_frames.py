"""Replies longer than one datagram (``protocol.FRAMES``): a 3 B-parameter pool's layout
is ~400 KB of JSON, past the 256 KB a datagram may carry; the state manager refused it
on the H200. Framed replies arrive whole with their fds; malformed frames and framed
requests are refused by name."""

from __future__ import annotations

import os
import threading

import pytest

from leto.memory import protocol as P
from leto.memory.errors import PoolProtocolError
from tests.pool_helpers import seqpacket_pair


def _sending(target, *args) -> threading.Thread:
    # A framed reply outgrows the socket buffer: the reader must read while it is sent.
    def run():
        try:
            target(*args)
        except OSError:
            pass  # the reader refused and closed: what the test expects

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _big_layout(n_groups: int) -> P.LayoutReply:
    members = [[f"set.param{i}", i * 64, 64] for i in range(40)]
    groups = [
        {"gid": g, "kind": "protected", "members": members, "tier1": 4, "tier2": 1,
         "page_bytes": 2 << 20}
        for g in range(n_groups)
    ]  # fmt: skip
    return P.LayoutReply(groups, 2 * n_groups)


def test_a_reply_past_one_datagram_arrives_whole_with_its_descriptors():
    reply = _big_layout(400)
    assert len(P.encode(reply)) > P.MAX_MESSAGE_BYTES
    with seqpacket_pair(reply.n_fds) as (a, b, pages):
        t = _sending(P.send, a, reply, pages)
        got, first = P.recv(b, frames=True)
        assert got == reply and first == []
        fds = P.recv_fds(b, reply.n_fds, first)
        assert len(fds) == reply.n_fds
        t.join(10)
        for fd in fds:
            os.close(fd)


def test_a_request_may_not_be_framed():
    with seqpacket_pair() as (a, b, _):
        _sending(P.send, a, _big_layout(400))
        with pytest.raises(PoolProtocolError, match="a request must be one datagram"):
            P.recv(b)


@pytest.mark.parametrize(
    "nbytes, count, says",
    [
        (100_000, 1, "is malformed"),  # 100 KB needs two frames
        (P.MAX_REPLY_BYTES + 1, 1025, "is malformed"),
        (70_000, 2, "announced 70000 bytes"),  # frames shorter than announced
    ],
)
def test_malformed_frames_are_refused(nbytes, count, says):
    with seqpacket_pair() as (a, b, _):
        a.sendall(P.encode(P.Frames(nbytes, count)))
        for _ in range(count if count < 10 else 0):
            a.sendall(b"x" * 1000)
        with pytest.raises(PoolProtocolError, match=says):
            P.recv(b, frames=True)
