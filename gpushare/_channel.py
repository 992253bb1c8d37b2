"""Channels: a ring of shared slots with publish/wait, for step loops.

One producer, a fixed number of consumers.  The producer fills a slot and
publishes step ``t``; every consumer waits for step ``t``, reads the slot
(zero-copy where its path maps the memory) and releases it; the producer
reuses a slot only once every consumer released the step in it.

Slots are gpushare shares (host memory from :func:`gpushare.allocate`, or
CUDA memory), opened by each consumer through :func:`gpushare.open`.
Notifications go over one connection per consumer: a Unix socket on the
same node, TCP across nodes.  Waiting is waiting on the kernel (``poll`` or
the asyncio loop's reader) on that connection and, on one node, on a pidfd
of the peer, so a process that dies wakes its peers at once.

Wire format of a notification: 16 bytes, ``!IIQ`` (operation, slot, step).
The handshake is a mutual HMAC-SHA256 challenge on the channel's token, so
nothing from a peer that does not hold the handle reaches the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import select
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ._arrays import CudaArray, check_shape, nbytes_of, portable_typestr
from ._errors import (
    AccessDeniedError,
    ChannelBrokenError,
    ClosedError,
    GpuShareError,
    InvalidInputError,
    UnsupportedError,
    WaitTimeoutError,
)
from ._share import Share, node_key, strict_json

__all__ = ["ChannelHandle", "Producer", "Consumer", "Step", "channel", "subscribe"]

log = logging.getLogger("gpushare.channel")

HANDLE_FORMAT = 1
_WIRE_TAG = "gpushare.channel"
_MAX_HANDLE_BYTES = 1 << 20
MAX_CONSUMERS = 1024
MAX_SLOTS = 64
_MAGIC = b"GSCHAN01"
_HELLO = struct.Struct("!8s16s32sI")  # magic, channel id, consumer nonce, pid
_MSG = struct.Struct("!IIQ")  # op, slot, step
_ACCEPT = struct.Struct("!IIQ")  # status, consumer index, reserved
_PUBLISH, _END, _ABORT, _RELEASE, _LEAVE, _FAILED = 1, 2, 3, 4, 5, 6
_OK, _FULL, _CLOSED = 0, 1, 2
_HANDSHAKE_TIMEOUT = 5.0
_MAX_HANDSHAKES = 64
_ID = re.compile(r"^[0-9a-f]{32}\Z")


def _mac(token: bytes, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(token, role + b"".join(nonces), hashlib.sha256).digest()


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of a Unix-socket peer, as the kernel saw it connect."""
    from ._paths.broker import peer_credentials

    if sock.family != socket.AF_UNIX:
        return None
    try:
        pid = peer_credentials(sock)[0]
    except OSError:
        return None
    return pid if pid > 0 else None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the peer closed the connection")
        data += chunk
    return data


def _keepalive(sock: socket.socket) -> None:
    """A peer on a node that vanished (power, partition) is noticed within seconds."""
    if sock.family != socket.AF_INET:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 3), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 8000)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


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


