"""The one service thread of a process: every socket gpushare serves or keeps.

One daemon thread waits on an ``epoll`` selector (no ``select()`` limit on
file descriptor numbers) for the exporter's control listeners, every control
connection (the exporter's, each with its leases, and the importer's), the
fd broker, and channels' listeners and joins (and their heartbeats).  No
thread per lease, per connection or per peer.

Every socket is non-blocking and every connection has its own read buffer,
write queue and deadline: a silent or slow peer is dropped at its deadline
and never delays another.  What a connection does with its bytes is its
:class:`Protocol`'s business; protocol callbacks run in the service thread
and must not block on the network.  A thread that waits for a reply may read
its connection itself instead (:meth:`Connection.read_until`): the service
thread stops watching that connection for reads meanwhile, so the reply
reaches the waiting thread without waking another one; the callbacks then
run in that thread, under the same per-connection read lock.

The service starts on first use (an export, an open, a broker registration;
never on ``import gpushare``), stops at interpreter exit, and is made anew in
a forked child, which closes every socket it inherited without touching the
parent's (no ``epoll_ctl``, no ``shutdown``: the epoll instance and the
connections are shared with the parent until the child closes its copies).
"""

from __future__ import annotations

import array
import collections
import heapq
import itertools
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._process import PerProcess
from ._types import close_all as _close_all

__all__ = ["Connection", "Protocol", "Service", "Timer", "get_service"]

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


