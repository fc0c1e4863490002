"""Every message between a state manager and its peers: an enum plus dataclasses.

Transport: a Unix SOCK_SEQPACKET socket, so each message is one datagram with its
boundaries kept and its file descriptors (SCM_RIGHTS) attached to it. A message is
UTF-8 JSON ``{"v": PROTOCOL_VERSION, "op": <Op name>, "body": {...}}`` of at most
``MAX_MESSAGE_BYTES``; the body's keys and value types must match the op's dataclass
exactly. A reply that carries more than ``FD_BATCH`` descriptors announces ``n_fds``
and is followed by ``FDS`` messages of at most ``FD_BATCH`` each (the kernel caps one
message at 253).

Not covered: confidentiality (peers are on one host, same user, checked with
SO_PEERCRED and a job token by the state manager).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import resource
import socket
import typing
from dataclasses import dataclass

from leto.memory import fdlimit
from leto.memory.errors import PoolFdLimit, PoolProtocolError, PoolTimeout, remote_error

# 2: the shadow role (PREMAP, REPLACED, TAKEOVER); 3: FRAMES; 4: deferred parity scans
PROTOCOL_VERSION = 4
MAX_MESSAGE_BYTES = 256 * 1024  # one datagram
# A reply longer than one datagram goes out as a FRAMES header and raw frames (a 3 B-
# parameter pool's layout is ~400 KB of JSON, a 5 B one's ~700 KB). Replies only: the
# state manager reads requests of one datagram.
FRAME_BYTES = 64 * 1024
MAX_REPLY_BYTES = 64 << 20
FD_BATCH = 250
MAX_FDS_PER_MESSAGE = 253  # SCM_MAX_FD


class Op(enum.Enum):
    HELLO = "HELLO"
    WELCOME = "WELCOME"
    ALLOC = "ALLOC"
    ALLOCATED = "ALLOCATED"
    ALLOC_SET = "ALLOC_SET"
    ALLOCATED_SET = "ALLOCATED_SET"
    LAYOUT = "LAYOUT"
    LAYOUT_REPLY = "LAYOUT_REPLY"
    LOCALIZE = "LOCALIZE"
    LOCALIZED = "LOCALIZED"
    LOCALIZE_PARITY = "LOCALIZE_PARITY"
    MARK_REBUILT = "MARK_REBUILT"
    STATUS = "STATUS"
    STATUS_REPLY = "STATUS_REPLY"
    INJECT_LOSS = "INJECT_LOSS"
    PREMAP = "PREMAP"
    PREMAPPED = "PREMAPPED"
    REPLACED = "REPLACED"
    REPLACED_REPLY = "REPLACED_REPLY"
    TAKEOVER = "TAKEOVER"
    SHUTDOWN = "SHUTDOWN"
    FDS = "FDS"
    FRAMES = "FRAMES"
    OK = "OK"
    ERROR = "ERROR"


class Role(enum.Enum):
    TRAINER = "trainer"  # owns the pool under an epoch; one at a time
    OBSERVER = "observer"  # status only (leto pool status)
    # A parked shadow: maps what exists (PREMAP, LAYOUT, REPLACED), never allocates or
    # localizes; becomes the trainer with TAKEOVER on the same connection.
    SHADOW = "shadow"
    FAULTKIT = "faultkit"  # may inject page loss when the pool allows it
    ADMIN = "admin"  # the launcher: may shut the state manager down


@dataclass(frozen=True)
class Hello:
    version: int
    token: str
    role: str
    takeover: bool = False


@dataclass(frozen=True)
class Welcome:
    epoch: int
    server_pid: int
    config: dict


@dataclass(frozen=True)
class Alloc:
    epoch: int
    name: str
    kind: str
    nbytes: int


@dataclass(frozen=True)
class Allocated:
    name: str
    kind: str
    nbytes: int
    n_pages: int
    page_bytes: int
    created: bool
    n_fds: int


@dataclass(frozen=True)
class AllocSet:
    """Protected allocations placed together: unit u of the set is ``unit_pages[k]``
    pages of allocation k, for every k, and a protection group holds whole units only.
    So an element range aligned to units lies in one group for every allocation (the
    updater's chunks: parameters and their optimizer state commit together)."""

    epoch: int
    names: list
    nbytes: list
    unit_pages: list


@dataclass(frozen=True)
class AllocatedSet:
    allocations: list  # one Allocated-like dict per name, in order
    units: int
    units_per_group: int
    first_group: int
    n_fds: int  # every page of every allocation, allocation by allocation


@dataclass(frozen=True)
class Layout:
    epoch: int
    # Groups [0, known) are mapped by the asker already: their parity fds are not sent
    # again (a premapped trainer's layout at 5 B parameters: ~3,000 fds for nothing).
    known: int = 0


@dataclass(frozen=True)
class LayoutReply:
    groups: (
        list  # [{"gid", "kind", "members": [[name, page], ...], "tier1", "tier2", "page_bytes"}]
    )
    n_fds: int  # tier-1 then tier-2 page fds of every group from ``known`` on, in group order


@dataclass(frozen=True)
class Localize:
    epoch: int
    # Report the data pages now and leave the host parity scan running; LOCALIZE_PARITY
    # waits for it (a premapped trainer binds its retained state meanwhile).
    defer_parity: bool = False


@dataclass(frozen=True)
class LocalizeParity:
    """Wait for a deferred localization's parity scan; answered by LOCALIZED with the
    scan's part: parity_s, wait_s, pages_scanned and every group's pending pages."""

    epoch: int


@dataclass(frozen=True)
class Localized:
    report: dict


@dataclass(frozen=True)
class MarkRebuilt:
    epoch: int
    groups: list


@dataclass(frozen=True)
class Status:
    pass


@dataclass(frozen=True)
class StatusReply:
    status: dict


@dataclass(frozen=True)
class InjectLoss:
    target: str  # "data" (pages of an allocation) or "tier1"/"tier2" (pages of a group)
    name: str  # allocation name for "data", group id as text for parity
    pages: list


@dataclass(frozen=True)
class Premap:
    """A shadow asks for the allocations it has not mapped yet (``known``: those it has)."""

    known: list


@dataclass(frozen=True)
class Premapped:
    allocations: list  # [{"name", "kind", "nbytes", "n_pages", "page_bytes"}], new ones
    sets: list  # [{"allocations", "units", "units_per_group", "first_group"}], every set
    cursor: int  # the table's page-replacement log length when the fds were taken
    n_fds: int  # every page of every new allocation, allocation by allocation


@dataclass(frozen=True)
class Replaced:
    """Pages replaced (by localization) since log position ``since``, with their fds."""

    epoch: int
    since: int


@dataclass(frozen=True)
class ReplacedReply:
    pages: (
        list  # [{"target": "data", "name", "page"} | {"target": "tier1"/"tier2", "group", "page"}]
    )
    cursor: int
    n_fds: int  # the current page of each entry, in order


@dataclass(frozen=True)
class Takeover:
    """A shadow becomes the pool's trainer under a new epoch (a live owner is fenced)."""


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Fds:
    count: int


@dataclass(frozen=True)
class Frames:
    """The next ``count`` datagrams are raw frames of one message of ``nbytes``."""

    nbytes: int
    count: int


@dataclass(frozen=True)
class Ok:
    detail: str = ""


@dataclass(frozen=True)
class Error:
    code: str
    message: str


MESSAGES: dict[Op, type] = {
    Op.HELLO: Hello,
    Op.WELCOME: Welcome,
    Op.ALLOC: Alloc,
    Op.ALLOCATED: Allocated,
    Op.ALLOC_SET: AllocSet,
    Op.ALLOCATED_SET: AllocatedSet,
    Op.LAYOUT: Layout,
    Op.LAYOUT_REPLY: LayoutReply,
    Op.LOCALIZE: Localize,
    Op.LOCALIZED: Localized,
    Op.LOCALIZE_PARITY: LocalizeParity,
    Op.MARK_REBUILT: MarkRebuilt,
    Op.STATUS: Status,
    Op.STATUS_REPLY: StatusReply,
    Op.INJECT_LOSS: InjectLoss,
    Op.PREMAP: Premap,
    Op.PREMAPPED: Premapped,
    Op.REPLACED: Replaced,
    Op.REPLACED_REPLY: ReplacedReply,
    Op.TAKEOVER: Takeover,
    Op.SHUTDOWN: Shutdown,
    Op.FDS: Fds,
    Op.FRAMES: Frames,
    Op.OK: Ok,
    Op.ERROR: Error,
}
OPS: dict[type, Op] = {cls: op for op, cls in MESSAGES.items()}


def encode(msg: object) -> bytes:
    op = OPS[type(msg)]
    data = json.dumps(
        {"v": PROTOCOL_VERSION, "op": op.value, "body": dataclasses.asdict(msg)}
    ).encode()
    if len(data) > MAX_REPLY_BYTES:
        raise PoolProtocolError(
            f"{op.value} message of {len(data)} bytes exceeds {MAX_REPLY_BYTES}"
        )
    return data


def _type_ok(value: object, tp: object) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(tp) or tp
    return isinstance(value, origin)


def decode(data: bytes, limit: int = MAX_MESSAGE_BYTES) -> object:
    """Parse and validate one message; ``PoolProtocolError`` says what was wrong."""
    if len(data) > limit:
        raise PoolProtocolError(f"message of {len(data)} bytes exceeds {limit}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PoolProtocolError(f"message is not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict) or set(obj) != {"v", "op", "body"}:
        raise PoolProtocolError("message must be an object with exactly the keys v, op, body")
    if obj["v"] != PROTOCOL_VERSION:
        raise PoolProtocolError(f"protocol version {obj['v']!r} is not {PROTOCOL_VERSION}")
    try:
        op = Op(obj["op"])
    except (ValueError, TypeError):
        raise PoolProtocolError(f"unknown op {obj['op']!r}") from None
    cls = MESSAGES[op]
    body = obj["body"]
    if not isinstance(body, dict):
        raise PoolProtocolError(f"{op.value}: body must be an object")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(body) - set(fields)
    if unknown:
        raise PoolProtocolError(f"{op.value}: unknown fields {sorted(unknown)}")
    for name, f in fields.items():
        if name not in body:
            if f.default is dataclasses.MISSING:
                raise PoolProtocolError(f"{op.value}: missing field {name!r}")
            continue
        if not _type_ok(body[name], hints[name]):
            raise PoolProtocolError(
                f"{op.value}: field {name!r} must be {getattr(hints[name], '__name__', hints[name])}"
            )
    return cls(**body)


# -- socket I/O ---------------------------------------------------------------------


def send(sock: socket.socket, msg: object, fds: list = ()) -> None:
    """Send one message; more than FD_BATCH fds follow in FDS messages. An fd may be
    given as a zero-argument callable that opens it: it is called when its batch goes
    out and closed right after, so a reply of 40,000 pages never holds more than one
    batch open (the caller closes the plain fds it gave)."""
    data = encode(msg)
    fds = list(fds)
    if len(data) > MAX_MESSAGE_BYTES:
        # Framed: the header, the frames, then every fd in FDS batches.
        parts = [data[i : i + FRAME_BYTES] for i in range(0, len(data), FRAME_BYTES)]
        sock.sendall(encode(Frames(len(data), len(parts))))
        for part in parts:
            sock.sendall(part)
        while fds:
            batch, fds = fds[:FD_BATCH], fds[FD_BATCH:]
            _send_batch(sock, encode(Fds(len(batch))), batch)
        return
    first, rest = fds[:FD_BATCH], fds[FD_BATCH:]
    if not rest:
        if first:
            _send_batch(sock, data, first)
        else:
            sock.sendall(data)
        return
    sock.sendall(data)
    while fds:
        batch, fds = fds[:FD_BATCH], fds[FD_BATCH:]
        _send_batch(sock, encode(Fds(len(batch))), batch)


def _send_batch(sock: socket.socket, data: bytes, batch: list) -> None:
    opened = []
    try:
        for f in batch:
            if callable(f):
                opened.append(f())
        it = iter(opened)
        socket.send_fds(sock, [data], [next(it) if callable(f) else f for f in batch])
    finally:
        for fd in opened:
            _close(fd)


def recv(sock: socket.socket, frames: bool = False) -> tuple[object, list[int]]:
    """Receive one message and the fds attached to it. Raises on oversize/truncation.
    ``frames``: a reply may come framed (then its fds all follow in FDS batches)."""
    msg, fds = _recv_one(sock)
    if not isinstance(msg, Frames):
        return msg, fds
    for fd in fds:
        _close(fd)
    if not frames:
        raise PoolProtocolError("a request must be one datagram, not FRAMES")
    want = -(-msg.nbytes // FRAME_BYTES)
    if not 0 < msg.nbytes <= MAX_REPLY_BYTES or msg.count != want:
        raise PoolProtocolError(f"FRAMES of {msg.nbytes} bytes in {msg.count} frames is malformed")
    parts = []
    for _ in range(msg.count):
        try:
            part = sock.recv(FRAME_BYTES + 1)
        except TimeoutError:
            raise PoolTimeout(f"no frame from the peer within {sock.gettimeout()} s") from None
        if not part or len(part) > FRAME_BYTES:
            raise PoolProtocolError("a frame was empty, cut short or oversized")
        parts.append(part)
    data = b"".join(parts)
    if len(data) != msg.nbytes:
        raise PoolProtocolError(f"FRAMES announced {msg.nbytes} bytes, {len(data)} came")
    return decode(data, MAX_REPLY_BYTES), []


def _recv_one(sock: socket.socket) -> tuple[object, list[int]]:
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES + 1, MAX_FDS_PER_MESSAGE)
    except TimeoutError:
        raise PoolTimeout(f"no message from the peer within {sock.gettimeout()} s") from None
    if not data and not fds:
        raise ConnectionResetError("peer closed the connection")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            _close(fd)
        raise PoolProtocolError("message or its descriptors were truncated")
    try:
        return decode(data), fds
    except PoolProtocolError:
        for fd in fds:
            _close(fd)
        raise


def recv_fds(sock: socket.socket, n_fds: int, first: list[int], take=None) -> list:
    """Collect ``n_fds`` descriptors: those attached to the reply, then FDS batches.
    ``take(i, fd)``, if given, turns descriptor ``i`` into what is kept (and closes it,
    e.g. a CUDA import) as each batch arrives: a reply of any size then needs room for
    one batch only."""
    if take is not None:
        return _recv_taking(sock, n_fds, first, take)
    fds = list(first)
    if n_fds - len(fds) > fdlimit.room():
        # Refused before they arrive, and drained: the connection stays in step.
        short = n_fds - len(fds)
        for fd in fds:
            _close(fd)
        got = len(fds)
        while got < n_fds:
            msg, batch = recv(sock)
            got += len(batch)
            for fd in batch:
                _close(fd)
            if not isinstance(msg, Fds):
                break  # out of step anyway: the error below says why
        raise PoolFdLimit(
            f"a reply carries {n_fds} page descriptors and this process may open only "
            f"{fdlimit.room() + len(first)} more (open-file limit "
            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}, {short} still to come): raise "
            "`ulimit -n` (hard limit), or use larger pages (--page-bytes); nothing was mapped"
        )
    try:
        while len(fds) < n_fds:
            msg, batch = recv(sock)
            if not isinstance(msg, Fds) or msg.count != len(batch):
                for fd in batch:
                    _close(fd)
                raise PoolProtocolError(
                    f"expected an FDS batch, got {type(msg).__name__} with {len(batch)} fds"
                )
            fds.extend(batch)
    except BaseException:
        for fd in fds:
            _close(fd)
        raise
    if len(fds) != n_fds:
        for fd in fds:
            _close(fd)
        raise PoolProtocolError(f"expected {n_fds} descriptors, got {len(fds)}")
    return fds