def _deadline(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0 or math.isnan(timeout):
        raise InvalidInputError(f"timeout must be a non-negative number of seconds or None, not {timeout!r}")
    return time.monotonic() + timeout


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


def _exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` exited (a pidfd is readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


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
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"channel {what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidInputError(f"channel {what} is {value}; expected {lo} <= {what} <= {hi}")
    return value


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


# ---------------------------------------------------------------- producer


class _Peer:
    """The producer's view of one consumer."""

    __slots__ = ("buf", "index", "left", "pid", "pidfd", "sock", "where")

    def __init__(self, sock: socket.socket, index: int, pid: int, where: str) -> None:
        self.sock, self.index, self.where = sock, index, where
        self.pid = _peer_pid(sock) or pid
        self.pidfd = _pidfd(self.pid) if sock.family == socket.AF_UNIX else None
        self.buf = b""
        self.left = False

    def name(self) -> str:
        return f"consumer {self.index} (pid {self.pid}{self.where})"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


class _Service:
    """The producer's listeners and the thread that admits consumers.

    Kept apart from :class:`Producer` so that the thread and the finalizer
    never hold the producer itself."""

    def __init__(self, channel_id: str, token: bytes, consumers: int) -> None:
        self.channel_id, self.token, self.consumers = channel_id, token, consumers
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.joined: deque[_Peer] = deque()
        self.admitted = 0
        self.closing = False
        self.handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        self.wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.stop_r, self.stop_w = os.pipe()
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.unix.bind(f"\0gpushare-channel-{channel_id}")  # abstract: gone with the socket
            self.unix.listen(64)
            bind_host = os.environ.get("GPUSHARE_CONTROL_HOST", "0.0.0.0")
            try:
                ipaddress.IPv4Address(bind_host)
            except ValueError:
                raise InvalidInputError(f"GPUSHARE_CONTROL_HOST is {bind_host!r}; expected an IPv4 address") from None
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((bind_host, 0))
            self.tcp.listen(64)
            from ._exporter import advertised_addresses

            self.addresses = advertised_addresses(self.tcp.getsockname()[1], bind_host)
        except BaseException:
            self.close_fds()
            raise
        self.thread = threading.Thread(target=self._run, name="gpushare-channel", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = select.poll()
        for fd in (self.unix.fileno(), self.tcp.fileno(), self.stop_r):
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self.stop_r:
                    return
                listener = self.unix if fd == self.unix.fileno() else self.tcp
                try:
                    conn, addr = listener.accept()
                except OSError:
                    continue
                # Each handshake in a thread of its own: a peer that connects
                # and says nothing delays nobody else's join.
                if not self.handshakes.acquire(blocking=False):
                    conn.close()  # too many joins at once: refused
                    continue
                threading.Thread(target=self._admit_or_drop, args=(conn, addr), name="gpushare-channel-join",
                                 daemon=True).start()

    def _admit_or_drop(self, conn: socket.socket, addr: Any) -> None:
        try:
            self._admit(conn, addr)
        except (OSError, EOFError, ValueError) as exc:
            log.warning("channel %s: refused a connection: %s", self.channel_id[:8], exc)
            conn.close()
        finally:
            self.handshakes.release()

    def _admit(self, conn: socket.socket, addr: Any) -> None:
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        _keepalive(conn)
        magic, channel_id, nonce_c, pid = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
        if magic != _MAGIC or channel_id != bytes.fromhex(self.channel_id):
            raise ValueError("not a hello for this channel")
        nonce_p = secrets.token_bytes(32)
        conn.sendall(nonce_p + _mac(self.token, b"producer", nonce_c, nonce_p))
        if not hmac.compare_digest(_recv_exact(conn, 32), _mac(self.token, b"consumer", nonce_p, nonce_c)):
            raise ValueError("the peer does not hold the channel's token")
        with self.lock:
            if self.closing:
                status = _CLOSED
            elif self.admitted >= self.consumers:
                status = _FULL
            else:
                status, index = _OK, self.admitted
                self.admitted += 1
        if status != _OK:
            conn.sendall(_ACCEPT.pack(status, 0, 0))
            conn.close()
            return
        conn.sendall(_ACCEPT.pack(_OK, index, 0))  # before any notification can follow it
        conn.setblocking(False)
        where = "" if conn.family == socket.AF_UNIX else f" at {addr[0]}"
        peer = _Peer(conn, index, pid, where)
        with self.lock:
            if self.closing:
                peer.close()
                return
            self.joined.append(peer)
            os.eventfd_write(self.wake, 1)
        log.info("channel %s: %s joined", self.channel_id[:8], peer.name())

    def take_joined(self) -> list[_Peer]:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.wake)
        with self.lock:
            peers = list(self.joined)
            self.joined.clear()
        return peers

    def stop(self) -> None:
        if self.pid != os.getpid():
            # A forked child's copy: the thread and the listeners are the
            # parent's; close this process's descriptors and nothing more.
            self.close_fds()
            return
        with self.lock:
            self.closing = True  # a join still in its handshake is refused from now on
        with contextlib.suppress(OSError):
            os.write(self.stop_w, b"x")
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(_HANDSHAKE_TIMEOUT + 1)
        for peer in self.take_joined():
            peer.close()
        self.close_fds()

    def close_fds(self) -> None:
        for s in (self.unix, self.tcp):
            with contextlib.suppress(OSError):
                s.close()
        for fd in (self.wake, self.stop_r, self.stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _release_producer(service: _Service, peers: dict, shares: list, buffers: list) -> None:
    """Everything a producer holds, released once (also by its finalizer)."""
    service.stop()
    for peer in list(peers.values()):
        peer.close()
    peers.clear()
    if service.pid != os.getpid():
        shares.clear()  # the parent's exports and memory: not this process's to end
        buffers.clear()
        return
    for share in shares:
        with contextlib.suppress(GpuShareError):
            share.revoke()
    shares.clear()
    for buf in buffers:
        close = getattr(buf, "close", None)
        if close is not None:
            with contextlib.suppress(BufferError, GpuShareError):
                close()
    buffers.clear()


def channel(shape: Any, dtype: Any = "u1", *, consumers: int, slots: int = 2,
            device: Any = "host") -> Producer:
    """Make a channel for a step loop; this process is its producer.

    Parameters
    ----------
    shape : int or tuple of int
        Shape of the array each step carries.
    dtype : numpy dtype, default ``"u1"``
        Its element type: bool, integer, floating-point or complex.
    consumers : int
        How many consumers join (with :func:`gpushare.subscribe`).  The
        first :meth:`Producer.acquire` waits until all of them have, so no
        step is published before every consumer can see it.
    slots : int, default 2
        Slots in the ring: how many steps can be in flight (filled by the
        producer and not yet released by every consumer).  2 is a double
        buffer.
    device : "host" or int, default "host"
        Host memory (from :func:`gpushare.allocate`, mapped by consumers on
        this node), or a CUDA device ordinal.

    Returns
    -------
    Producer
        Pass :attr:`Producer.handle` to the consumers.

    Raises
    ------
    InvalidInputError
        A shape, dtype, count or device out of range.

    Examples
    --------
    >>> import numpy as np, gpushare as gs
    >>> with gs.channel((4,), np.float32, consumers=1) as producer:
    ...     with gs.subscribe(producer.handle) as consumer:
    ...         producer.send(np.arange(4, dtype=np.float32))
    ...         with consumer.wait(timeout=10) as step:
    ...             print(step.step, step.array)
    0 [0. 1. 2. 3.]
    """
    from . import _types

    shape = check_shape(shape)
    typestr = portable_typestr(dtype)
    nbytes = nbytes_of(shape, typestr)
    if nbytes < 1:
        raise InvalidInputError(f"a step of shape {shape} holds no bytes; a channel carries at least one")
    if isinstance(consumers, bool) or not isinstance(consumers, int) or not 1 <= consumers <= MAX_CONSUMERS:
        raise InvalidInputError(f"consumers must be an int from 1 to {MAX_CONSUMERS}, not {consumers!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise InvalidInputError(f"slots must be an int from 1 to {MAX_SLOTS}, not {slots!r}")
    if _types.is_host(device):
        device = "host"
    elif isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidInputError(f"device is {device!r}; expected 'host' (or 'cpu') or a CUDA device ordinal")
    return Producer._create(shape, typestr, consumers, slots, device)


class Producer:
    """The producing end of a channel: made by :func:`gpushare.channel`.

    Each step: :meth:`acquire` the next slot (it waits while a consumer
    still reads the step that used it last), fill the array, :meth:`publish`.
    :meth:`slot` does both around a ``with`` block; :meth:`send` copies an
    array in.  Waiting is done by the kernel: no polling, no sleeping.

    Attributes
    ----------
    handle : ChannelHandle
        Plain data for the consumers.
    step : int
        The number the next published step gets (0 first).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Producer objects are made by gpushare.channel")

    @classmethod
    def _create(cls, shape: tuple[int, ...], typestr: str, consumers: int, slots: int, device: Any) -> Producer:
        from ._api import export
        from ._same_node import allocate

        self = object.__new__(cls)
        self._shape, self._typestr, self._consumers, self._slots = shape, typestr, consumers, slots
        self._device = device
        self.step = 0
        self._broken: str | None = None
        self._closed = False
        self._acquired: int | None = None
        self._peers: dict[int, _Peer] = {}
        self._busy: list[set[int]] = [set() for _ in range(slots)]
        self._slot_step = [-1] * slots
        self._buffers: list = []
        self._shares: list = []
        self._arrays: list = []
        channel_id, token = secrets.token_hex(16), secrets.token_bytes(32)
        nbytes = nbytes_of(shape, typestr)
        service = _Service(channel_id, token, consumers)
        self._service = service
        self._finalizer = weakref.finalize(self, _release_producer, service, self._peers, self._shares,
                                           self._buffers)
        try:
            for _ in range(slots):
                buf = allocate(nbytes, device=device)
                self._buffers.append(buf)
                if device == "host":
                    # Consumers read: the kernel keeps their mappings read-only.
                    with contextlib.suppress(UnsupportedError):  # a kernel before 5.1
                        buf.seal()
                self._shares.append(export(buf, lifetime="revoked", readonly=True))
                self._arrays.append(_array_of(buf, shape, typestr, device))
        except BaseException:
            self._arrays.clear()
            self._finalizer()
            raise
        self.handle = ChannelHandle._make(HANDLE_FORMAT, channel_id, token, os.getpid(), node_key(),
                                          f"gpushare-channel-{channel_id}", service.addresses, shape, typestr,
                                          consumers, slots, device, tuple(self._shares))
        log.info("channel %s: %d slots of %s %s on %s for %d consumers", channel_id[:8], slots, shape, typestr,
                 device, consumers)
        return self

    # -- state -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("the channel is closed")
        if self._broken is not None:
            raise ChannelBrokenError(self._broken)

    def _fds(self, slot: int) -> list[int]:
        """What to wait on for ``slot``: consumers joining, or the first
        consumer that still holds it (waking for the others' releases would
        only mean waking again), and every consumer's death."""
        fds = [self._service.wake] if len(self._peers) < self._consumers else []
        holders = sorted(self._busy[slot])
        for peer in self._peers.values():
            if peer.left:
                continue
            if peer.pidfd is not None:
                fds.append(peer.pidfd)
            if not holders or peer.index == holders[0] or peer.pidfd is None:
                fds.append(peer.sock.fileno())  # without a pidfd, the socket is how death shows
        return fds

    def _break(self, why: str, index: int = 0) -> None:
        """A consumer is gone: tell the others, and fail from now on."""
        self._broken = why
        log.warning("channel %s broken: %s", self.handle.channel_id[:8], why)
        for peer in self._peers.values():
            if not peer.left and peer.index != index:
                with contextlib.suppress(OSError):
                    peer.sock.send(_MSG.pack(_ABORT, index, self.step))
        raise ChannelBrokenError(why)

    def _pump(self, woken: frozenset[int] = frozenset()) -> None:
        """Take in new consumers and every release that arrived; never blocks.
        ``woken``: the fds a wait found readable (a pidfd there: a process exited)."""
        if len(self._peers) < self._consumers:
            for peer in self._service.take_joined():
                self._peers[peer.index] = peer
        for peer in list(self._peers.values()):
            if peer.left:
                continue
            data, eof = _read(peer.sock)
            self._messages(peer, data)
            if peer.left:
                continue
            if eof is not None:
                self._break(f"{peer.name()} {eof} without leaving the channel", peer.index)
            if peer.pidfd in woken and _exited(peer.pidfd):
                self._messages(peer, _read(peer.sock)[0])  # a LEAVE it sent before exiting counts
                if not peer.left:
                    self._break(f"{peer.name()} exited without leaving the channel", peer.index)

    def _messages(self, peer: _Peer, data: bytes) -> None:
        """Apply what ``peer`` sent: releases, and its leaving."""
        peer.buf += data
        while len(peer.buf) >= _MSG.size and not peer.left:
            op, slot, step = _MSG.unpack_from(peer.buf)
            peer.buf = peer.buf[_MSG.size:]
            if op == _RELEASE and slot < self._slots and self._slot_step[slot] == step:
                self._busy[slot].discard(peer.index)
            elif op == _LEAVE:
                peer.left = True
                for busy in self._busy:
                    busy.discard(peer.index)
                log.info("channel %s: %s left", self.handle.channel_id[:8], peer.name())
            elif op != _RELEASE:
                self._break(f"{peer.name()} sent a malformed message (op {op})", peer.index)

    def _ready(self, slot: int) -> bool:
        return len(self._peers) == self._consumers and not self._busy[slot]

    def _waiting_for(self, slot: int) -> str:
        if len(self._peers) < self._consumers:
            return f"{self._consumers - len(self._peers)} of {self._consumers} consumers to join"
        names = ", ".join(self._peers[i].name() for i in sorted(self._busy[slot]))
        return f"{names} to release step {self._slot_step[slot]}"

    def _begin_acquire(self) -> int:
        self._check()
        if self._acquired is not None:
            raise InvalidInputError(f"slot {self._acquired} is acquired and not yet published; publish it first")
        return self.step % self._slots

    def acquire(self, timeout: float | None = None) -> Any:
        """Wait for the next slot to be free and return its array to fill.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait; ``None`` waits as long as the consumers live.

        Returns
        -------
        numpy.ndarray or CudaArray
            The slot's memory, of the channel's shape and dtype (not zeroed:
            it holds an older step).  Publish it with :meth:`publish`.

        Raises
        ------
        WaitTimeoutError
            The consumers did not join, or did not release the slot, in time.
        ChannelBrokenError
            A consumer died or closed its connection without leaving.
        """
        return _run(self._acquiring(timeout))

    async def acquire_async(self, timeout: float | None = None) -> Any:
        """:meth:`acquire` for asyncio: the event loop watches the connections."""
        return await _run_async(self._acquiring(timeout))

    def _acquiring(self, timeout: float | None) -> Any:
        slot = self._begin_acquire()
        deadline = _deadline(timeout)
        woken: frozenset[int] = frozenset()
        while True:
            self._pump(woken)
            if self._ready(slot):
                self._acquired = slot
                return self._arrays[slot]
            woken = yield self._fds(slot), deadline
            if not woken:
                self._pump()
                if self._ready(slot):
                    continue
                raise WaitTimeoutError(f"no free slot within {timeout} s: waiting for {self._waiting_for(slot)}")

    def publish(self) -> int:
        """Publish the acquired slot as the next step; returns its number.

        For CUDA memory, the caller must have finished writing (synchronize
        the stream that wrote the slot) before publishing.

        Raises
        ------
        InvalidInputError
            No slot is acquired.
        ChannelBrokenError
            A consumer is gone.
        """
        self._check()
        slot = self._acquired
        if slot is None:
            raise InvalidInputError("publish() needs a slot from acquire() first")
        self._acquired = None
        step = self.step
        self._slot_step[slot] = step
        self._busy[slot] = {i for i, p in self._peers.items() if not p.left}
        message = _MSG.pack(_PUBLISH, slot, step)
        for peer in self._peers.values():
            if peer.left:
                continue
            try:
                peer.sock.send(message)
            except (BlockingIOError, OSError) as exc:
                self._break(f"{peer.name()} cannot be notified ({exc})")
        self.step += 1
        return step

    @contextlib.contextmanager
    def slot(self, timeout: float | None = None) -> Iterator[Any]:
        """``with producer.slot() as arr:`` acquire, fill, publish on a clean exit.

        An exception in the block publishes nothing; the slot is used for the
        next step instead.
        """
        arr = self.acquire(timeout)
        try:
            yield arr
        except BaseException:
            self._acquired = None
            raise
        self.publish()

    def send(self, data: Any, timeout: float | None = None) -> int:
        """Copy ``data`` (an array of the channel's shape) into the next slot and publish it.

        Parameters
        ----------
        data : array-like
            Host data for a host channel; for a CUDA channel, anything with
            ``__cuda_array_interface__`` or DLPack, or host data.
        timeout : float or None
            As for :meth:`acquire`.

        Returns
        -------
        int
            The step number.
        """
        return self._fill_and_publish(self.acquire(timeout), data)

    async def send_async(self, data: Any, timeout: float | None = None) -> int:
        """:meth:`send` for asyncio."""
        return self._fill_and_publish(await self.acquire_async(timeout), data)

    def _fill_and_publish(self, arr: Any, data: Any) -> int:
        try:
            _fill(arr, data)
        except BaseException:
            self._acquired = None  # nothing published: the slot serves the next step
            raise
        return self.publish()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every consumer released every published step.

        Raises
        ------
        WaitTimeoutError
            Some step is still held after ``timeout`` seconds.
        ChannelBrokenError
            A consumer is gone.
        """
        _run(self._draining(timeout))

    async def drain_async(self, timeout: float | None = None) -> None:
        """:meth:`drain` for asyncio."""
        await _run_async(self._draining(timeout))

    def _draining(self, timeout: float | None) -> Any:
        self._check()
        deadline = _deadline(timeout)
        woken: frozenset[int] = frozenset()
        while True:
            self._pump(woken)
            held = [s for s in range(self._slots) if self._busy[s]]
            if not held:
                return
            woken = yield self._fds(held[0]), deadline
            if not woken:
                raise WaitTimeoutError(f"the consumers did not release every step within {timeout} s: "
                                       f"waiting for {self._waiting_for(held[0])}")

    def close(self, timeout: float | None = 30.0, *, failed: bool = False) -> None:
        """End the channel: wait (up to ``timeout``) until the consumers
        released every step, tell them it ended, and free the slots.

        Consumers see the end after the last step (their iteration stops).
        Idempotent.  The channel is closed even when waiting fails; the error
        is raised after.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait for the consumers; 0 does not wait.
        failed : bool
            The producer gives up on an error: consumers get
            :class:`ChannelBrokenError` instead of a normal end (leaving a
            ``with`` block on an exception does this).

        Raises
        ------
        WaitTimeoutError, ChannelBrokenError
            From waiting for the consumers (see :meth:`drain`).
        """
        if self._closed:
            return
        error: BaseException | None = None
        if self._broken is None and timeout != 0:
            try:
                self.drain(timeout)
            except (WaitTimeoutError, ChannelBrokenError) as exc:
                error = exc
        self._closed = True
        if self._broken is None:
            end = _MSG.pack(_FAILED if failed else _END, 0, self.step)
            for peer in self._peers.values():
                if not peer.left:
                    with contextlib.suppress(OSError):
                        peer.sock.send(end)
        self._arrays.clear()
        self._finalizer()
        log.info("channel %s closed after %d steps", self.handle.channel_id[:8], self.step)
        if error is not None:
            raise error

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(GpuShareError):
                self.close(timeout=0, failed=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else f"at step {self.step}")
        return (f"<gpushare.Producer {self.handle.channel_id[:8]} {self._slots} slots of {self._shape} "
                f"{self._typestr}, {state}>")


def _array_of(buf: Any, shape: tuple[int, ...], typestr: str, device: Any, *, readonly: bool = False) -> Any:
    """A typed array over the first bytes of ``buf``."""
    nbytes = nbytes_of(shape, typestr)
    if device == "host":
        import numpy as np

        mv = buf.memoryview() if hasattr(buf, "memoryview") else memoryview(buf)
        arr = np.frombuffer(mv, dtype=np.dtype(typestr), count=nbytes // int(typestr[2:])).reshape(shape)
        if readonly:
            arr.flags.writeable = False
        return arr
    return CudaArray._make(buf, int(buf.handle), shape, typestr, device, readonly)


def _fill(arr: Any, data: Any) -> None:
    if isinstance(arr, CudaArray):
        from . import _buffers
        from ._paths import _cuda

        local = _buffers.resolve(data, writable=False, stream=_cuda.LEGACY_STREAM)
        try:
            if local.nbytes != arr.nbytes:
                raise InvalidInputError(f"data is {local.nbytes} bytes; a step is {arr.nbytes}")
            _cuda.copy_async(arr.ptr, local.address, arr.nbytes, ordinal=arr.device, stream=None,
                             producer=local.stream, keep=local, what="copy into a channel slot").wait(60.0)
        except BaseException:
            local.release()
            raise
        return
    import numpy as np

    src = np.asarray(data)
    if src.shape != arr.shape:
        raise InvalidInputError(f"data has shape {src.shape}; the channel carries {arr.shape}")
    np.copyto(arr, src, casting="same_kind")


# ---------------------------------------------------------------- consumer


def subscribe(handle: ChannelHandle, *, timeout: float = 30.0, device: int | None = None) -> Consumer:
    """Join a channel as one of its consumers.

    Connects to the producer (a Unix socket on its node, TCP from another
    node), proves it holds the handle, and opens every slot: mapped where
    the path maps memory (host-fd, posix-fd: zero-copy), otherwise read with
    ucx-rma into a local array at each step.

    Parameters
    ----------
    handle : ChannelHandle
        From :attr:`Producer.handle`, probably unpickled: it is validated.
    timeout : float
        Seconds to reach the producer and open the slots.
    device : int, optional
        For CUDA channels: the device to map the slots on (see
        :func:`gpushare.open`), and from another node the device the
        steps are copied to (0 by default).

    Returns
    -------
    Consumer

    Raises
    ------
    AccessDeniedError
        The producer refused: the handle is forged, or every consumer place is taken.
    ChannelBrokenError
        The producer is gone.
    """
    if not isinstance(handle, ChannelHandle):
        raise InvalidInputError(f"subscribe expects a gpushare.ChannelHandle, not {type(handle).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidInputError("timeout must be a positive number of seconds")
    return Consumer._create(handle, float(timeout), device)


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


def _handshake(sock: socket.socket, handle: ChannelHandle) -> int:
    token = handle._field("token")
    nonce_c = secrets.token_bytes(32)
    sock.sendall(_HELLO.pack(_MAGIC, bytes.fromhex(handle.channel_id), nonce_c, os.getpid()))
    reply = _recv_exact(sock, 64)
    nonce_p, mac = reply[:32], reply[32:]
    if not hmac.compare_digest(mac, _mac(token, b"producer", nonce_c, nonce_p)):
        raise AccessDeniedError("the channel's producer did not prove it holds the channel's token")
    sock.sendall(_mac(token, b"consumer", nonce_p, nonce_c))
    status, index, _ = _ACCEPT.unpack(_recv_exact(sock, _ACCEPT.size))
    if status == _FULL:
        raise AccessDeniedError(f"the channel already has its {handle.consumers} consumers")
    if status == _CLOSED:
        raise ChannelBrokenError("the channel's producer is closing the channel")
    if status != _OK or index >= handle.consumers:
        raise InvalidInputError(f"the producer answered status {status}, consumer index {index}")
    return index


class Step:
    """One published step, as a consumer holds it: made by :meth:`Consumer.wait`.

    ``array`` is the slot's memory (read-only; zero-copy where the path
    maps it) until :meth:`release`, which lets the producer reuse the slot:
    do not touch ``array`` after that (copy what you keep).  Leaving a
    ``with`` block releases.

    Attributes
    ----------
    step : int
        The step number.
    slot : int
        The slot it is in.
    array : numpy.ndarray or CudaArray
        Its data, of the channel's shape and dtype.
    """

    __slots__ = ("_consumer", "_released", "array", "slot", "step")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Step objects are made by Consumer.wait")

    @classmethod
    def _make(cls, consumer: Consumer, step: int, slot: int, array: Any) -> Step:
        self = object.__new__(cls)
        self._consumer, self.step, self.slot, self.array, self._released = consumer, step, slot, array, False
        return self

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran."""
        return self._released

    def release(self) -> None:
        """Tell the producer this consumer is done with the step (idempotent)."""
        if not self._released:
            self._released = True
            self._consumer._release(self.slot, self.step)

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<gpushare.Step {self.step} in slot {self.slot}{' released' if self._released else ''}>"


class Consumer:
    """A consuming end of a channel: made by :func:`gpushare.subscribe`.

    :meth:`wait` (or :meth:`wait_async`) returns each published step in
    order; iterating (``for step in consumer``, ``async for``) yields every
    step until the producer closes the channel, releasing each step when the
    next is asked for.  :meth:`close` leaves the channel: the producer stops
    waiting for this consumer.  A consumer process that exits without
    closing breaks the channel for the others (:class:`ChannelBrokenError`).

    Attributes
    ----------
    handle : ChannelHandle
        The channel.
    index : int
        This consumer's place, 0 to ``consumers - 1``.
    paths : tuple of str
        The path each slot was opened over (``"host-fd"``, ``"ucx-rma"``...).
    zero_copy : bool
        Whether the steps are read in place (every slot mapped).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Consumer objects are made by gpushare.subscribe")

    @classmethod
    def _create(cls, handle: ChannelHandle, timeout: float, device: int | None) -> Consumer:
        from ._api import open as open_share

        deadline = time.monotonic() + timeout
        self = object.__new__(cls)
        self.handle = handle
        self._queue: deque[tuple[int, int]] = deque()
        self._buf = b""
        self._next = 0
        self._end: int | None = None
        self._broken: str | None = None
        self._closed = False
        self._held: Step | None = None
        self._views: list = []
        self._arrays: list = []
        self._staging: list = []
        self._device = device
        self._pidfd = None
        held: list = [None, None]  # the socket and the producer's pidfd, once made
        self._finalizer = weakref.finalize(self, _release_consumer, held, self._views)
        try:
            # Every slot is open before the producer counts this consumer in:
            # no step is published that it could not read.
            for share in handle._field("shares"):
                view = open_share(share, timeout=max(0.1, deadline - time.monotonic()), device=device)
                self._views.append(view)
                self._arrays.append(_consumer_array(view, handle))
                self._staging.append(None)
            sock = held[0] = self._sock = _connect(handle, max(0.1, deadline - time.monotonic()))
            _keepalive(sock)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                self.index = _handshake(sock, handle)
            except (EOFError, OSError) as exc:
                raise AccessDeniedError(f"the channel's producer (pid {handle.producer_pid}) refused the "
                                        f"connection: the handle is not valid for it ({exc})") from None
            peer = _peer_pid(sock)
            if peer is not None:
                self._pidfd = held[1] = _pidfd(peer)
            sock.setblocking(False)
        except BaseException:
            self._arrays.clear()
            self._finalizer()
            raise
        self.paths = tuple(v.path for v in self._views)
        self.zero_copy = all(a is not None for a in self._arrays)
        log.info("channel %s: joined as consumer %d over %s", handle.channel_id[:8], self.index,
                 ", ".join(sorted(set(self.paths))))
        return self

    # -- state -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def _fds(self) -> list[int]:
        return [self._sock.fileno()] + ([self._pidfd] if self._pidfd is not None else [])

    def _producer_gone(self, detail: str) -> None:
        pid = self.handle.producer_pid
        self._broken = f"the channel's producer (pid {pid}) {detail} without closing the channel"

    def _pump(self, woken: frozenset[int] = frozenset()) -> None:
        """Read every notification that arrived; never blocks.  ``woken``:
        the fds a wait found readable (the pidfd there: the producer exited)."""
        if self._broken is not None or self._closed:
            return
        eof = self._parse(*_read(self._sock))
        if eof is None and self._end is None and self._pidfd in woken and _exited(self._pidfd):
            # The producer exited: what it sent before is still to be read.
            eof = self._parse(*_read(self._sock)) or "exited"
        if eof is not None and self._end is None and self._broken is None:
            self._producer_gone(eof)

    def _parse(self, data: bytes, eof: str | None) -> str | None:
        self._buf += data
        while len(self._buf) >= _MSG.size and self._broken is None:
            op, slot, step = _MSG.unpack_from(self._buf)
            self._buf = self._buf[_MSG.size:]
            if op == _PUBLISH and slot < self.handle.slots:
                self._queue.append((step, slot))
            elif op == _END:
                self._end = step
            elif op == _FAILED:
                self._broken = (f"the channel's producer (pid {self.handle.producer_pid}) gave up on an error "
                                f"after {step} steps")
            elif op == _ABORT:
                self._broken = (f"consumer {slot} of the channel died or closed its connection without leaving; "
                                "the producer stopped the channel")
            else:
                self._broken = f"the producer sent a malformed message (op {op})"
        return eof

    def _take(self, want: int | None) -> tuple[int, int] | None:
        """The wanted step if it arrived (releasing the ones skipped), else None."""
        if self._closed:
            raise ClosedError("the consumer is closed")
        if want is not None and want < self._next:
            raise InvalidInputError(f"step {want} was already taken; the next step is {self._next}")
        while self._queue:
            step, slot = self._queue.popleft()
            self._next = step + 1
            if want is None or step == want:
                return step, slot
            if step > want:
                raise ChannelBrokenError(f"the producer published step {step} where step {want} was due")
            self._release(slot, step)
        if self._broken is not None:
            raise ChannelBrokenError(self._broken)
        if self._end is not None and (want is None or want >= self._end):
            raise ClosedError(f"the producer closed the channel after {self._end} steps")
        return None

    def wait(self, step: int | None = None, timeout: float | None = None) -> Step:
        """Wait for a step and return it.

        Parameters
        ----------
        step : int, optional
            The step to wait for (earlier ones not yet taken are released
            unread); by default the next one.
        timeout : float or None
            Seconds to wait; ``None`` waits as long as the producer lives.

        Returns
        -------
        Step
            Release it (or leave its ``with`` block) once done reading.

        Raises
        ------
        WaitTimeoutError
            The step was not published in time.
        ClosedError
            The producer closed the channel before that step (or this consumer is closed).
        ChannelBrokenError
            The producer, or another consumer, died.
        """
        return self._deliver(*_run(self._waiting(step, timeout)))

    async def wait_async(self, step: int | None = None, timeout: float | None = None) -> Step:
        """:meth:`wait` for asyncio: the event loop watches the connection (no thread)."""
        return await self._deliver_async(*await _run_async(self._waiting(step, timeout)))

    def _waiting(self, step: int | None, timeout: float | None) -> Any:
        self._check_step(step)
        deadline = _deadline(timeout)
        woken: frozenset[int] = frozenset()
        while True:
            self._pump(woken)
            got = self._take(step)
            if got is not None:
                return got
            woken = yield self._fds(), deadline
            if not woken:
                self._pump()
                if self._queue or self._broken or self._end is not None:
                    continue
                raise WaitTimeoutError(f"step {self._next if step is None else step} was not published "
                                       f"within {timeout} s")

    @staticmethod
    def _check_step(step: Any) -> None:
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise InvalidInputError(f"step must be a non-negative int or None, not {step!r}")

    def _staged(self, slot: int) -> Any:
        if self._staging[slot] is None:
            self._staging[slot] = _staging_array(self.handle, self._device)
        return self._staging[slot]

    def _deliver(self, step: int, slot: int) -> Step:
        arr = self._arrays[slot]
        if arr is None:
            arr = self._staged(slot)
            try:
                self._views[slot].get(arr, timeout=60.0)
            except BaseException:
                self._release(slot, step)
                raise
        return Step._make(self, step, slot, arr)

    async def _deliver_async(self, step: int, slot: int) -> Step:
        arr = self._arrays[slot]
        if arr is None:
            arr = self._staged(slot)
            try:
                await self._views[slot].get_async(arr, timeout=60.0)
            except BaseException:
                self._release(slot, step)
                raise
        return Step._make(self, step, slot, arr)

    def _release(self, slot: int, step: int) -> None:
        if self._closed or self._broken is not None:
            return
        try:
            self._sock.send(_MSG.pack(_RELEASE, slot, step))
        except (BlockingIOError, OSError):
            self._producer_gone("stopped reading")

    # -- iteration ---------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        while (got := _run(self._iterating())) is not None:
            self._held = self._deliver(*got)
            yield self._held

    async def __aiter__(self) -> AsyncIterator[Step]:
        while (got := await _run_async(self._iterating())) is not None:
            self._held = await self._deliver_async(*got)
            yield self._held

    def _iterating(self) -> Any:
        """The next step for iteration (the previous one released), or None at the end."""
        if self._held is not None:
            self._held.release()
            self._held = None
        try:
            return (yield from self._waiting(None, None))
        except ClosedError:
            if self._closed:
                raise
            return None

    def close(self) -> None:
        """Leave the channel: release what this consumer holds, tell the
        producer, close the slots (idempotent)."""
        if self._closed:
            return
        if self._broken is None:
            with contextlib.suppress(OSError):
                self._sock.send(_MSG.pack(_LEAVE, 0, 0))
        self._closed = True
        self._held = None
        self._arrays.clear()
        self._staging.clear()
        self._finalizer()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"next step {self._next}"
        return f"<gpushare.Consumer {self.index} of channel {self.handle.channel_id[:8]}, {state}>"


def _release_consumer(held: list, views: list) -> None:
    sock, pidfd = held
    held[:] = [None, None]
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
    if pidfd is not None:
        with contextlib.suppress(OSError):
            os.close(pidfd)
    for view in views:
        with contextlib.suppress(GpuShareError):
            view.close()
    views.clear()


def _consumer_array(view: Any, handle: ChannelHandle) -> Any:
    """A typed array over a mapped slot, or None when the slot is read by copy."""
    if view.path in ("ucx-rma", "cma"):
        return None
    if view.device == "host":
        return _array_of(view, handle.shape, handle.typestr, "host", readonly=True)
    cai = view.__cuda_array_interface__
    return CudaArray._make(view, cai["data"][0], handle.shape, handle.typestr, view.device, readonly=True)


def _staging_array(handle: ChannelHandle, device: int | None) -> Any:
    """Local memory a ucx-rma slot is read into at each step."""
    import numpy as np

    if handle.device == "host":
        return np.empty(handle.shape, np.dtype(handle.typestr))
    from ._same_node import allocate

    device = device if device is not None else 0
    buf = allocate(handle.nbytes, device=device)
    return CudaArray._make(buf, int(buf.handle), handle.shape, handle.typestr, device)