class Timer:
    """A call the service thread makes later, unless cancelled first."""

    __slots__ = ("cancelled", "fn", "when")

    def __init__(self, when: float, fn: Callable[[], Any]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Service:
    """This process's service thread; use :func:`get_service`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._epoll = select.epoll()
        # Held to register, unregister or change what the epoll watches: a
        # thread reading a connection itself changes it too (:meth:`_interest`).
        self._reg_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        # What every connection reads into (in the service thread only): a
        # fresh buffer of this size per read would be mapped and unmapped each time.
        self._read_into = memoryview(bytearray(_READ_CHUNK))
        self._calls: collections.deque[Callable[[], Any]] = collections.deque()
        self._timers: list[tuple[float, int, Timer]] = []
        # Connection deadlines, earliest first; an entry whose connection
        # changed its deadline since is skipped (at most a few per connection).
        self._deadlines: list[tuple[float, int, Connection]] = []
        self._seq = itertools.count()
        self._conns: dict[int, Connection] = {}
        self._listeners: dict[int, tuple[socket.socket, Callable[[socket.socket], None]]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gpushare-service", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------
    def in_service_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` in the service thread (safe from any thread, signal
        handlers and weak-reference callbacks included: it never blocks)."""
        self._calls.append(fn)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (the pipe is full), or stopped

    def call_later(self, delay: float, fn: Callable[[], Any]) -> Timer:
        """Run ``fn()`` in the service thread after ``delay`` seconds."""
        timer = Timer(time.monotonic() + delay, fn)
        self.call_soon(lambda: heapq.heappush(self._timers, (timer.when, next(self._seq), timer)))
        return timer

    def run(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn()`` in the service thread and return its result."""
        if self.in_service_thread():
            return fn()
        done = threading.Event()
        box: list = [None, None]

        def call() -> None:
            try:
                box[0] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box[1] = exc
            done.set()

        self.call_soon(call)
        if not done.wait(timeout):
            raise TimeoutError(f"the gpushare service thread did not answer within {timeout} s")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def listen(self, sock: socket.socket, on_accept: Callable[[socket.socket], None]) -> None:
        """Serve a listening socket: ``on_accept(conn)`` runs in the service
        thread for each accepted connection."""
        sock.setblocking(False)

        def add() -> None:
            self._listeners[sock.fileno()] = (sock, on_accept)
            with self._reg_lock:
                self._epoll.register(sock.fileno(), select.EPOLLIN)

        self.run(add)

    def unlisten(self, sock: socket.socket) -> None:
        """Stop serving ``sock`` and close it."""
        def remove() -> None:
            if self._listeners.pop(sock.fileno(), None) is not None:
                with self._reg_lock:
                    self._epoll.unregister(sock.fileno())
            sock.close()

        if not self._stopping:
            try:
                self.run(remove)
                return
            except TimeoutError:
                pass
        sock.close()

    def connect(self, sock: socket.socket, protocol: Protocol, deadline: float | None = None) -> Connection:
        """Serve an open socket with ``protocol``; returns its connection."""
        conn = Connection(self, sock, protocol, deadline)
        self.call_soon(lambda: self._add(conn))
        return conn

    def stats(self) -> dict[str, int]:
        """Connections, listeners and timers (not cancelled) pending now."""
        return {"connections": len(self._conns), "listeners": len(self._listeners),
                "timers": sum(not t.cancelled for _, _, t in list(self._timers))}

    # -- lifetime -----------------------------------------------------------
    def stop(self) -> None:
        """Close every socket and end the thread (at exit, in the process that started it)."""
        if self._stopping:
            return
        self._stopping = True
        self.call_soon(lambda: None)
        if not self.in_service_thread():
            self._thread.join(timeout=5.0)
        for conn in list(self._conns.values()):
            conn.close()
        for sock, _ in list(self._listeners.values()):
            sock.close()
        self._listeners.clear()
        for s in (self._wake_r, self._wake_w):
            s.close()
        self._epoll.close()

    def abandon(self) -> None:
        """In a forked child: close every inherited socket, touching nothing
        the parent still uses (no unregistering, no shutdown)."""
        self._stopping = True
        for conn in self._conns.values():
            conn.closed = True
            try:
                conn.sock.close()
            except OSError:
                pass
        for sock, _ in self._listeners.values():
            sock.close()
        for s in (self._wake_r, self._wake_w):
            s.close()
        try:
            self._epoll.close()  # this process's reference only: nothing it watches changes
        except OSError:
            pass
        self._conns, self._listeners, self._calls = {}, {}, collections.deque()

    # -- service thread -----------------------------------------------------
    def _add(self, conn: Connection) -> None:
        if conn.closed:
            return
        if self._stopping:
            conn.close()
            return
        with self._reg_lock:
            self._conns[conn.fileno] = conn
            self._epoll.register(conn.fileno, _EPOLL[conn._events()])
        conn._on_readable()  # bytes may have arrived before it was registered

    def _forget(self, conn: Connection) -> None:
        with self._reg_lock:
            if self._conns.get(conn.fileno) is conn:
                del self._conns[conn.fileno]
                try:
                    self._epoll.unregister(conn.fileno)
                except OSError:
                    pass

    def _interest(self, conn: Connection) -> None:
        """Watch ``conn`` for what it wants now (any thread): reads unless a
        thread reads it itself, writes while bytes wait to be sent."""
        with self._reg_lock:
            if self._conns.get(conn.fileno) is conn and not conn.closed:
                try:
                    self._epoll.modify(conn.fileno, _EPOLL[conn._events()])
                except (OSError, ValueError):
                    pass  # the service stopped (at exit)

    def _run(self) -> None:
        while not self._stopping:
            timeout = self._next_timeout()
            try:
                ready = self._epoll.poll(-1 if timeout is None else timeout)
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return
            wake = self._wake_r.fileno()
            for fd, mask in ready:
                if fd == wake:
                    self._drain_wake()
                    continue
                listener = self._listeners.get(fd)
                if listener is not None:
                    self._accept(*listener)
                    continue
                conn = self._conns.get(fd)
                if conn is not None:
                    # as selectors reads epoll: a hang-up or an error is both readable and writable
                    self._serve(conn, (_READ if mask & _NOT_OUT else 0) | (_WRITE if mask & _NOT_IN else 0))
            self._run_calls()
            self._run_timers()
            self._check_deadlines()

    def _serve(self, conn: Connection, events: int) -> None:
        try:
            if events & _WRITE:
                conn._on_writable()
            if events & _READ and not conn.closed and not conn._direct:
                conn._on_readable()
        except Exception as exc:  # noqa: BLE001 - one connection never stops the service
            conn.close(exc)

    def _at_deadline(self, conn: Connection, when: float) -> None:
        entry = (when, next(self._seq), conn)
        if self.in_service_thread():
            heapq.heappush(self._deadlines, entry)
        else:
            self.call_soon(lambda: heapq.heappush(self._deadlines, entry))

    def _next_timeout(self) -> float | None:
        if self._calls:
            return 0.0
        when = [entry[0] for heap in (self._timers, self._deadlines) for entry in heap[:1]]
        if not when:
            return None
        return max(min(when) - time.monotonic(), 0.0)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run_calls(self) -> None:
        for _ in range(len(self._calls)):
            fn = self._calls.popleft()
            try:
                fn()
            except Exception:  # noqa: BLE001, S110 - one failing callback never stops the service
                pass

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                try:
                    timer.fn()
                except Exception:  # noqa: BLE001, S110
                    pass

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            when, _, conn = heapq.heappop(self._deadlines)
            if conn.closed or conn._queued != when:
                continue  # gone, or an entry it no longer counts on
            conn._queued = None
            if conn.deadline is None:
                continue
            if conn.deadline > now:  # moved later since: wait for that
                conn.deadline = conn.deadline
                continue
            conn.deadline = None
            try:
                conn.protocol.deadline_passed(conn)
            except Exception as exc:  # noqa: BLE001
                conn.close(exc)

    def _accept(self, sock: socket.socket, on_accept: Callable[[socket.socket], None]) -> None:
        for _ in range(64):  # a burst, without starving the other sockets
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of fds, or the peer gave up: try again on the next wake-up
            try:
                on_accept(conn)
            except Exception:  # noqa: BLE001 - one peer never stops the service
                conn.close()


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


_instance: PerProcess[Service] = PerProcess(Service, stop=Service.stop, abandon=Service.abandon)


def get_service() -> Service:
    """This process's service thread, started on first use (and again after fork)."""
    return _instance.get()
