"""The state manager's socket loop: authentication, fencing, dispatch.

Runs in the state-manager process. One thread, one ``selectors`` loop; every request is
answered from the table without blocking on a peer. Peers are checked twice: the
kernel's SO_PEERCRED (same user as the state manager) and the job token in HELLO. A
trainer owns the pool under an *epoch*: a new trainer gets epoch + 1 only after the
previous owner is dead (with ``takeover`` the state manager SIGKILLs it and waits),
and every trainer request names its epoch, so a stale trainer is refused and can no
longer be alive to write through its mappings.

A bad message (malformed, oversized, truncated, out of order, unexpected descriptors)
gets an ERROR reply and changes nothing; it never stops the loop. The state manager
never opens a path named by a peer: names are table keys only.
"""

from __future__ import annotations

import errno
import hmac
import os
import select
import selectors
import signal
import socket
import stat
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from leto.memory import fdlimit
from leto.memory import protocol as P
from leto.memory.backends import owner_for
from leto.memory.backends.host import HostPageOwner
from leto.memory.config import SOCKET_NAME, AllocationKind, PoolConfig
from leto.memory.errors import (
    AllocationMismatch,
    PoolError,
    PoolFdLimit,
    PoolProtocolError,
    PoolTimeout,
)
from leto.memory.state_manager.table import Table
from leto.proc import alive

SOCKET_BUFFER_BYTES = 1 << 20


_LIFELINE = object()  # the selector's tag for the launcher's lifeline pipe


@dataclass
class Peer:
    sock: socket.socket
    pid: int
    uid: int
    role: P.Role | None = None
    epoch: int = -1


class Refused(Exception):
    def __init__(self, code: str, message: str):
        self.code, self.message = code, message
        super().__init__(message)


def check_private_dir(path: Path) -> None:
    st = path.stat()
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.geteuid()
        or stat.S_IMODE(st.st_mode) & 0o077
    ):
        raise PermissionError(
            f"{path} must be a directory owned by uid {os.geteuid()} with mode 0700 "
            f"(found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); refusing to listen there"
        )


