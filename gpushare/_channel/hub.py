"""The producer's end of a channel's connections: its listeners and each
join in progress on the service thread, and the consumers admitted."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

from .. import _auth, _control
from .._exporter.registry import advertised_addresses
from .._connection import Connection, Protocol
from .._service import get_service
from .waits import _pidfd, _peer_pid, _close_fd, _Wake
from .records import PROTOCOL, _RELEASE, _LEAVE, _HANDSHAKE_TIMEOUT, _KEEPALIVE, _Wire, _heartbeat

__all__ = []

log = logging.getLogger("gpushare.channel")

#: Joins in progress at once on one channel; a further one drops the oldest.
_MAX_HANDSHAKES = 256


class _Peer(Protocol):
    """The producer's end of one consumer's connection: its join, on the
    service thread; then its :class:`_Wire`, read by the producer's thread."""

    def __init__(self, hub: _Hub, sock: socket.socket, where: str) -> None:
        self.hub, self.where = hub, where
        self.conn: Connection | None = None
        self.wire: _Wire | None = None
        self.local = sock.family == socket.AF_UNIX
        self.index = -1
        self.pid = _peer_pid(sock) or 0
        self.pidfd: int | None = None
        self.left = False
        self.refused = False
        self._nonces: tuple[bytes, bytes] | None = None

    def name(self) -> str:
        return f"consumer {self.index} (pid {self.pid}{self.where})"

    def data_received(self, conn: Connection, fds: list[int]) -> None:
        while not self.refused and self.wire is None:
            message = _control.take_frame(conn.rbuf)
            if message is None or conn.closed:
                return
            self._join(conn, message)
        conn.rbuf.clear()  # a refused peer: nothing more is read

    def _refuse(self, conn: Connection, code: str, message: str) -> None:
        self.refused = True
        conn.send(_control.pack({"ok": False, "code": code, "message": message}))
        conn.close_when_sent()

    def _join(self, conn: Connection, msg: dict) -> None:
        """One step of the join (service thread): the consumer's hello, then its proof."""
        hub = self.hub
        if self._nonces is None:
            pid, nonce = msg.get("pid"), msg.get("nonce")
            if msg.get("op") != "join" or msg.get("channel") != hub.channel_id:
                self._refuse(conn, "bad", "expected a join of this channel")
            elif msg.get("v") != PROTOCOL:
                self._refuse(conn, "bad", f"channel protocol {msg.get('v')!r:.20}; this producer speaks "
                             f"{PROTOCOL} (run the same gpushare version on both sides)")
            elif isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 1 << 31:
                self._refuse(conn, "bad", "the join names no pid")
            elif not isinstance(nonce, bytes) or len(nonce) != _auth.NONCE_BYTES:
                self._refuse(conn, "bad", f"the join carries no {_auth.NONCE_BYTES}-byte nonce")
            else:
                self.pid = self.pid or pid
                self._nonces = (nonce, _auth.new_nonce())
                conn.send(_control.pack({"op": "join", "ok": True, "v": PROTOCOL, "nonce": self._nonces[1],
                                         "proof": _auth.proof("producer", *self._nonces, secret=hub.token)}))
            return
        if msg.get("op") != "auth" or not _auth.verify("consumer", *self._nonces, msg.get("proof"),
                                                       secret=hub.token):
            log.warning("channel %s: refused a connection%s: it does not hold the channel's token",
                        hub.channel_id[:8], self.where)
            self._refuse(conn, "denied", "the peer does not hold the channel's token")
            return
        hub.admit(self, conn)

    def apply(self, records: list[tuple[int, int, int]], busy: list[set[int]], slot_step: list[int]) -> str | None:
        """For the producer's thread: apply what this consumer sent to the
        ring (releases, its leaving); the account of a malformed record."""
        for op, slot, step in records:
            if self.left:
                break
            if op == _RELEASE and slot < len(busy) and slot_step[slot] == step:
                busy[slot].discard(self.index)
            elif op == _LEAVE:
                self.left = True
                for held in busy:
                    held.discard(self.index)
                log.info("channel %s: %s left", self.hub.channel_id[:8], self.name())
            elif op != _RELEASE:
                return f"{self.name()} sent a malformed message (op {op})"
        return None

    def deadline_passed(self, conn: Connection) -> None:
        log.warning("channel %s: dropped a connection%s that did not join within %g s", self.hub.channel_id[:8],
                    self.where, _HANDSHAKE_TIMEOUT)
        conn.close()

    def connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        self.hub.joining.pop(self, None)

    def close(self) -> None:
        if self.wire is not None:
            self.wire.close()
        _close_fd(self.pidfd)
        self.pidfd = None


