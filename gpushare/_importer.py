"""The importer's side of the control channel: this process's connections to exporters.

One control connection per exporter, reused by every open of its shares:
the first open connects and says hello (where a peer would authenticate),
every further open is one request and one reply, matched by request id.
Each open the exporter grants is a *lease* on that connection, ended by
closing the view (a ``close`` message) or by the connection closing.  A
connection with no lease and no request in flight is closed after a short
linger, so none outlives its use and a quick reopen reuses it.

Replies are read by the process's service thread (:mod:`gpushare._service`);
the thread that opens waits for its reply.  In a forked child the parent's
connections are closed at fork (by the service) and never used: a lease
inherited from the parent does nothing there, and the child connects anew.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _auth, _control, _reopen
from ._errors import ClosedError, ExporterUnreachableError, GpuShareError, InvalidInputError
from ._hello import connect_local, refusal_error, say_hello, seconds_left
from ._manifest import MAX_PARTS
from ._process import (
    QUIET,
    PerProcess,
    Stopped,
    node_key,
    peer_timeout,
    process_state,
    state_of,
    wait_alive,
)
from ._connection import Connection, Protocol
from ._service import Timer, get_service
from ._types import close_all as _close_all

__all__ = ["Lease", "get_importer"]

#: Seconds a connection with no open view is kept for a reopen.
IDLE_LINGER = 2.0
#: Seconds the buffers of copies in flight stay held after their connection ended.
KEEP_AFTER_LOSS = 2.0
class _Lost(Exception):
    """The connection ended before the reply came (maybe reusable: retry once)."""


class _Flag:
    """What a waiter's ``event`` is: :class:`threading.Event`'s ``set``,
    ``is_set`` and ``wait``, on one lock (held until set) instead of a
    condition and a lock per wait."""

    __slots__ = ("_gate", "_set")

    def __init__(self) -> None:
        self._set = False
        self._gate = threading.Lock()
        self._gate.acquire()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Wake every waiter, once (the caller holds its waiter's lock)."""
        if not self._set:
            self._set = True
            self._gate.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if timeout is None:
            got = self._gate.acquire()
        elif timeout > 0:
            got = self._gate.acquire(True, timeout)
        else:
            got = self._gate.acquire(False)
        if got:
            self._gate.release()  # for the next waiter
            return True
        return self._set


#: The most parts a split reply to an abandoned open may hold (a bundle's most allocations).
_LATE_BOUND = MAX_PARTS
#: The lists a bundle open's grant may split over frames: each part's grant and its count of fds.
_REPLY_LISTS = ("parts", "fds")