def _recv_taking(sock: socket.socket, n_fds: int, first: list[int], take) -> list:
    kept: list = []
    batch = list(first)
    try:
        while True:
            while batch:
                kept.append(take(len(kept), batch.pop(0)))
            if len(kept) >= n_fds:
                break
            msg, batch = recv(sock)
            if not isinstance(msg, Fds) or msg.count != len(batch):
                raise PoolProtocolError(
                    f"expected an FDS batch, got {type(msg).__name__} with {len(batch)} fds"
                )
    except BaseException:
        for fd in batch:
            _close(fd)
        raise
    if len(kept) != n_fds:
        raise PoolProtocolError(f"expected {n_fds} descriptors, got {len(kept)}")
    return kept


def request(sock: socket.socket, msg: object, expect: type) -> tuple[object, list[int]]:
    """Send ``msg`` and return the reply, raising ``RemoteError`` for an ERROR reply."""
    send(sock, msg)
    reply, fds = recv(sock, frames=True)
    if isinstance(reply, Error):
        for fd in fds:
            _close(fd)
        raise remote_error(reply.code, reply.message)
    if not isinstance(reply, expect):
        for fd in fds:
            _close(fd)
        raise PoolProtocolError(f"expected {expect.__name__}, got {type(reply).__name__}")
    return reply, fds


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
