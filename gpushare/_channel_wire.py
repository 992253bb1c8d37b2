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

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
import re
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

from . import _auth, _control
from ._arrays import check_shape, nbytes_of, portable_typestr
from ._errors import AccessDeniedError, ChannelBrokenError, InvalidInputError
from ._exporter import advertised_addresses
from ._paths.broker import peer_credentials
from ._process import QUIET, node_key, peer_timeout, state_of
from ._service import Connection, Protocol, get_service
from ._share import Share, strict_json
from ._types import in_range

__all__ = ["ChannelHandle", "HANDLE_FORMAT", "MAX_CONSUMERS", "MAX_SLOTS"]

log = logging.getLogger("gpushare.channel")

HANDLE_FORMAT = 1
_WIRE_TAG = "gpushare.channel"
_MAX_HANDLE_BYTES = 1 << 20
MAX_CONSUMERS = 1024
MAX_SLOTS = 64
#: The join both ends speak (a join names it).
PROTOCOL = 2
_MSG = struct.Struct("!IIQ")  # op, slot, step
_PUBLISH, _END, _ABORT, _RELEASE, _LEAVE, _FAILED, _ALIVE = range(1, 8)
#: Seconds a connection has for the whole join, from connecting to being admitted.
_HANDSHAKE_TIMEOUT = 5.0
#: Joins in progress at once on one channel; a further one drops the oldest.
_MAX_HANDSHAKES = 256
#: Bytes of records a peer may leave unread before it counts as gone.
_MAX_BACKLOG = 1 << 20
#: TCP keepalive of a channel connection: a vanished node is noticed within seconds.
_KEEPALIVE = (3, 1, 3, 8000)
_ID = re.compile(r"^[0-9a-f]{32}\Z")


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of a Unix-socket peer, as the kernel saw it connect."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        pid = peer_credentials(sock)[0]
    except OSError:
        return None
    return pid if pid > 0 else None


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Wake:
    """An eventfd the service thread writes to wake a waiting thread; closed
    under its lock, so a late write never lands on a reused descriptor."""

    __slots__ = ("fd", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        with self.lock:
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_read(self.fd)

    def close(self) -> None:
        with self.lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            _close_fd(fd)


def _until(deadline: float | None) -> float:
    """When a wait wakes next: at its deadline, or sooner to see whether its
    peer is still heard from."""
    tick = time.monotonic() + QUIET / 2
    return tick if deadline is None else min(deadline, tick)


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _wait_readable(fds: list[int], deadline: float | None) -> frozenset[int]:
    """Block in the kernel until some of ``fds`` are readable; returns them
    (none at the deadline)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    if deadline is None:
        return frozenset(fd for fd, _ in poller.poll())
    left = deadline - time.monotonic()
    if left <= 0:
        return frozenset()
    return frozenset(fd for fd, _ in poller.poll(max(1, math.ceil(left * 1000))))


def _exited(pidfd: int, within: float = 0.0) -> bool:
    """Whether the process behind ``pidfd`` exited (a pidfd is readable then), waiting up to
    ``within`` seconds for it."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(int(within * 1000)))


#: How long a broken connection waits for its process's exit to show: a process that exits
#: closes its sockets (a reset, where records to it were unread) before its pidfd turns readable.
EXIT_SHOWS = 0.2


def _why_gone(eof: str, pidfd: int | None) -> str:
    """``eof`` (why a connection ended), or "exited" where its process has exited: a reset then
    says less than the exit."""
    if pidfd is not None and eof.startswith("broke") and _exited(pidfd, EXIT_SHOWS):
        return "exited"
    return eof


async def _wait_readable_async(fds: list[int], deadline: float | None) -> frozenset[int]:
    """:func:`_wait_readable` for asyncio: the loop watches the fds, no thread."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    woken: set[int] = set()

    def wake(fd: int) -> None:
        woken.add(fd)
        if not ready.done():
            ready.set_result(None)

    for fd in fds:
        loop.add_reader(fd, wake, fd)
    try:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return frozenset()
        try:
            await asyncio.wait_for(ready, left)
        except TimeoutError:
            pass
        return frozenset(woken)
    finally:
        for fd in fds:
            loop.remove_reader(fd)


def _run(waits: Any) -> Any:
    """Drive a wait loop (a generator that yields (fds, deadline) when it
    must wait and is sent the fds that became readable), blocking in poll."""
    try:
        fds, deadline = next(waits)
        while True:
            fds, deadline = waits.send(_wait_readable(fds, deadline))
    except StopIteration as done:
        return done.value


async def _run_async(waits: Any) -> Any:
    """:func:`_run` for asyncio: the event loop watches the fds."""
    try:
        fds, deadline = next(waits)
        while True:
            fds, deadline = waits.send(await _wait_readable_async(fds, deadline))
    except StopIteration as done:
        return done.value


# ---------------------------------------------------------------- the handle


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    return in_range(value, what, lo, hi, owner="channel")


class ChannelHandle:
    """What a consumer needs to join a channel, as plain data: pass it to the
    consumer processes (pickle, :mod:`multiprocessing` arguments in every
    start method, or :meth:`to_bytes` over any transport).

    Made by :attr:`Producer.handle`.  Like a share, it is a capability:
    whoever holds it can join the channel and read its slots.  A handle
    received from another process is validated field by field, on
    unpickling and in :meth:`from_bytes`.

    Attributes
    ----------
    channel_id : str
        32 hex digits naming the channel.
    shape : tuple of int
        Shape of the array in every slot.
    typestr : str
        Its ``__array_interface__`` type string.
    consumers : int
        How many consumers the producer waits for.
    slots : int
        Size of the ring.
    device : "host" or int
        Where the slots live in the producer.
    producer_pid : int
        The producing process.
    """

    __slots__ = ("_fields_",)
    _NAMES = ("version", "channel_id", "token", "producer_pid", "node", "unix", "tcp", "shape", "typestr",
              "consumers", "slots", "device", "shares")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("ChannelHandle objects are made by gpushare.channel (Producer.handle)")

    @classmethod
    def _make(cls, *fields: Any) -> ChannelHandle:
        """The validating constructor; every field is untrusted."""
        if len(fields) != len(cls._NAMES):
            raise InvalidInputError(f"channel handle has {len(fields)} fields; expected {len(cls._NAMES)}")
        (version, channel_id, token, pid, node, unix, tcp, shape, typestr, consumers, slots, device,
         shares) = fields
        if isinstance(version, bool) or version != HANDLE_FORMAT:
            raise InvalidInputError(f"channel handle format {version!r:.20}; this gpushare reads {HANDLE_FORMAT}")
        if not isinstance(channel_id, str) or not _ID.match(channel_id):
            raise InvalidInputError("channel id must be 32 lowercase hex digits")
        if not isinstance(token, bytes) or len(token) != 32:
            got = len(token) if isinstance(token, bytes) else type(token).__name__
            raise InvalidInputError(f"channel token is {got} bytes; expected 32")
        _int(pid, "producer_pid", 1, (1 << 31) - 1)
        if not isinstance(node, str) or not 0 < len(node) <= 512:
            raise InvalidInputError("channel node must be a non-empty str of at most 512 characters")
        if unix != f"gpushare-channel-{channel_id}":
            raise InvalidInputError(f"channel socket name {unix!r:.60} does not match the channel id")
        if not isinstance(tcp, tuple) or not 1 <= len(tcp) <= 16:
            raise InvalidInputError("channel tcp must be a tuple of 1 to 16 (host, port) pairs")
        for entry in tcp:
            if not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str):
                raise InvalidInputError("channel tcp entries must be (host, port) pairs")
            try:
                ipaddress.IPv4Address(entry[0])
            except ValueError:
                raise InvalidInputError(f"channel tcp host {entry[0]!r:.60} is not an IPv4 address") from None
            _int(entry[1], "tcp port", 1, 65535)
        if not isinstance(shape, tuple):
            raise InvalidInputError("channel shape must be a tuple of ints")
        check_shape(shape, "channel shape")
        if any(not isinstance(d, int) or isinstance(d, bool) for d in shape):
            raise InvalidInputError("channel shape must be a tuple of ints")
        if not isinstance(typestr, str):
            raise InvalidInputError("channel typestr must be a str")
        portable_typestr(typestr)
        nbytes = nbytes_of(shape, typestr)
        if nbytes < 1:
            raise InvalidInputError(f"channel shape {shape} of {typestr} holds no bytes")
        _int(consumers, "consumers", 1, MAX_CONSUMERS)
        _int(slots, "slots", 1, MAX_SLOTS)
        if device != "host":
            _int(device, "device", 0, 1 << 16)
        if not isinstance(shares, tuple) or len(shares) != slots:
            raise InvalidInputError(f"channel has {slots} slots but its handle names "
                                    f"{len(shares) if isinstance(shares, tuple) else 'no tuple of'} shares")
        for i, share in enumerate(shares):
            if not isinstance(share, Share):
                raise InvalidInputError(f"channel slot {i} is a {type(share).__name__}, not a gpushare.Share")
            if share.nbytes < nbytes:
                raise InvalidInputError(f"channel slot {i} is {share.nbytes} bytes; a step needs {nbytes}")
            if (share.device == "host") != (device == "host"):
                raise InvalidInputError(f"channel slot {i} is on {share.device}; the channel says {device}")
        self = object.__new__(cls)
        object.__setattr__(self, "_fields_", tuple(fields))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ChannelHandle is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_handle, self._fields_)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChannelHandle) and other._fields_ == self._fields_

    def __hash__(self) -> int:
        return hash(self._fields_)

    def _field(self, name: str) -> Any:
        return self._fields_[self._NAMES.index(name)]

    channel_id = property(lambda self: self._field("channel_id"))
    shape = property(lambda self: self._field("shape"))
    typestr = property(lambda self: self._field("typestr"))
    consumers = property(lambda self: self._field("consumers"))
    slots = property(lambda self: self._field("slots"))
    device = property(lambda self: self._field("device"))
    producer_pid = property(lambda self: self._field("producer_pid"))

    @property
    def nbytes(self) -> int:
        """Bytes in one step."""
        return nbytes_of(self.shape, self.typestr)

    def to_bytes(self) -> bytes:
        """The handle as bytes (compact ASCII JSON, slots as :meth:`Share.to_bytes`).

        Returns
        -------
        bytes
            At most 1 MiB; read back with :meth:`from_bytes`.
        """
        f = dict(zip(self._NAMES, self._fields_, strict=True))
        f["token"] = f["token"].hex()
        f["tcp"] = [list(a) for a in f["tcp"]]
        f["shape"] = list(f["shape"])
        f["shares"] = [s.to_bytes().decode("ascii") for s in f["shares"]]
        f["format"] = _WIRE_TAG
        return json.dumps(f, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ChannelHandle:
        """Rebuild a handle from :meth:`to_bytes`; safe on bytes from an untrusted peer.

        Parameters
        ----------
        data : bytes-like
            At most 1 MiB.

        Returns
        -------
        ChannelHandle

        Raises
        ------
        InvalidInputError
            Anything but a well-formed handle of a format this gpushare reads.
        """
        obj = strict_json(data, _MAX_HANDLE_BYTES, "ChannelHandle.from_bytes", "channel handle")
        if not isinstance(obj, dict) or obj.get("format") != _WIRE_TAG or set(obj) - {"format"} != set(cls._NAMES):
            raise InvalidInputError("channel handle bytes do not hold the fields of a channel handle")
        token, shares = obj["token"], obj["shares"]
        if not isinstance(token, str) or not re.match(r"^[0-9a-f]{64}\Z", token):
            raise InvalidInputError("channel token must be 64 lowercase hex digits")
        if not isinstance(shares, list) or not all(isinstance(s, str) for s in shares):
            raise InvalidInputError("channel shares must be a list of Share.to_bytes strings")
        obj["token"] = bytes.fromhex(token)
        obj["shares"] = tuple(Share.from_bytes(s.encode("ascii")) for s in shares)
        for name in ("shape",):
            if isinstance(obj[name], list):
                obj[name] = tuple(obj[name])
        if isinstance(obj["tcp"], list):
            obj["tcp"] = tuple(tuple(a) if isinstance(a, list) else a for a in obj["tcp"])
        return cls._make(*(obj[name] for name in cls._NAMES))

    def __repr__(self) -> str:
        return (f"<gpushare.ChannelHandle {self.channel_id[:8]} {self.slots} slots of {self.shape} "
                f"{self.typestr} on {self.device}, {self.consumers} consumers, producer pid {self.producer_pid}>")


def _rebuild_handle(*fields: Any) -> ChannelHandle:
    return ChannelHandle._make(*fields)


# Pickles name it where it was first defined (``gpushare._channel``, which
# imports it), so that they read the same in this and in older versions.
_rebuild_handle.__module__ = "gpushare._channel"


# ---------------------------------------------------------------- records


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


# ---------------------------------------------------------------- the producer's end


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


# ---------------------------------------------------------------- the consumer's end


class _Inbox:
    """What a consumer's producer told it: the steps published and not yet
    taken, the end, or why the channel broke."""

    __slots__ = ("broken", "end", "queue", "slots", "who")

    def __init__(self, handle: ChannelHandle) -> None:
        self.slots, self.who = handle.slots, f"the channel's producer (pid {handle.producer_pid})"
        self.queue: deque[tuple[int, int]] = deque()  # (step, slot)
        self.end: int | None = None
        self.broken: str | None = None

    def gone(self, detail: str) -> None:
        self.broken = f"{self.who} {detail} without closing the channel"

    def check_alive(self, wire: _Wire, pid: int, local: bool) -> bool:
        """For a waiting consumer: whether the producer, not done, stopped answering (then broken)."""
        if self.end is None and self.broken is None:
            self.broken = wire.frozen(time.monotonic(), self.who, pid, local)
        return self.broken is not None

    def pump(self, wire: _Wire, woken: frozenset[int], pidfd: int | None) -> None:
        """Take in every record that arrived; never blocks.  ``woken``: the
        fds a wait found readable (``pidfd`` there: the producer exited)."""
        if self.broken is not None:
            return
        eof = self._parse(*wire.read())
        if eof is None and self.end is None and pidfd in woken and _exited(pidfd):
            # The producer exited: what it sent before is still to be read.
            eof = self._parse(*wire.read()) or "exited"
        if eof is not None and self.end is None and self.broken is None:
            self.gone(_why_gone(eof, pidfd))

    def _parse(self, records: list[tuple[int, int, int]], eof: str | None) -> str | None:
        for op, slot, step in records:
            if self.broken is not None:
                break
            if op == _PUBLISH and slot < self.slots:
                self.queue.append((step, slot))
            elif op == _END:
                self.end = step
            elif op == _FAILED:
                self.broken = f"{self.who} gave up on an error after {step} steps"
            elif op == _ABORT:
                self.broken = (f"consumer {slot} of the channel died or closed its connection without leaving; "
                               "the producer stopped the channel")
            else:
                self.broken = f"the producer sent a malformed message (op {op})"
        return eof


def _connect(handle: ChannelHandle, timeout: float) -> socket.socket:
    pid = handle.producer_pid
    errors = []
    if handle._field("node") == node_key():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(f"\0{handle._field('unix')}")
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"unix socket: {exc}")
        addresses = [a for a in handle._field("tcp") if a[0] == "127.0.0.1"]
    else:
        addresses = [a for a in handle._field("tcp") if not a[0].startswith("127.")]
    for host, port in addresses:
        try:
            return socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc}")
    raise ChannelBrokenError(f"cannot reach the channel's producer (pid {pid}): {'; '.join(errors) or 'no address'}; "
                             "it may have exited or closed the channel")




def _handshake(sock: socket.socket, handle: ChannelHandle, timeout: float = _HANDSHAKE_TIMEOUT) -> int:
    """Join the channel on a new connection (blocking, ``timeout`` seconds in
    all): prove, each to the other, that both hold the token; the consumer's
    index."""
    deadline = time.monotonic() + timeout
    token, pid = handle._field("token"), handle.producer_pid
    mine = _auth.new_nonce()

    def recv() -> dict:
        try:
            return _control.recv(sock, max(0.01, deadline - time.monotonic()))
        except EOFError:
            raise AccessDeniedError(f"the channel's producer (pid {pid}) refused the connection: the handle is "
                                    "not valid for it, or it runs another gpushare version") from None

    _control.send(sock, {"op": "join", "v": PROTOCOL, "channel": handle.channel_id, "pid": os.getpid(),
                         "nonce": mine})
    reply = recv()
    if reply.get("ok") is not True:
        raise AccessDeniedError(f"the channel's producer (pid {pid}) refused the join: "
                                f"{str(reply.get('message'))[:200]}")
    theirs = reply.get("nonce")
    if not isinstance(theirs, bytes) or len(theirs) != _auth.NONCE_BYTES or not _auth.verify(
            "producer", mine, theirs, reply.get("proof"), secret=token):
        raise AccessDeniedError("the channel's producer did not prove it holds the channel's token")
    _control.send(sock, {"op": "auth", "proof": _auth.proof("consumer", mine, theirs, secret=token)})
    answer = recv()
    code, index = answer.get("code"), answer.get("index")
    if code == "full":
        raise AccessDeniedError(f"the channel already has its {handle.consumers} consumers")
    if code == "closed":
        raise ChannelBrokenError("the channel's producer is closing the channel")
    if answer.get("ok") is not True:
        raise AccessDeniedError(f"the channel's producer (pid {pid}) refused the join: "
                                f"{str(answer.get('message'))[:200]}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < handle.consumers:
        raise InvalidInputError(f"the producer answered consumer index {index!r:.20}")
    return index


def _join(handle: ChannelHandle, timeout: float) -> tuple[_Wire, int, int | None]:
    """Connect and join: this consumer's end of the connection (its
    heartbeat started), its index, and a pidfd of the producer (on its node)."""
    sock = _connect(handle, timeout)
    try:
        _control.keepalive(sock, *_KEEPALIVE)
        try:
            index = _handshake(sock, handle, timeout)
        except OSError as exc:
            raise AccessDeniedError(f"the channel's producer (pid {handle.producer_pid}) refused the "
                                    f"connection: the handle is not valid for it ({exc})") from None
        peer = _peer_pid(sock)
    except BaseException:
        sock.close()
        raise
    wire = _Wire(sock)
    _heartbeat(wire)
    return wire, index, _pidfd(peer) if peer is not None else None