class _Waiter:
    __slots__ = ("event", "fds", "reply", "bound", "_callbacks", "_lock")

    def __init__(self, bound: int = 0) -> None:
        #: The most items a reply split over several frames may hold: a
        #: bundle open's reply has one per allocation; 0, no split reply.
        self.bound = bound
        self.event = _Flag()
        self.reply: dict | None = None
        self.fds: list[int] = []
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            self.event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a waiter's callback never breaks the connection
                pass

    def then(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) once the reply came, or now if it has."""
        with self._lock:
            if not self.event.is_set():
                self._callbacks.append(callback)
                return
        callback()


class _Link(Protocol):
    """One control connection to one exporter."""

    def __init__(self, importer: Importer, key: tuple, pid: int, *, local: bool = False) -> None:
        #: A Unix socket to an exporter on this node: fds come with replies.
        self.wants_fds = local
        self._fds: list[int] = []  # received, not yet claimed by a reply
        self._assembly: _control.Assembly | None = None  # a reply split over frames, until its last
        self.importer = importer
        self.key = key
        self.exporter_pid = pid
        # Re-entrant: a view's finalizer (run by the garbage collector at any
        # allocation) may end a lease while this thread holds the lock.
        self.lock = threading.RLock()
        self.conn: Connection | None = None
        self.pending: dict[int, _Waiter] = {}
        self.leases: set[int] = set()
        self.dead: str | None = None
        #: The exporter refused this connection (after the challenge): the error every request gets.
        self.refused: GpuShareError | None = None
        self.answered = False
        self._abandoned: set[int] = set()  # requests whose caller gave up waiting
        self._kept: dict[int, Any] = {}  # what a request's reply frees (its buffer, pinned until then)
        self.heard = time.monotonic()  # when the exporter last sent anything
        self._ping_at: float | None = None  # when the unanswered ping went out
        # The timer that closes the connection once idle for IDLE_LINGER: at
        # most one, kept (not cancelled) when the connection is used again,
        # so that a quick reopen costs no timer; it looks at ``_idle_at``.
        self._linger: Timer | None = None
        self._idle_at: float | None = None  # since when no lease or request is held (None: busy)
        #: Closed views kept for a reopen, and the exporter's state page (:mod:`gpushare._reopen`).
        self.kept = _reopen.Kept(importer.service.call_later, self._kept_due)
        self._used_at = time.monotonic()  # the last request, or view kept or reopened

    # -- any thread ---------------------------------------------------------
    def submit(self, message: dict, keep: Any = None) -> tuple[int, _Waiter]:
        """Send one request; its reply comes to the returned waiter, and
        ``keep`` is referenced until it does (or the connection ends)."""
        rid = next(self.importer.ids)
        parts = message.get("parts") if message.get("op") == "open" else None
        waiter = _Waiter(len(parts) if isinstance(parts, list) else 0)  # a bundle's open: one grant per part
        with self.lock:
            if self.dead is not None:
                raise self._lost()
            self._stop_linger()
            self._used_at = time.monotonic()
            self.pending[rid] = waiter
            if keep is not None:
                self._kept[rid] = keep
            conn = self.conn
        framed = {**message, "id": rid}
        conn.send(_control.pack_split(framed, framed, ("parts",)) if waiter.bound else _control.pack(framed))
        return rid, waiter

    def request(self, message: dict, timeout: float) -> tuple[dict, list[int]]:
        """Send one request and wait for its reply, and the fds that came with it."""
        rid, waiter = self.submit(message)
        conn, done = self.conn, waiter.event.is_set

        def wait(seconds: float | None) -> bool:  # the reply read in this thread where no other thread does so
            got = None if seconds is None or conn is None else conn.read_until(done, seconds)
            return waiter.event.wait(seconds) if got is None else got

        try:
            answered = wait_alive(wait, Stopped(self.exporter_pid, self.key[1]), timeout)
        except ExporterUnreachableError:
            answered = False
            if waiter.reply is None:
                self._give_up(rid)
                raise
        if not answered:
            self._give_up(rid)
            if waiter.reply is None:
                raise TimeoutError(f"no answer from exporter pid {self.exporter_pid} within {timeout:.3g} s")
        if waiter.reply is None:
            raise self._lost()
        return waiter.reply, waiter.fds

    def _lost(self) -> Exception:
        """The error for a request on this connection once it ended: the
        exporter's refusal of it, if that is how it ended, else :class:`_Lost`."""
        if self.refused is not None:
            return type(self.refused)(str(self.refused))
        return _Lost(self.dead or "closed the connection")

    def gone(self) -> str:
        """What became of the exporter, once its connection ended: "exited"
        when its process is gone (told on its node), else how the connection ended."""
        pid, node = self.exporter_pid, self.key[1]
        if node == node_key() and process_state(pid) in (None, "Z", "X"):
            return f"the exporter (pid {pid}) has exited"
        return f"the exporter (pid {pid}) {self.dead or 'closed the connection'}"

    def _give_up(self, rid: int) -> None:
        """The caller stopped waiting for request ``rid``: a late reply is dropped
        (a late lease given back)."""
        with self.lock:
            if self.pending.pop(rid, None) is not None:
                self._abandoned.add(rid)
                self._maybe_linger()

    def end_lease(self, lease: int, op: str, kept: bool = False) -> None:
        """Tell the exporter a lease ended (``close``) or was not used
        (``failed``); ``kept``: a lease kept after its view closed
        (:mod:`gpushare._reopen`): the connection's linger counts from its
        last use, not from now."""
        with self.lock:
            if lease not in self.leases:
                return
            self.leases.discard(lease)
            conn = None if self.dead is not None else self.conn
            self._maybe_linger(self._used_at if kept else None)
        if conn is not None:
            conn.send(_control.pack({"op": op, "lease": lease}))

    def _stop_linger(self) -> None:
        """The connection is in use again (lock held): it is not idle."""
        self._idle_at = None

    def _maybe_linger(self, since: float | None = None) -> None:
        """Close the connection a while after its last lease and request, or
        after ``since`` (lock held)."""
        if self.leases or self.pending or self.dead is not None:
            return
        if self._idle_at is None:
            self._idle_at = time.monotonic() if since is None else since
        if self._linger is None:
            self._linger = self.importer.service.call_later(
                max(0.0, self._idle_at + IDLE_LINGER - time.monotonic()), self._idle)

    # -- service thread -------------------------------------------------------
    def _idle(self) -> None:
        with self.lock:
            self._linger = None
            if self.leases or self.pending or self.dead is not None or self._idle_at is None:
                self._idle_at = None
                return  # in use again: the next idle time starts a timer
            left = self._idle_at + IDLE_LINGER - time.monotonic()
            if left > 0:  # used and idle again since the timer was set: wait the rest
                self._linger = self.importer.service.call_later(left, self._idle)
                return
            self.dead = "closed after being idle"
        self.importer._drop(self)
        if self.conn is not None:
            self.conn.close()

    def check_alive(self) -> None:
        """For a thread waiting on a transfer: raise
        :class:`ExporterUnreachableError` when the exporter has left a ping
        unanswered for :func:`peer_timeout` seconds (stopped, frozen, cut
        off); send one after :data:`QUIET` seconds of silence."""
        now = time.monotonic()
        if now - self.heard < QUIET:
            return
        with self.lock:
            dead = self.dead
            ping_at = self._ping_at
            if ping_at is not None and self.heard >= ping_at:
                ping_at = self._ping_at = None  # answered since
        if dead is not None:
            raise ExporterUnreachableError(f"{self.gone()}: this view cannot be used any more")
        if ping_at is None:
            with self.lock:
                self._ping_at = now
            try:
                self.submit({"op": "ping"})
            except _Lost:
                raise ExporterUnreachableError(f"{self.gone()}: this view cannot be used any more") from None
            return
        waited = now - ping_at
        if waited >= peer_timeout():
            raise ExporterUnreachableError(
                f"the exporter (pid {self.exporter_pid}) has not answered for {waited:.1f} s"
                f"{state_of(self.exporter_pid, self.key[1])}: it is stopped, frozen or cut off "
                "(GPUSHARE_PEER_TIMEOUT sets how long to wait for it)"
            )

    def data_received(self, conn: Connection, fds: list[int]) -> None:
        self.heard = time.monotonic()
        self._fds.extend(fds)
        for message in _control.take_frames(conn.rbuf):
            if self._assembly is not None:  # the rest of a split reply
                if not self._assembly.add(message):
                    continue
                message, self._assembly = self._assembly.whole(), None
            elif "more" in message:  # the first frame of a reply split over several
                waiter = self.pending.get(message.get("id"))  # type: ignore[arg-type]
                # a reply to an open given up on still comes whole, then is given back
                bound = waiter.bound if waiter is not None else (
                    _LATE_BOUND if message.get("id") in self._abandoned else 0)
                if not bound:
                    raise InvalidInputError(f"exporter pid {self.exporter_pid} split a reply that cannot be split")
                self._assembly = _control.Assembly(message, message.get("payload"), _REPLY_LISTS, bound)
                continue
            rid, lease = message.get("id"), message.get("lease")
            if rid is None and message.get("ok") is False and not self.answered:
                # The exporter refused the connection (the proof of the key
                # this process sent): every request gets that error.
                self.refused = refusal_error(self.exporter_pid, message)
                raise self.refused
            granted = message.get("ok") is True and isinstance(lease, int) and not isinstance(lease, bool)
            count = message.get("fds", 0)
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(self._fds):
                raise InvalidInputError(f"exporter pid {self.exporter_pid} announced fds it did not send")
            got, self._fds = self._fds[:count], self._fds[count:]
            if message.get("page") is True and got:
                self._take_page(got.pop())
            with self.lock:
                waiter = self.pending.pop(rid, None)  # type: ignore[arg-type]
                self._kept.pop(rid, None)  # type: ignore[arg-type]
                late = waiter is None and rid in self._abandoned
                if waiter is None and not late:
                    _close_all(got)
                    raise InvalidInputError(f"exporter pid {self.exporter_pid} answered a request never made")
                self._abandoned.discard(rid)  # type: ignore[arg-type]
                self.answered = True
                if granted:
                    self.leases.add(lease)
                    self._idle_at = None  # in use (a late grant too, until it is given back)
                self._maybe_linger()
            if late:
                _close_all(got)
                if granted:  # nobody waits for this open any more: give it back
                    self.end_lease(lease, "failed")
                continue
            waiter.fds = got
            waiter.reply = message
            waiter.set()
        if self._fds and not conn.rbuf and self._assembly is None:
            raise InvalidInputError(f"exporter pid {self.exporter_pid} sent fds with no reply")

    def _take_page(self, fd: int) -> None:
        """The exporter's state page, sent once (the fd is closed here).  One
        that is not a sealed memfd of the page's size is not used: no view
        of this exporter is kept then."""
        try:
            if self.kept.page is None:
                self.kept.page = _reopen.PageReader(fd)
        except (OSError, ValueError, GpuShareError):
            pass
        finally:
            os.close(fd)

    # -- kept views (any thread) -------------------------------------------
    def keep(self, lease: Lease) -> bool:
        """Keep ``lease`` (its view closed) and its mapping for a reopen;
        False when it cannot be (the caller ends the lease)."""
        use, key, keep = lease.use, lease.key, lease.keep
        if key is None or keep is None:
            return False
        try:
            use.acquire()
        except GpuShareError:
            return False  # unmapped already
        with self.lock:
            out = self.kept.put(key, lease, use, *keep) if self.dead is None and lease.id in self.leases else None
            if out is not None:
                self._used_at = time.monotonic()
        if out is None:
            use.drop()
            return False
        self._end_kept(out)
        return True

    def reopen(self, key: tuple) -> tuple[Lease, Any] | None:
        """The lease and mapping users of a kept view of ``key`` whose share
        still lives (its exporter too), taken out; else None."""
        with self.lock:
            entry, ended = self.kept.take(key) if self.dead is None else (None, None)
            self._used_at = time.monotonic()
        if ended is not None:
            self._end_kept([ended])
        if entry is None:
            return None
        conn = self.conn
        if conn is None or conn.hung_up():  # the exporter is gone, and the service thread has not heard yet
            self._end_kept([entry])
            return None
        return entry[0], entry[1]

    def _end_kept(self, entries: list[tuple]) -> None:
        """End kept views: their leases end and their mappings go (unless in use)."""
        for entry in entries:
            lease, use = entry[0], entry[1]
            self.end_lease(lease.id, "close", kept=True)
            use.drop()

    def _kept_due(self) -> None:  # the service thread's timer
        with self.lock:
            out = self.kept.expired()
            self.kept.rearm()
        self._end_kept(out)

    def connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        fds, self._fds = self._fds, []
        _close_all(fds)
        with self.lock:
            if self.dead is None:
                self.dead = f"closed the connection ({exc})" if exc else "closed the connection"
            waiters, self.pending = list(self.pending.values()), {}
            # The exporter's copies stop at the end of the connection (within
            # a piece); the buffers they wrote into stay held a little longer.
            kept, self._kept = self._kept, {}
            if kept:
                self.importer.service.call_later(KEEP_AFTER_LOSS, kept.clear)
            self.leases.clear()  # the exporter ended them with the connection
            self._stop_linger()
            kept_views = self.kept.clear()  # and nothing is kept on it from now on
            if self.kept.page is not None:
                self.kept.page.close()
        self._end_kept(kept_views)  # their leases ended with the connection: only the mappings go
        self.importer._drop(self)
        for waiter in waiters:
            waiter.set()

    def deadline_passed(self, conn: Connection) -> None:
        pass  # no deadline is set: requests time out in their callers


