"""A connection of the service thread (:mod:`gpushare._service`): a
non-blocking socket with its own read buffer, write queue and deadline, the
:class:`Protocol` that handles its bytes, and file descriptors sent and
received with them (``SCM_RIGHTS``)."""

from __future__ import annotations

import array
import collections
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._types import close_all as _close_all

if TYPE_CHECKING:
    from ._service import Service

__all__ = ["Connection", "Protocol", "MAX_FDS"]

_READ_CHUNK = 256 * 1024
#: Most file descriptors one received message may carry.
MAX_FDS = 250
#: Queued bytes up to this size join the previous small ones in one buffer,
#: until it holds _COALESCE_LIMIT bytes; larger ones are queued as they are.
_COALESCE = 4096
_COALESCE_LIMIT = 256 * 1024
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
#: What the epoll watches for a connection's wants (read, write: 1, 2).
_EPOLL = (0, select.EPOLLIN, select.EPOLLOUT, select.EPOLLIN | select.EPOLLOUT)
_NOT_OUT, _NOT_IN = ~select.EPOLLOUT, ~select.EPOLLIN
#: Longest wait of a reading caller without looking whether the connection closed.
_DIRECT_STEP = 0.1
#: Its first step (doubled at each wait up to _DIRECT_STEP).
_FIRST_STEP = 0.001
_local = threading.local()


def _direct_buffer() -> memoryview:
    """This thread's buffer for reading a connection itself."""
    buf = getattr(_local, "into", None)
    if buf is None:
        buf = _local.into = memoryview(bytearray(64 * 1024))
    return buf


class Protocol:
    """What a :class:`Connection` does with its bytes (callbacks run in the service thread)."""

    #: Receive file descriptors (``SCM_RIGHTS``) with the bytes; Unix sockets only.
    wants_fds = False

    def data_received(self, conn: Connection, fds: list[int]) -> None:
        """New bytes are in ``conn.rbuf`` (and ``fds`` arrived with them: the
        protocol owns and must close them).  Raise to drop the connection."""

    def connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        """The connection closed (by either side, a deadline, or an error); called once."""

    def deadline_passed(self, conn: Connection) -> None:
        """``conn.deadline`` passed; by default the connection is dropped."""
        conn.close()