class _Hub:
    """A producer's listeners and joins, served by the service thread, and
    the consumers it admitted (``peers``, under ``lock``); the rest of the
    channel's state is the producer thread's.

    Kept apart from the producer, so that neither the service thread nor the
    finalizer holds it."""

    def __init__(self, channel_id: str, token: bytes, consumers: int) -> None:
        self.channel_id, self.token, self.consumers = channel_id, token, consumers
        self.pid = os.getpid()
        self.service = get_service()
        self.lock = threading.Lock()
        self.wake = _Wake()  # written when a consumer joins
        self.peers: dict[int, _Peer] = {}  # admitted, by index
        self.joining: dict[_Peer, None] = {}  # in their join, oldest first (service thread)
        self.closing = False
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listening: list[socket.socket] = []
        try:
            self.unix.bind(f"\0gpushare-channel-{channel_id}")  # abstract: gone with the socket
            self.unix.listen(64)
            host = _control.bind_host()
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((host, 0))
            self.tcp.listen(64)
            self.addresses = advertised_addresses(self.tcp.getsockname()[1], host)
            for sock in (self.unix, self.tcp):
                self.service.listen(sock, self._accept)
                self.listening.append(sock)
        except BaseException:
            self.stop()
            raise

    def live(self) -> list[_Peer]:
        """The admitted consumers that did not leave."""
        with self.lock:
            return [p for p in self.peers.values() if not p.left]

    # -- service thread -------------------------------------------------------
    def _accept(self, sock: socket.socket) -> None:
        if self.closing:
            sock.close()
            return
        where = ""
        if sock.family == socket.AF_INET:
            _control.keepalive(sock, *_KEEPALIVE)
            with contextlib.suppress(OSError):
                where = f" at {sock.getpeername()[0]}"
        peer = _Peer(self, sock, where)
        while len(self.joining) >= _MAX_HANDSHAKES:  # the oldest join goes; a real one takes milliseconds
            oldest = next(iter(self.joining))
            self.joining.pop(oldest)
            if oldest.conn is not None:
                oldest.conn.close()
        self.joining[peer] = None
        peer.conn = self.service.connect(sock, peer, time.monotonic() + _HANDSHAKE_TIMEOUT)

    def admit(self, peer: _Peer, conn: Connection) -> None:
        """The peer proved it holds the token: give it a place, if one is
        left, and its connection to the producer's thread."""
        self.joining.pop(peer, None)
        with self.lock:
            index = len(self.peers)
            if self.closing or index >= self.consumers:
                code = "closed" if self.closing else "full"
                text = ("the channel's producer is closing the channel" if self.closing
                        else f"the channel already has its {self.consumers} consumers")
                peer._refuse(conn, code, text)
                return
            sock = conn.detach()  # from now on the producer's thread reads it
            accept = _control.pack({"ok": True, "index": index})
            try:
                sent = sock.send(accept)  # a few bytes on a connection with nothing else queued
            except OSError:
                sent = -1
            if sent != len(accept):
                sock.close()
                return
            peer.index, peer.wire = index, _Wire(sock)
            if peer.local:
                peer.pidfd = _pidfd(peer.pid)
            self.peers[index] = peer
        self.wake.set()
        _heartbeat(peer.wire)
        log.info("channel %s: %s joined", self.channel_id[:8], peer.name())

    # -- any thread --------------------------------------------------------------
    def stop(self) -> None:
        """Close the listeners, the joins and the connections (idempotent)."""
        with self.lock:
            self.closing = True  # a join still in its handshake is refused from now on
            peers = list(self.peers.values())
        if self.pid != os.getpid():
            # A forked child's copy: the service made anew here closed what it
            # inherited; only this process's descriptors are left.
            for sock in (self.unix, self.tcp):
                with contextlib.suppress(OSError):
                    sock.close()
        else:
            for sock in (self.unix, self.tcp):
                if sock in self.listening:
                    self.service.unlisten(sock)
                else:
                    sock.close()
            self.listening = []

            def drop_joins() -> None:
                for peer in list(self.joining):
                    if peer.conn is not None:
                        peer.conn.close()
                self.joining.clear()

            self.service.call_soon(drop_joins)
        for peer in peers:
            peer.close()
        self.wake.close()