class Lease:
    """One open granted by an exporter; :meth:`close` ends it (idempotent,
    and a no-op in a forked child)."""

    __slots__ = ("_link", "_pid", "id", "keep", "key", "use")

    def __init__(self, link: _Link, lease_id: int, keep: tuple[int, int] | None = None) -> None:
        self._link = link
        self._pid = os.getpid()
        self.id = lease_id
        #: The share's (slot, epoch) on the exporter's state page, where the
        #: exporter lets this lease be kept after its view closes; the view's
        #: key and mapping users (:meth:`may_keep`) where it is.
        self.keep = keep
        self.key: tuple | None = None
        self.use: Any = None

    def may_keep(self, key: tuple, use: Any) -> None:
        """When the view closes, keep this lease and the mapping (``use``) for
        a reopen of ``key`` (:mod:`gpushare._reopen`), if the exporter lets it."""
        if self.keep is not None:
            self.key, self.use = key, use

    def close(self) -> None:
        if self._pid == os.getpid():
            if self.key is not None and self._link.keep(self):
                return
            self._link.end_lease(self.id, "close")

    def failed(self) -> None:
        """The offer could not be used: the open does not count."""
        if self._pid == os.getpid():
            self._link.end_lease(self.id, "failed")

    @property
    def exporter_pid(self) -> int:
        return self._link.exporter_pid

    def submit(self, message: dict, keep: Any = None) -> Any:
        """Send a request about this lease (``message`` with the lease's id);
        the returned waiter gets its reply (``event``, ``reply``, ``then``), and
        ``keep`` is referenced until it does (or the connection ends)."""
        if self._pid != os.getpid():
            raise ClosedError("this view was opened before a fork, by the parent process: open the share again "
                              "in this process")
        try:
            return self._link.submit({**message, "lease": self.id}, keep=keep)[1]
        except _Lost:
            raise self.lost() from None

    def lost(self, what: str = "") -> ClosedError:
        """The error for a use of this lease (``what``: "the get", say, that
        was in flight) once its connection ended: what became of the exporter,
        said once."""
        during = f" before {what} finished" if what else ""
        return ClosedError(f"{self._link.gone()}{during}: this view cannot be used any more: close it, and open "
                           "a share from a running exporter")

    def check_alive(self) -> None:
        """See :meth:`_Link.check_alive` (nothing in a forked child)."""
        if self._pid == os.getpid():
            self._link.check_alive()


