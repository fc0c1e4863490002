"""Protocol abuse: whatever a peer sends, the state manager answers ERROR, keeps its
state and keeps serving (a fuzz-style property test against a real state manager)."""

from __future__ import annotations

import json
import os
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.memory import protocol as P
from leto.memory.client import PoolClient
from leto.memory.launch import start_state_manager
from tests.pool_helpers import PAGE, small_config

OPS = [op.value for op in P.Op]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def well_formed(op: str, body: dict) -> bytes:
    return json.dumps({"v": P.PROTOCOL_VERSION, "op": op, "body": body}).encode()


valid_requests = st.sampled_from(
    [
        well_formed("ALLOC", {"epoch": 1, "name": "w", "kind": "protected", "nbytes": PAGE}),
        well_formed("STATUS", {}),
        well_formed("LOCALIZE", {"epoch": 1}),
        well_formed("SHUTDOWN", {}),
        well_formed("INJECT_LOSS", {"target": "data", "name": "w", "pages": [0]}),
        well_formed("HELLO", {"version": 1, "token": "guess", "role": "admin", "takeover": True}),
        well_formed("WELCOME", {"epoch": 1, "server_pid": 1, "config": {}}),
    ]
)

abuse = st.one_of(
    st.binary(min_size=1, max_size=512).map(lambda b: ("raw", b)),
    st.tuples(
        st.sampled_from(OPS + ["NOPE"]),
        st.dictionaries(st.text(max_size=10), json_values, max_size=5),
    ).map(lambda t: ("json", well_formed(*t))),
    st.tuples(valid_requests, st.integers(1, 200)).map(
        lambda t: ("truncated", t[0][: max(1, len(t[0]) - t[1])])
    ),
    valid_requests.map(lambda b: ("out-of-order", b)),
    valid_requests.map(lambda b: ("with-fds", b)),
    st.just(("oversized", b"{" + b" " * (P.MAX_MESSAGE_BYTES + 100) + b"}")),
    st.sampled_from(
        [json.dumps({"v": 2, "op": "STATUS", "body": {}}).encode(), b"[]", b"{}", b"null"]
    ).map(lambda b: ("shape", b)),
)


@pytest.fixture(scope="module")
def server():
    sm = start_state_manager(small_config())
    with PoolClient.connect(sm.socket_path, sm.token) as c:  # some state to protect
        c.attach("w", 3 * PAGE).fill_(7)
    yield sm
    assert sm.stop() == 0


def snapshot(sm) -> dict:
    with PoolClient.connect(sm.socket_path, sm.token, role="observer") as c:
        s = c.status()
    return {k: s[k] for k in ("allocations", "groups", "failed_pages_total", "epoch", "owner_pid")}


@settings(max_examples=60, deadline=None)
@given(attempts=st.lists(abuse, min_size=1, max_size=4))
def test_any_abuse_gets_an_error_and_changes_nothing(server, attempts):
    before = snapshot(server)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    s.settimeout(10)
    s.connect(str(server.socket_path))
    try:
        for kind, data in attempts:
            if kind == "with-fds":
                r, w = os.pipe()
                socket.send_fds(s, [data], [r, w])
                os.close(r)
                os.close(w)
            else:
                s.sendall(data)
            reply, fds = P.recv(s)
            assert not fds
            assert isinstance(reply, P.Error), f"{kind} message {data[:80]!r} got {reply!r}"
    finally:
        s.close()
    assert server.proc.poll() is None, "the state manager died"
    assert snapshot(server) == before, "a refused message changed the state manager's state"


def test_descriptors_pushed_by_a_peer_are_not_kept(server):
    def open_fds() -> int:
        return len(os.listdir(f"/proc/{server.pid}/fd"))

    start = open_fds()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(server.socket_path))
    try:
        for _ in range(20):
            r, w = os.pipe()
            socket.send_fds(s, [well_formed("STATUS", {})], [r, w])
            os.close(r)
            os.close(w)
            assert isinstance(P.recv(s)[0], P.Error)
        # While the connection is open it holds one fd in the state manager.
        assert open_fds() <= start + 1, (
            f"state manager kept pushed descriptors ({open_fds()} open, was {start})"
        )
    finally:
        s.close()
