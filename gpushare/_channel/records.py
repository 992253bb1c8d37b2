"""What channels say and wait on: the handle, the records, the join, the waits.

A channel's producer listens on a Unix socket (on its node) and a TCP port
(from other nodes); both are served by the process's one service thread
(:mod:`gpushare._service`), which admits consumers: no thread of the
channel's own, none per consumer.  A join is a mutual challenge
(:mod:`gpushare._auth`, the channel's token as the key) in control frames
(:mod:`gpushare._control`); it must be done within
:data:`_HANDSHAKE_TIMEOUT` seconds in all, however the peer paces its bytes,
or the connection is dropped.

After the join the connection (one per consumer) carries 16-byte records,
``!IIQ`` (operation, slot, step), read and written by the channel's own
threads: a wait polls it, so a record wakes the waiting thread directly.
The service thread of each end adds a heartbeat record every ``QUIET / 2``
seconds (:func:`_heartbeat`), whatever the other threads do; a wait that hears nothing from its
peer for :func:`peer_timeout` seconds gives up on it as stopped, frozen or
cut off.  The join and the heartbeats are this release's: both ends must
run it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

from .._errors import InvalidInputError
from .._process import QUIET, node_key, peer_timeout, state_of
from .._service import get_service

__all__ = ["PROTOCOL"]


#: The join both ends speak (a join names it).
PROTOCOL = 2
_MSG = struct.Struct("!IIQ")  # op, slot, step
_PUBLISH, _END, _ABORT, _RELEASE, _LEAVE, _FAILED, _ALIVE = range(1, 8)
#: Seconds a connection has for the whole join, from connecting to being admitted.
_HANDSHAKE_TIMEOUT = 5.0
#: Bytes of records a peer may leave unread before it counts as gone.
_MAX_BACKLOG = 1 << 20
#: TCP keepalive of a channel connection: a vanished node is noticed within seconds.
_KEEPALIVE = (3, 1, 3, 8000)


def _record(op: int, slot: int = 0, step: int = 0) -> bytes:
    return _MSG.pack(op, slot, step)


_BEAT = _MSG.pack(_ALIVE, 0, 0)


def _read(sock: socket.socket) -> tuple[bytes, str | None]:
    """What arrived on a non-blocking socket, and why it ended (None: it did not)."""
    chunks = []
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return b"".join(chunks), None
        except OSError as exc:
            return b"".join(chunks), f"broke its connection ({exc})"
        if not data:
            return b"".join(chunks), "exited or closed its end"
        chunks.append(data)
        if len(data) < 1 << 16:
            return b"".join(chunks), None


class _Wire:
    """One end of a joined channel connection.

    The channel's own threads read it (a wait polls it, so a record wakes
    the waiting thread directly) and write it; the service thread adds a
    heartbeat every ``QUIET / 2`` seconds, whatever those threads are doing,
    which is how the other end tells a busy process from a frozen one.
    Writes never block: what the socket does not take now is sent with the
    next record or heartbeat."""

    __slots__ = ("buf", "closed", "heard", "lock", "pending", "sock")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.lock = threading.Lock()
        self.pending = b""
        self.buf = b""
        self.heard = time.monotonic()
        self.closed = False

    def send(self, message: bytes, *, beat: bool = False) -> bool:
        """Send ``message`` (a heartbeat goes only where nothing waits to be
        sent); False when the connection is gone or the peer left
        ``_MAX_BACKLOG`` bytes unread."""
        with self.lock:
            if self.closed:
                return False
            data = self.pending + (b"" if beat and self.pending else message)
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                return False
            if beat and not self.pending and sent == 0:
                return True  # the peer reads nothing now: the heartbeat is dropped whole
            self.pending = data[sent:]
            return len(self.pending) <= _MAX_BACKLOG

    def read(self) -> tuple[list[tuple[int, int, int]], str | None]:
        """The records that arrived (never blocks; heartbeats only count as
        heard), and why the connection ended (None: it did not)."""
        data, eof = _read(self.sock)
        if data:
            self.heard = time.monotonic()
            self.buf += data
        end = len(self.buf) - len(self.buf) % _MSG.size
        records = [_MSG.unpack_from(self.buf, offset) for offset in range(0, end, _MSG.size)]
        self.buf = self.buf[end:]
        return [r for r in records if r[0] != _ALIVE], eof

    def frozen(self, now: float, who: str, pid: int, local: bool) -> str | None:
        """Why the peer counts as frozen now (None: it does not): nothing, not
        even a heartbeat, came from it for ``GPUSHARE_PEER_TIMEOUT`` seconds."""
        silent = now - self.heard
        if silent < peer_timeout():
            return None
        state = state_of(pid, node_key()) if local else ""
        return (f"{who} has not answered for {silent:.1f} s{state}: it is stopped, frozen or cut off "
                "(GPUSHARE_PEER_TIMEOUT sets how long to wait for it)")

    def close(self) -> None:
        with self.lock:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()


def _heartbeat(wire: _Wire) -> None:
    """Send ``wire``'s heartbeat now and again until it closes: every
    ``QUIET / 2`` seconds, or a third of a shorter ``GPUSHARE_PEER_TIMEOUT``."""
    if wire.send(_BEAT, beat=True):
        try:
            every = min(QUIET / 2, peer_timeout() / 3)
        except InvalidInputError:
            every = QUIET / 2  # the waiting side reports the bad setting
        get_service().call_later(every, lambda: _heartbeat(wire))
