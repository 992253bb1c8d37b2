"""The cma path: host memory of any origin, copied between two processes on
one node by the kernel (cross-memory attach, ``process_vm_readv`` /
``process_vm_writev``), one copy, no network transport.

The exporter does every copy: an importer's ``get`` asks it, on the control
connection, to write ``n`` bytes of the share at ``offset`` into an address
of the importer; a ``put`` asks it to read them from there.  So the exporter
checks each transfer (lease, bounds, read-only, revocation) and its memory is
never touched by another process; the importer lets the exporter write into
the buffers it names.  The kernel allows it only where the exporter may
ptrace the importer (same user, and with Yama's ``ptrace_scope=1`` only an
ancestor, such as the parent of Pool workers); the exporter checks that at
open, and the importer falls back to ucx-rma with a ``SlowPathWarning`` where
it cannot.  The importer's process id comes from the kernel (``SO_PEERCRED``
on the exporter's Unix control socket), never from a message.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _buffers, _control
from .._errors import (
    AccessDeniedError,
    ClosedError,
    GpuShareError,
    InvalidInputError,
    OutOfBoundsError,
    UnsupportedError,
    WaitTimeoutError,
)
from .._process import await_alive, wait_alive
from .base import OTHER_HOST, ControlOp, Grant, Here, Memory, Offer, Opened, Options, Paced, Path, no_fds, same_node
from .broker import peer_credentials

if TYPE_CHECKING:
    from .._share import Share

__all__ = ["available", "check_access", "copy", "copier", "PATH", "serve_copy", "CmaTransport", "Transfer"]

log = logging.getLogger("gpushare")

#: Bytes the exporter moves per system call.  Before each piece the copy
#: checks that it may still go on (the connection open, the lease held, the
#: share not revoked, the importer the same process): a revocation or a
#: closed connection stops a copy within one piece (about a millisecond).
PIECE = 8 << 20
#: The control message that asks the exporter for a copy.
OP = "cma"
#: Copies an importer's connection may have queued or running at once (a
#: batch of copies over one lease counts as one).
MAX_QUEUED = 64
#: Copies one batch request may carry: its message stays well within a
#: control frame (about 70 bytes an item at most).
MAX_ITEMS = 512
#: Batch requests one importer's batch keeps in flight on its connection;
#: it sends the next as each is answered, so a batch of any size stays
#: within :data:`MAX_QUEUED` with room for the connection's other copies.
WINDOW = 16


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: Any = None
_lock = threading.Lock()


def _calls() -> Any:
    global _libc
    with _lock:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            for name in ("process_vm_readv", "process_vm_writev"):
                fn = getattr(libc, name)
                fn.restype = ctypes.c_ssize_t
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                               ctypes.c_ulong]
            _libc = libc
    return _libc


def available() -> str | None:
    """None when this process can use the cma path, else why not."""
    try:
        _calls()
    except (OSError, AttributeError) as exc:
        return f"this C library has no process_vm_readv ({exc})"
    return None


def check_access(pid: int) -> None:
    """Raise :class:`AccessDeniedError` unless this process may copy into and
    out of process ``pid`` (the kernel's ptrace access check, done by opening
    its ``/proc/PID/mem``, which touches none of its memory)."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        raise AccessDeniedError(
            f"the kernel does not let the exporter (pid {os.getpid()}) access process {pid}'s memory "
            "(another user, or Yama's ptrace_scope, which allows it only for ancestors)"
        ) from None
    except FileNotFoundError:
        raise ClosedError(f"process {pid} has exited") from None
    except OSError as exc:  # out of descriptors: this open is refused, the connection stays
        raise UnsupportedError(f"the exporter cannot check its access to process {pid}'s memory: "
                               f"{exc.strerror}") from None
    os.close(fd)