class Connection:
    """A non-blocking socket served by the service thread.

    :meth:`send` may be called from any thread; everything else from the
    service thread (or a protocol callback).
    """

    def __init__(self, service: Service, sock: socket.socket, protocol: Protocol,
                 deadline: float | None = None) -> None:
        sock.setblocking(False)
        self.service = service
        self.sock = sock
        self.fileno = sock.fileno()
        self.protocol = protocol
        self._deadline: float | None = None
        self._queued: float | None = None  # the earliest of its entries in the service's heap
        self.rbuf = bytearray()
        self.closed = False
        # [bytes or bytearray, bytes of it sent, fds] entries; small replies
        # share one bytearray, so a queued reply costs its bytes, not an object.
        self._wq: collections.deque[list] = collections.deque()
        self._unsent = 0  # bytes queued, not yet taken by the peer
        self._unsent_fds = 0  # descriptors queued with them
        # Re-entrant: a view's finalizer (run by the garbage collector at any
        # allocation) may send while this thread is inside send or a flush.
        self._wlock = threading.RLock()
        self._flushing = False
        self._writing = False
        self._close_when_sent = False
        # Reads (``rbuf`` and the protocol's data_received) happen under
        # ``_rlock``, in the service thread or in a thread that waits for a
        # reply and reads it itself (:meth:`read_until`, one at a time:
        # ``_claim``), while the service thread does not watch for reads.
        self._rlock = threading.Lock()
        self._claim = threading.Lock()
        self._direct = False
        self.deadline = deadline

    @property
    def deadline(self) -> float | None:
        """When (``time.monotonic()``) the protocol's :meth:`~Protocol.deadline_passed` runs; None: never."""
        return self._deadline

    @deadline.setter
    def deadline(self, when: float | None) -> None:
        self._deadline = when
        if when is not None and (self._queued is None or when < self._queued):
            self._queued = when
            self.service._at_deadline(self, when)

    # -- any thread -------------------------------------------------------
    def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Queue ``data`` (and ``fds`` on its first bytes) and send what the
        socket takes now; the rest goes as the peer reads.  The connection
        owns ``fds``: they are closed once sent (or dropped)."""
        owned = list(fds)
        # At most MAX_FDS descriptors ride on one byte each, the last of them
        # on the rest of the bytes: one message where one can carry them all.
        # (The peer has them all once it has the bytes.)
        riders = -(-len(owned) // MAX_FDS)
        if riders > len(data):
            _close_all(owned)
            raise ValueError(f"{len(owned)} fds need more than {len(data)} bytes to ride on")
        with self._wlock:
            if self.closed:
                _close_all(owned)
                return
            if riders <= 1 and not (self._wq or self._flushing or self._writing):
                # Nothing queued: straight to the socket; only what it does not take now is queued.
                try:
                    if owned:
                        sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                           _fd_array(owned))])
                    else:
                        sent = self.sock.send(data)
                except (BlockingIOError, InterruptedError):
                    pass  # queued below
                except OSError:
                    _close_all(owned)  # the peer is gone: reading reports it and closes the connection
                    return
                else:
                    if owned:  # they went with the first bytes
                        _close_all(owned)
                        owned, riders = [], 0
                    if sent == len(data):
                        return
                    data = data[sent:]
            for i in range(riders):
                last = i == riders - 1
                self._wq.append([data[i:] if last else data[i : i + 1], 0, owned[i * MAX_FDS : (i + 1) * MAX_FDS]])
            rest = b"" if riders else data
            if rest:
                tail = self._wq[-1] if self._wq else None
                # Not mid-flush: the buffer being sent may not grow then.
                if (len(rest) <= _COALESCE and tail is not None and not tail[2] and type(tail[0]) is bytearray
                        and len(tail[0]) < _COALESCE_LIMIT and not self._flushing):
                    tail[0] += rest
                elif len(rest) <= _COALESCE:
                    self._wq.append([bytearray(rest), 0, []])
                else:
                    self._wq.append([rest, 0, []])
            self._unsent += len(data)
            self._unsent_fds += len(owned)
            if self._flushing:  # re-entered mid-flush: the service thread sends it
                if not self._writing:
                    self._writing = True
                    self.service.call_soon(self._want_write)
                return
            if not self._writing:
                self._flush_locked()
                if self._wq and not self._writing:
                    self._writing = True
                    self.service.call_soon(self._want_write)

    def backlog(self) -> int:
        """Bytes queued and not yet taken by the peer."""
        return self._unsent

    def backlog_fds(self) -> int:
        """File descriptors queued with those bytes (held open until sent)."""
        return self._unsent_fds

    def hung_up(self) -> bool:
        """Whether the peer hung up (or the connection closed), asked of the
        socket now: true before the service thread has read the hang-up."""
        if self.closed:
            return True
        poller = select.poll()
        try:
            poller.register(self.fileno, select.POLLRDHUP)
            return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL)
                       for _, ev in poller.poll(0))
        except (OSError, ValueError):
            return True

    def read_until(self, done: Callable[[], bool], timeout: float) -> bool | None:
        """Read and handle this connection's bytes in the calling thread
        (not the service thread) until ``done()`` is true or ``timeout``
        seconds pass (False); the service thread does not read them
        meanwhile, so the bytes a waiting caller wants reach it without
        waking another thread.  None when another thread reads it so already
        (or this is the service thread): wait for ``done`` some other way."""
        if self.service.in_service_thread() or not self._claim.acquire(False):
            return None
        try:
            self._direct = True
            self.service._interest(self)
            poller = select.poll()
            poller.register(self.fileno, select.POLLIN)
            into = _direct_buffer()
            end = time.monotonic() + timeout
            step = _FIRST_STEP
            while not done():
                left = end - time.monotonic()
                if self.closed or left <= 0:
                    return done()
                # In steps: a close by another thread does not end a poll, and the service
                # thread may have read the reply just before this thread claimed the connection
                # (done() turns true with nothing more to read): short steps first, so that
                # such a reply is seen within a millisecond or two, then up to _DIRECT_STEP.
                ready = poller.poll(min(left, step) * 1000.0)
                step = min(step * 2, _DIRECT_STEP)
                if ready:
                    try:
                        self._on_readable(into)
                    except BaseException as exc:
                        # A signal handler's exception (KeyboardInterrupt) cut
                        # the read short: what was read may be lost, so the
                        # stream is dropped, as a broken one, and every waiter hears it.
                        self.close(exc)
                        raise
            return True
        finally:
            self._direct = False
            self.service._interest(self)
            self._claim.release()

    def _events(self) -> int:
        return (0 if self._direct else _READ) | (_WRITE if self._writing else 0)

    def close_when_sent(self) -> None:
        """Close once the queued bytes are sent."""
        with self._wlock:
            self._close_when_sent = True
            empty = not self._wq
        if empty:
            if self.service.in_service_thread():
                self.close()
            else:
                self.service.call_soon(self.close)

    # -- service thread ----------------------------------------------------
    def _flush_locked(self) -> None:
        """Send queued bytes until the socket would block (lock held)."""
        self._flushing = True
        try:
            self._flush_queue()
        finally:
            self._flushing = False

    def _flush_queue(self) -> None:
        while self._wq:
            entry = self._wq[0]
            buf, done, fds = entry
            try:
                with memoryview(buf) as whole, whole[done:] as view:
                    if fds:
                        sent = self.sock.sendmsg([view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                           _fd_array(fds))])
                        _close_all(fds)
                        self._unsent_fds -= len(fds)
                        entry[2] = []
                    else:
                        sent = self.sock.send(view)
                    left = len(view) - sent
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # The peer is gone: reading reports it and closes the connection.
                self._drop_queue()
                return
            self._unsent -= sent
            if left:
                entry[1] = done + sent
                return
            self._wq.popleft()

    def _drop_queue(self) -> None:
        """Forget every queued byte and close every queued fd (lock held)."""
        for _, _, queued in self._wq:
            _close_all(queued)
        self._wq.clear()
        self._unsent = self._unsent_fds = 0

    def _want_write(self) -> None:
        if not self.closed:
            self.service._interest(self)

    def _on_writable(self) -> None:
        with self._wlock:
            self._flush_locked()
            done = not self._wq
            if done:
                self._writing = False
            close = done and self._close_when_sent
        if done and not self.closed:
            self.service._interest(self)
        if close:
            self.close()

    def _on_readable(self, into: memoryview | None = None) -> None:
        with self._rlock:
            if not self.closed:
                self._read(self.service._read_into if into is None else into)

    def _read(self, into: memoryview) -> None:
        """One read into ``into`` (the reading thread's buffer, copied out at once)."""
        fds: list[int] = []
        try:
            if self.protocol.wants_fds:
                n, fds = _recv_fds(self.sock, into)
            else:
                n = self.sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(exc)
            return
        if not n:
            _close_all(fds)
            self.close()
            return
        self.rbuf += into[:n]
        try:
            self.protocol.data_received(self, fds)
        except Exception as exc:  # noqa: BLE001 - a peer's bytes never stop the service
            self.close(exc)

    def _stop_serving(self) -> None:
        with self._wlock:
            self.closed = True
            self._drop_queue()
        self.rbuf = bytearray()
        self.service._forget(self)

    def detach(self) -> socket.socket:
        """Stop serving the socket and hand it over, open (service thread):
        the protocol hears nothing more, bytes not yet sent are dropped."""
        self._stop_serving()
        return self.sock

    def close(self, exc: BaseException | None = None) -> None:
        """Drop the connection now (idempotent); the protocol hears of it once."""
        if self.closed:
            return
        self._stop_serving()
        try:
            if self._direct:  # a thread polls it: a close alone would not end that poll
                self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.protocol.connection_lost(self, exc)
        except Exception:  # noqa: BLE001, S110 - cleanup of one peer never stops the service
            pass


def _fd_array(fds: Sequence[int]) -> bytes:
    return array.array("i", fds).tobytes()


_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def _recv_fds(sock: socket.socket, into: memoryview) -> tuple[int, list[int]]:
    """Bytes read into ``into`` (how many) and any file descriptors that came
    with them; a message whose descriptors were cut short is an error (after
    closing those that came)."""
    n, ancdata, flags, _ = sock.recvmsg_into([into], _CMSG_SPACE)
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if flags & socket.MSG_CTRUNC:
        _close_all(fds)
        raise OSError("file descriptors were cut short in transit (RLIMIT_NOFILE?)")
    return n, fds