class StateManager:
    def __init__(self, config: PoolConfig, socket_dir: Path, token: str):
        self.config = config
        self.socket_dir = Path(socket_dir)
        self.token = token
        check_private_dir(self.socket_dir)
        fdlimit.raise_limit()  # an fd per page stays open here, and replies carry more
        self.table = Table(
            config,
            owner_for(config.device, config.page_bytes),
            HostPageOwner(config.page_bytes),
            HostPageOwner(config.record_page_bytes),
        )
        self.epoch = 0
        self.owner_pid: int | None = None
        self.stopping = False
        self.sel = selectors.DefaultSelector()
        self.path = self.socket_dir / SOCKET_NAME
        if self.path.exists():
            self.path.unlink()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # the socket is created 0600: never a window of wider access
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)

    # -- loop -----------------------------------------------------------------------

    def serve(self, lifeline: int | None = None) -> None:
        """Serve until SHUTDOWN, SIGTERM, or — ``lifeline``, the read end of a pipe only
        the launcher holds open — the launcher's death (even by SIGKILL: its end closes,
        the read sees EOF), so a job killed outright leaves no state manager behind."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        if lifeline is not None:
            self.sel.register(lifeline, selectors.EVENT_READ, _LIFELINE)
        try:
            while not self.stopping:
                for key, _ in self.sel.select(timeout=0.5):
                    if key.data is None:
                        self._accept()
                    elif key.data is _LIFELINE:
                        if not os.read(lifeline, 64):  # EOF: the launcher is gone
                            print(
                                "state manager: its launcher is gone; stopping",
                                file=sys.stderr,
                                flush=True,
                            )
                            self.stopping = True
                            break
                    else:
                        self._service(key.data)
        finally:
            self.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, _gid = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
        if uid != os.geteuid():
            sock.close()  # another user: not even an error message
            return
        sock.setblocking(True)
        sock.settimeout(self.config.io_timeout_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self.sel.register(sock, selectors.EVENT_READ, Peer(sock, pid, uid))

    def _drop(self, peer: Peer) -> None:
        self.sel.unregister(peer.sock)
        peer.sock.close()

    def _service(self, peer: Peer) -> None:
        try:
            msg, fds = P.recv(peer.sock)
        except (ConnectionError, OSError, PoolError) as e:
            if isinstance(e, PoolProtocolError):
                self._reply_error(peer, "protocol", str(e))
            else:
                self._drop(peer)
            return
        if fds:  # no request carries descriptors: never keep what a peer pushed at us
            for fd in fds:
                os.close(fd)
            self._reply_error(
                peer, "protocol", f"{type(msg).__name__} must not carry file descriptors"
            )
            return
        try:
            self._dispatch(peer, msg)
        except Refused as e:
            self._reply_error(peer, e.code, e.message)
        except AllocationMismatch as e:
            self._reply_error(peer, "mismatch", str(e))
        except PoolFdLimit as e:
            self._reply_error(peer, "fd-limit", str(e))
        except PoolTimeout as e:  # a parity scan past the I/O timeout (it goes on)
            self._reply_error(peer, "timeout", str(e))
        except PoolProtocolError as e:
            self._reply_error(peer, "protocol", str(e))
        except (ConnectionError, BrokenPipeError):
            self._drop(peer)
        except Exception as e:  # a bug must not take retained memory down with it
            traceback.print_exc(file=sys.stderr)
            self._reply_error(peer, "internal", f"{type(e).__name__}: {e}")

    def _reply_error(self, peer: Peer, code: str, message: str) -> None:
        try:
            P.send(peer.sock, P.Error(code, message))
        except OSError:
            self._drop(peer)

    # -- requests -------------------------------------------------------------------

    def _dispatch(self, peer: Peer, msg: object) -> None:
        if isinstance(msg, P.Hello):
            return self._hello(peer, msg)
        if peer.role is None:
            raise Refused("order", f"{type(msg).__name__} before HELLO; say HELLO first")
        if isinstance(msg, P.Status):
            self._land(msg)  # its counts include what the scan finds
            return P.send(peer.sock, P.StatusReply(self.status()))
        if isinstance(msg, P.Shutdown):
            self._need(peer, P.Role.ADMIN)
            P.send(peer.sock, P.Ok("shutting down"))
            self.stopping = True
            return None
        if isinstance(msg, P.InjectLoss):
            self._need(peer, P.Role.FAULTKIT)
            if not self.config.allow_fault_injection:
                raise Refused("forbidden", "this pool was started without allow_fault_injection")
            self._land(msg)
            self.table.inject(msg.target, msg.name, msg.pages)
            return P.send(
                peer.sock, P.Ok(f"lost {len(msg.pages)} {msg.target} pages of {msg.name}")
            )
        if isinstance(msg, P.Premap):
            self._need(peer, P.Role.SHADOW)
            self._land(msg)
            infos, sets, cursor, fds = self.table.premap(list(msg.known))
            return self._send_closing(peer, P.Premapped(infos, sets, cursor, len(fds)), fds)
        if isinstance(msg, P.Takeover):
            self._need(peer, P.Role.SHADOW)
            self._own(peer, takeover=True)
            return P.send(peer.sock, P.Welcome(self.epoch, os.getpid(), self.config.as_dict()))
        if peer.role is P.Role.SHADOW and isinstance(msg, (P.Layout, P.Replaced)):
            # Read-only for a parked shadow: it maps what the trainer's pages are.
            self._land(msg)
            return self._read_only(peer, msg)
        trainer_requests = (
            P.Alloc, P.AllocSet, P.Layout, P.Localize, P.LocalizeParity, P.MarkRebuilt, P.Replaced,
        )  # fmt: skip
        if isinstance(msg, trainer_requests):
            self._need(peer, P.Role.TRAINER)
            if msg.epoch != self.epoch or peer.epoch != self.epoch:
                raise Refused(
                    "fenced",
                    f"epoch {msg.epoch} is stale; the pool is owned under epoch {self.epoch}",
                )
            if isinstance(msg, P.LocalizeParity):
                try:
                    self.table.settle_parity(by=P.Op.LOCALIZE_PARITY.value)
                except PoolTimeout:
                    raise
                except Exception:
                    pass  # a failed scan: kept in parity_result, refused below by name
                found, self.table.parity_result = self.table.parity_result, None
                if found is None:
                    raise Refused("order", "no deferred localization to settle; LOCALIZE first")
                if "error" in found:
                    raise Refused("scan", found["error"])
                return P.send(peer.sock, P.Localized(found))
            self._land(msg)
            if isinstance(msg, P.Alloc):
                a, created = self.table.alloc(msg.name, msg.kind, msg.nbytes)
                fds = self.table.export(a)
                reply = P.Allocated(
                    a.name, a.kind.value, a.nbytes, len(a.pages), a.owner.page_bytes, created, len(fds)
                )  # fmt: skip
                return self._send_closing(peer, reply, fds)
            if isinstance(msg, P.AllocSet):
                allocs, units, per_group, first = self.table.alloc_set(
                    msg.names, msg.nbytes, msg.unit_pages
                )
                fds = [fd for a in allocs for fd in self.table.export(a)]
                infos = [self.table.info(a) for a in allocs]
                reply = P.AllocatedSet(infos, units, per_group, first, len(fds))
                return self._send_closing(peer, reply, fds)
            if isinstance(msg, (P.Layout, P.Replaced)):
                return self._read_only(peer, msg)
            if isinstance(msg, P.Localize):
                return P.send(peer.sock, P.Localized(self.table.localize(msg.defer_parity)))
            self.table.mark_rebuilt(msg.groups)
            return P.send(peer.sock, P.Ok(f"groups {msg.groups} rebuilt"))
        raise Refused("protocol", f"{type(msg).__name__} is a reply, not a request")

    def _land(self, msg: object) -> None:
        """Land a deferred localization's parity scan before serving ``msg`` (checked
        already: a refused request waits for nothing) — unless it can neither hand out
        nor replace parity pages: REPLACED, or a LAYOUT whose groups the asker knows (a
        premapped trainer's, while it binds). HELLO, TAKEOVER and SHUTDOWN never call
        this (SHUTDOWN's close waits for the scan's threads)."""
        if not self.table.parity_scan_pending or isinstance(msg, P.Replaced):
            return
        if isinstance(msg, P.Layout) and msg.known >= len(self.table.groups):
            return
        self.table.settle_parity(by=P.OPS[type(msg)].value)  # PoolTimeout: code "timeout"

    def _read_only(self, peer: Peer, msg: P.Layout | P.Replaced) -> None:
        if isinstance(msg, P.Layout):
            groups, fds = self.table.layout(msg.known)
            return self._send_closing(peer, P.LayoutReply(groups, len(fds)), fds)
        pages, fds = self.table.replaced_since(msg.since)
        reply = P.ReplacedReply(pages, len(self.table.replaced), len(fds))
        return self._send_closing(peer, reply, fds)

    def _send_closing(self, peer: Peer, reply: object, fds: list) -> None:
        """Send, then close the fds given open (``P.send`` closes those it opens)."""
        try:
            P.send(peer.sock, reply, fds)
        finally:
            for fd in fds:
                if isinstance(fd, int):
                    os.close(fd)

    def _need(self, peer: Peer, role: P.Role) -> None:
        if peer.role is not role:
            raise Refused(
                "forbidden", f"{role.value} role required, this peer is {peer.role.value}"
            )

    def _hello(self, peer: Peer, msg: P.Hello) -> None:
        if peer.role is not None:
            raise Refused("order", "HELLO was already said on this connection")
        if msg.version != P.PROTOCOL_VERSION:
            raise Refused(
                "version",
                f"protocol {msg.version} unsupported; this state manager speaks {P.PROTOCOL_VERSION}",
            )
        if not hmac.compare_digest(msg.token.encode(), self.token.encode()):
            raise Refused("auth", "wrong job token")
        try:
            role = P.Role(msg.role)
        except ValueError:
            raise Refused("protocol", f"unknown role {msg.role!r}") from None
        if role is P.Role.TRAINER:
            self._own(peer, msg.takeover)
        peer.role = role
        P.send(peer.sock, P.Welcome(self.epoch, os.getpid(), self.config.as_dict()))

    def _own(self, peer: Peer, takeover: bool) -> None:
        """``peer`` becomes the pool's trainer under a new epoch."""
        self._fence(peer, takeover)
        self.epoch += 1
        self.owner_pid = peer.pid
        peer.epoch = self.epoch
        peer.role = P.Role.TRAINER

    def _fence(self, peer: Peer, takeover: bool) -> None:
        """Make sure no previous trainer can still write before a new one owns the pool."""
        old = self.owner_pid
        if old is None or old == peer.pid or not alive(old):
            return
        if not takeover:
            raise Refused(
                "owned",
                f"trainer PID {old} owns the pool under epoch {self.epoch}; say takeover to fence it",
            )
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + self.config.fence_timeout_s
        try:
            pidfd = os.pidfd_open(old)
        except OSError as e:
            if e.errno == errno.ESRCH:
                return
            raise
        try:
            while alive(old):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refused(
                        "fence-timeout",
                        f"trainer PID {old} did not die within {self.config.fence_timeout_s} s of SIGKILL",
                    )
                select.select([pidfd], [], [], min(left, 0.05))
        finally:
            os.close(pidfd)

    def status(self) -> dict:
        s = self.table.status()
        s.update(
            {
                "epoch": self.epoch,
                "owner_pid": self.owner_pid,
                "server_pid": os.getpid(),
                "config": self.config.as_dict(),
                "kinds": [k.value for k in AllocationKind],
            }
        )
        return s

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, Peer):
                key.data.sock.close()
        self.sel.close()
        self.listener.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self.table.close()