class Process:
    """An importer's process, as the kernel knows it: its pid and a pidfd,
    which tells whether that very process still runs (a pid may be reused
    once it has exited; a pidfd never refers to another process).  One per
    control connection, shared by its leases and their copies; the pidfd
    closes when the last of them lets go."""

    __slots__ = ("fd", "pid")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            raise ClosedError(f"process {pid} has exited") from None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # not a lease without the check
                raise UnsupportedError(f"the exporter cannot open a pidfd of process {pid}: {exc.strerror}") from None
            self.fd = None  # a kernel before 5.3: the pid alone
        except AttributeError:
            self.fd = None  # a Python without os.pidfd_open

    def alive(self) -> bool:
        if self.fd is None:
            return True
        try:
            signal.pidfd_send_signal(self.fd, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def __del__(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def copy(proc: Process, local: int, remote: int, n: int, *, into_remote: bool,
         still: Callable[[], str | None] = lambda: None) -> None:
    """Copy ``n`` bytes between ``local`` (this process) and ``remote`` (in
    the importer's process): into it for an importer's get, out of it for a
    put, in pieces.  ``still()`` is asked before each piece and returns why
    the copy must stop (:class:`ClosedError`), or None.  Raises
    :class:`InvalidInputError` for an address the importer does not have
    mapped (or not writable), and :class:`AccessDeniedError` /
    :class:`ClosedError` as :func:`check_access`."""
    libc = _calls()
    fn = libc.process_vm_writev if into_remote else libc.process_vm_readv
    pid = proc.pid
    done = 0
    while done < n:
        why = still()
        if why is None and not proc.alive():
            why = f"process {pid} has exited"
        if why is not None:
            raise ClosedError(f"the copy stopped after {done} of {n} bytes: {why}")
        size = min(n - done, PIECE)
        mine = _IoVec(local + done, size)
        theirs = _IoVec(remote + done, size)
        moved = fn(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if moved < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.EPERM:
                check_access(pid)  # says why
                raise AccessDeniedError(f"the kernel refused a copy with process {pid}")
            if err == errno.ESRCH:
                raise ClosedError(f"process {pid} has exited")
            if err == errno.EFAULT:
                raise InvalidInputError(
                    f"process {pid} has no {'writable ' if into_remote else ''}memory at {remote + done:#x} "
                    f"for {size} bytes"
                )
            raise UnsupportedError(f"cross-memory attach with process {pid} failed: {os.strerror(err)}")
        if moved == 0:
            raise InvalidInputError(f"process {pid} has no memory at {remote + done:#x}")
        done += moved


class _Copier:
    """The exporter's copy threads: two per process, whatever the number of
    shares and importers.  Every copy runs here, never on the service
    thread, which keeps answering while an importer's memory is slow to
    fault in.  Daemon threads; :meth:`stop` (at exit, before the control
    channel closes) stops the copies at their next piece and waits for
    them, so no copy writes into an importer after its connection ended."""

    THREADS = 2

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.running = 0
        self.idle = threading.Condition()
        for i in range(self.THREADS):
            threading.Thread(target=self._run, name=f"gpushare-cma-{i}", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            with self.idle:
                self.running += 1
            try:
                job()
            except BaseException:  # noqa: BLE001 - a job reports its own errors; the thread goes on
                log.exception("a cma copy job failed")
            finally:
                with self.idle:
                    self.running -= 1
                    self.idle.notify_all()
            del job

    def stop(self, timeout: float = 2.0) -> None:
        """Stop every copy at its next piece and wait (at most ``timeout``)."""
        self.stopping = True
        with self.idle:
            self.idle.wait_for(lambda: self.running == 0 and self.jobs.empty(), timeout)


_copier: _Copier | None = None
_copier_pid = 0


def copier() -> _Copier:
    """This process's copy threads, started on first use (and again after fork)."""
    global _copier, _copier_pid
    with _lock:
        if _copier is None or _copier_pid != os.getpid():
            _copier = _Copier()
            _copier_pid = os.getpid()
        return _copier


def stop() -> None:
    """At exit: stop this process's copies, if it ever started any."""
    c = _copier
    if c is not None and _copier_pid == os.getpid():
        c.stop()


# ---------------------------------------------------------------- the path


class Cma(Path):
    name = "cma"
    rank = 5
    mapped = False
    holds_memory = False
    reopens = False
    maps_strided = False
    serves = frozenset({OTHER_HOST})
    reason = ("same node; the exporter copies with the kernel's cross-memory attach (process_vm_readv/writev), "
              "checking each transfer; copies with get/put")

    def offer(self, memory: Memory) -> Offer | None:
        # Host memory the mapped paths cannot serve goes by cross-memory attach on its node.
        if memory.memory_type != "host" or memory.strided or "host-fd" in memory.offered:
            return None
        return Offer()

    def grant_fds(self, export: Any) -> int:
        return 0

    def serve(self, export: Any, session: Any) -> Grant:
        """A cma lease: the share's memory, pinned for the lease, and the
        importer's process as the kernel gives it (lock held)."""
        if not session.local:
            raise UnsupportedError("cma needs a control connection over the exporter's Unix socket (this "
                                   "node, this user)")
        why = available()
        if why is not None:
            raise UnsupportedError(why)
        process = session.held.get(self.name)
        if process is None:
            # One per connection: every lease of this importer shares its
            # pidfd, so leases cost the exporter no descriptor.
            pid = peer_credentials(session.conn.sock)[0]
            check_access(pid)
            process = session.held[self.name] = Process(pid)
        pinned = _buffers.resolve(export.target(), writable=False)
        if pinned.nbytes < export.nbytes:
            pinned.release()
            raise UnsupportedError(f"the exported object is {pinned.nbytes} bytes now, not the {export.nbytes} it "
                                   "was when exported: export it again")
        return Grant({}, state=(pinned, process))

    def not_offered(self, share: Any) -> str | None:
        if share.strides is not None:
            return f"not {self.name}: the share is a strided array, which goes only where it is mapped"
        return None

    def facts(self, share: Share, near: bool) -> str | None:
        """Why this process cannot use cross-memory attach (asked on the exporter's node only)."""
        return available() if near else None

    def control_ops(self) -> dict[str, ControlOp]:
        return {OP: serve_copy}

    def stop(self) -> None:
        stop()

    def unavailable(self, share: Any, here: Here) -> str | None:
        if not same_node(share, here):
            return "exporter is on another node (or network namespace)"
        why_not = here.fact(self.name)
        return why_not if isinstance(why_not, str) else None

    def open(self, share: Any, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        no_fds(self.name, fds)
        if grant or lease is None or share.device != "host":
            raise InvalidInputError("exporter sent a malformed cma offer")
        return Opened(transport=CmaTransport(lease, how.part))  # the exporter copies, over the lease


PATH: Path = Cma()


def _items_of(msg: dict, parts: int | None) -> list[tuple[int | None, int, int, int]] | None:
    """The copies a cma request asks for, as (part, offset, n, address): one
    (``offset``, ``n``, ``addr`` and, for a bundle's lease, ``part``), or a
    batch (``items``: ``[offset, n, addr]`` or ``[offset, n, addr, part]``
    each, at most :data:`MAX_ITEMS`); None when malformed."""
    if "items" in msg:
        raw = msg["items"]
        if type(raw) not in (list, tuple) or not 0 < len(raw) <= MAX_ITEMS:
            return None
    else:
        raw = [[msg.get("offset"), msg.get("n"), msg.get("addr")] + ([msg.get("part")] if parts is not None else [])]
    want = 3 if parts is None else 4
    out = []
    for item in raw:
        if type(item) not in (list, tuple) or len(item) != want or not all(type(v) is int for v in item):
            return None
        offset, n, address = item[0], item[1], item[2]
        part = item[3] if parts is not None else None
        if not (0 <= offset < 1 << 62 and 0 < n < 1 << 62 and 0 < address < 1 << 64):
            return None
        if part is not None and not 0 <= part < parts:
            return None
        out.append((part, offset, n, address))
    return out


def serve_copy(session: Any, conn: Any, rid: Any, msg: dict) -> None:
    """An importer's get or put over its cma lease, or a batch of them over
    one lease (a bundle's allocations): every copy checked here (lease,
    bounds, read-only, revocation) before any runs, copied in order by the
    copy threads as one job, answered once when every byte has moved.  A
    batch counts as one of the connection's :data:`MAX_QUEUED` copies.
    ``session`` is the exporter's control session: its grants, its refusals
    and its count of queued copies."""
    lease = msg.get("lease")
    grant = session.grants.get(lease) if type(lease) is int else None
    export = session.leases.get(lease) if grant is not None else None
    if grant is None or export is None:
        session.refuse(conn, rid, "closed", "this connection holds no open cma lease by that id")
        return
    bundle = grant.parts is not None
    direction = msg.get("dir")
    items = _items_of(msg, len(grant.parts) if bundle else None)
    if direction not in ("get", "put") or items is None:
        session.refuse(conn, rid, "bad", "malformed cma request" + (
            " (a copy of a bundle names one of its allocations)" if bundle else ""))
        return
    copies = []
    for i, (part, offset, n, address) in enumerate(items):
        g, served = (grant.parts[part], export.parts[part]) if part is not None else (grant, export)
        entry = g.state if g is not None and g.path is PATH else None
        where = f"item {i}: " if len(items) > 1 else ""
        if entry is None:
            session.refuse(conn, rid, "closed", f"{where}this connection holds no open cma lease by that id"
                           + (f" for allocation {part}" if part is not None else ""))
            return
        pinned, process = entry
        if offset + n > min(served.nbytes, pinned.nbytes):
            session.refuse(conn, rid, "bounds", f"{where}{n} bytes at offset {offset} run past the shared "
                           f"{served.nbytes}")
            return
        if direction == "put" and served.readonly:
            session.refuse(conn, rid, "denied", "the share is read-only: the exporter refuses writes")
            return
        copies.append((pinned, process, offset, n, address))
    refusal = _refusal(session, export, lease)
    if refusal is not None:
        session.refuse(conn, rid, refusal, session.refusal_text(refusal, export.policy))
        return
    if not session.take_copy(MAX_QUEUED):
        session.refuse(conn, rid, "busy", f"this connection has {MAX_QUEUED} copies queued already")
        return
    runner = copier()

    def still() -> str | None:
        """Why the copy must stop now (checked before each piece), or None."""
        if conn.closed:
            return "the importer's connection closed"
        if runner.stopping:
            return "the exporter is exiting"
        why = _refusal(session, export, lease)
        return None if why is None else session.refusal_text(why, None)

    def job() -> None:  # holds each ``pinned``: the memory stays while the copies run
        i = 0
        try:
            for i, (pinned, process, offset, n, address) in enumerate(copies):
                copy(process, pinned.address + offset, address, n, into_remote=direction == "get", still=still)
            reply = {"id": rid, "ok": True}
        except ClosedError as exc:
            reply = {"id": rid, "ok": False, "code": "closed", "message": _item(i, len(copies), exc)}
        except GpuShareError as exc:
            reply = {"id": rid, "ok": False, "code": "copy", "message": _item(i, len(copies), exc)}
        finally:
            session.copy_done()
        conn.send(_control.pack(reply))

    runner.submit(job)


def _item(i: int, count: int, exc: BaseException) -> str:
    return (f"item {i} of {count}: " if count > 1 else "") + str(exc)[:300]


def _refusal(session: Any, export: Any, lease: int) -> str | None:
    """Why a copy over ``lease`` may not run now: the lease ended, or the
    share was revoked or retired (any thread)."""
    if lease not in session.grants:
        return "closed"
    with export.lock:
        return "revoked" if export.revoked else ("retired" if export.retired else None)


class CmaTransport:
    """A cma view's copies: each a request on the lease's control
    connection, which the exporter serves and answers."""

    host_only = True

    def __init__(self, lease: Any, part: int | None = None) -> None:
        self.lease = lease
        self.part = part  # a bundle's allocation, which each copy names
        self.batch_key = ("cma", id(lease))  # the lease's items travel together, whatever their allocation

    def start(self, direction: str, offset: int, local: Any) -> Any:
        """Ask the exporter to copy between the share and ``local`` (resolved
        and checked): a request (``local`` stays pinned until the copy ends),
        or ``None`` when there is nothing to copy."""
        if local.nbytes == 0:
            local.release()
            return None
        message = {"op": OP, "dir": direction, "offset": offset, "addr": local.address, "n": local.nbytes}
        if self.part is not None:
            message["part"] = self.part
        return Transfer(self.lease, self.lease.submit(message, keep=local), direction)

    def _move(self, direction: str, offset: int, buf: Any, timeout: float | None, span: Any) -> None:
        request = self.start(direction, offset, span(buf, offset, direction == "get")[0])
        if request is not None:
            request.wait(timeout)

    def get(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None:
        self._move("get", offset, buf, timeout, span)

    def put(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None:
        self._move("put", offset, buf, timeout, span)

    async def _move_async(self, direction: str, offset: int, buf: Any, span: Any) -> None:
        request = self.start(direction, offset, span(buf, offset, direction == "get")[0])
        if request is not None:
            await request

    async def get_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None:
        await self._move_async("get", offset, buf, span)

    async def put_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None:
        await self._move_async("put", offset, buf, span)

    def batch(self, items: list, direction: str) -> list:
        """The items of one lease (their transports share its key), as batch
        requests of at most :data:`MAX_ITEMS` copies each, sent
        :data:`WINDOW` at a time: one paced request."""
        messages: list[tuple[dict, list]] = []
        items_of: list = []
        kept: list = []
        for t, offset, buf in items:
            local = _buffers.resolve(buf, writable=direction == "get")
            if local.nbytes == 0:
                local.release()
                continue
            items_of.append([offset, local.nbytes, local.address] + ([t.part] if t.part is not None else []))
            kept.append(local)
            if len(items_of) == MAX_ITEMS:
                messages.append(({"op": OP, "dir": direction, "items": items_of}, kept))
                items_of, kept = [], []
        if items_of:
            messages.append(({"op": OP, "dir": direction, "items": items_of}, kept))
        lease = self.lease

        def sender(message: dict, kept: list) -> Callable[[], Transfer]:
            return lambda: Transfer(lease, lease.submit(message, keep=kept), direction)

        starts = [sender(message, kept) for message, kept in messages]
        return [Paced(starts, WINDOW, f"the exporter's {direction} of a batch")] if starts else []

    def close(self) -> None:
        pass  # the view's lease ends the exporter's side


class Transfer:
    """One cma copy asked of an exporter: ``wait(timeout)``, ``done()``,
    ``exception()`` and ``await``, as the other requests."""

    __slots__ = ("_direction", "_lease", "_pid", "_waiter")

    def __init__(self, lease: Any, waiter: Any, direction: str) -> None:
        self._lease = lease
        self._pid = lease.exporter_pid
        self._waiter = waiter
        self._direction = direction

    def done(self) -> bool:
        return self._waiter.event.is_set()

    def exception(self) -> BaseException | None:
        """The copy's error once it is done (``None`` if it succeeded or runs)."""
        if not self.done():
            return None
        reply = self._waiter.reply
        if reply is None:
            return self._lease.lost(f"the {self._direction}")
        if reply.get("ok") is True:
            return None
        code, message = reply.get("code"), str(reply.get("message", ""))[:300]
        if code in ("revoked", "retired", "closed"):
            return ClosedError(f"exporter refused the {self._direction}: {message}")
        if code == "bounds":
            return OutOfBoundsError(f"exporter refused the {self._direction}: {message}")
        if code == "denied":
            return AccessDeniedError(f"exporter refused the {self._direction}: {message}")
        if code == "bad":
            return InvalidInputError(f"exporter refused the {self._direction}: {message}")
        return GpuShareError(f"the exporter's {self._direction} failed: {message}")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the bytes have moved; raise the copy's error.

        Raises
        ------
        WaitTimeoutError
            If ``timeout`` seconds pass first; the copy stays in flight and
            its buffer in use until it ends.
        ExporterUnreachableError
            If the exporter stops answering (see :func:`gpushare._process.peer_timeout`).
        """
        if not wait_alive(self._waiter.event.wait, self._lease, timeout):
            raise WaitTimeoutError(f"the exporter's {self._direction} did not finish within {timeout} s; it stays "
                                   "in flight, and its buffer in use, until it ends")
        exc = self.exception()
        if exc is not None:
            raise exc

    def __await__(self) -> Any:
        import asyncio  # the stdlib's event loop, only for an awaited copy

        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))
            except RuntimeError:
                pass  # the event loop closed: nobody awaits this any more

        self._waiter.then(wake)
        yield from await_alive(future, self._lease).__await__()
        exc = self.exception()
        if exc is not None:
            raise exc
