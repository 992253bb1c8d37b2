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

import collections
import heapq
import itertools
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ._connection import _EPOLL, _NOT_IN, _NOT_OUT, _READ, _READ_CHUNK, _WRITE, Connection, Protocol
from ._process import PerProcess

__all__ = ["Service", "Timer", "get_service"]

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
        # Connections made but not yet added by the service thread: a thread reading its reply
        # itself (Connection.read_until) may be done with one before then, and a fork meanwhile
        # must still close it in the child.
        self._adding: set[Connection] = set()
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
        with self._reg_lock:
            stopped = self._stopping
            if not stopped:
                self._adding.add(conn)
        if stopped:  # no service thread will add it (at exit)
            conn.close()
        else:
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
        for conn in [*self._conns.values(), *self._adding]:
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
        # No lock: a thread that held it at the fork is gone, and the forking thread holds the GIL.
        for conn in [*self._conns.values(), *self._adding]:
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
        self._conns, self._adding, self._listeners, self._calls = {}, set(), {}, collections.deque()

    # -- service thread -----------------------------------------------------
    def _add(self, conn: Connection) -> None:
        # One step from "being added" to "served": a fork in between would find it in neither.
        with self._reg_lock:
            self._adding.discard(conn)
            serve = not conn.closed and not self._stopping
            if serve:
                self._conns[conn.fileno] = conn
                self._epoll.register(conn.fileno, _EPOLL[conn._events()])
        if not serve:
            conn.close()  # idempotent; outside the lock, which closing takes
            return
        conn._on_readable()  # bytes may have arrived before it was registered

    def _forget(self, conn: Connection) -> None:
        with self._reg_lock:
            self._adding.discard(conn)
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


_instance: PerProcess[Service] = PerProcess(Service, stop=Service.stop, abandon=Service.abandon)


def get_service() -> Service:
    """This process's service thread, started on first use (and again after fork)."""
    return _instance.get()