class Importer:
    """This process's connections to exporters; use :func:`get_importer`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.service = get_service()
        self.ids = itertools.count(1)
        self._lock = threading.Lock()
        self._links: dict[tuple, _Link] = {}

    def stats(self) -> dict[str, int]:
        """Connections held and leases on them (for tests and benchmarks)."""
        with self._lock:
            links = list(self._links.values())
        return {"connections": len(links), "leases": sum(len(link.leases) for link in links)}

    def kept(self) -> int:
        """Closed views kept for a reopen (:mod:`gpushare._reopen`), on every connection."""
        with self._lock:
            links = list(self._links.values())
        return sum(len(link.kept.entries) for link in links)

    def open(self, share: Any, addresses: tuple, message: dict,
             deadline: float) -> tuple[dict, Lease | None, list[int]]:
        """Send an open request for ``share``: the reply, its lease if granted,
        and the fds that came with it (the caller owns them).

        A connection that closed under a request it had reused (the exporter
        dropped it as idle) is replaced once.
        """
        link = self._link(share, addresses, deadline)
        try:
            reply, fds = link.request(message, seconds_left(deadline))
        except _Lost as exc:
            if not link.answered:
                raise _unreachable(share, exc) from None
            link = self._link(share, addresses, deadline)
            try:
                reply, fds = link.request(message, seconds_left(deadline))
            except _Lost as exc2:
                raise _unreachable(share, exc2) from None
        if not reply.get("ok"):
            _close_all(fds)
            return reply, None, []
        lease = reply.get("lease")
        if isinstance(lease, bool) or not isinstance(lease, int):
            _close_all(fds)
            raise InvalidInputError(f"exporter pid {share.exporter_pid} granted a malformed lease")
        try:
            keep = _reopen.check_keep(reply.get("keep")) if link.kept.page is not None else None
        except InvalidInputError:
            keep = None  # not kept, nothing else changes
        return reply, Lease(link, lease, keep), fds

    def reopen(self, share: Any, key: tuple) -> tuple[Lease, Any] | None:
        """A kept view's lease and mapping for another open of ``share``
        (:mod:`gpushare._reopen`), or None: no round trip either way."""
        with self._lock:
            link = self._links.get((share.exporter_pid, share.node, share.control))
        if link is None or not link.kept.entries:
            return None
        return link.reopen(key)

    def _link(self, share: Any, addresses: tuple, deadline: float) -> _Link:
        key = (share.exporter_pid, share.node, share.control)
        with self._lock:
            link = self._links.get(key)
        if link is not None and link.dead is None:
            return link
        if self.service.in_service_thread():
            raise InvalidInputError("gpushare.open cannot be called from gpushare's service thread")
        _auth.key()  # a malformed GPUSHARE_AUTHKEY is this process's error, said before anything is sent
        sock = connect_local(share, deadline)
        link = _Link(self, key, share.exporter_pid, local=sock is not None)
        if sock is None:
            sock = _control.connect(addresses, seconds_left(deadline))
            try:
                say_hello(sock, share.exporter_pid, deadline, share.node)
            except BaseException:
                sock.close()
                raise
        link.conn = self.service.connect(sock, link)
        with self._lock:
            other = self._links.get(key)
            if other is not None and other.dead is not None:
                other = None  # closing: replaced
            if other is None:
                self._links[key] = link
        if other is not None:  # another thread connected first: use that one
            link.dead = "not needed"
            self.service.call_soon(link.conn.close)
            return other
        if link.dead is not None:
            # It ended before it was listed here (the exporter refused it at
            # once): its end could not unlist it.  Its requests say why.
            self._drop(link)
        return link

    def _drop(self, link: _Link) -> None:
        with self._lock:
            if self._links.get(link.key) is link:
                del self._links[link.key]

    def abandon(self) -> None:
        """In a forked child: the service closed the inherited connections;
        forget them, and unmap what they kept for a reopen (the parent's
        views: the child never reopens them)."""
        links, self._links = list(self._links.values()), {}
        self._lock = threading.Lock()
        for link in links:
            for entry in link.kept.clear():
                entry[1].forget_in_child()
            if link.kept.page is not None:
                link.kept.page.close()

    def stop(self) -> None:
        """At exit: the service closes the connections."""


def _unreachable(share: Any, exc: BaseException) -> ExporterUnreachableError:
    return ExporterUnreachableError(f"the exporter (pid {share.exporter_pid}) stopped answering: {exc}")


_instance: PerProcess[Importer] = PerProcess(Importer, stop=Importer.stop, abandon=Importer.abandon)


def get_importer() -> Importer:
    """This process's importer, made on first use (and again after fork)."""
    return _instance.get()
