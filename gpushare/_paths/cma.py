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
from typing import Any

from .._errors import AccessDeniedError, ClosedError, InvalidInputError, UnsupportedError

__all__ = ["available", "check_access", "copy", "copier"]

log = logging.getLogger("gpushare")

#: Bytes the exporter moves per system call.  Before each piece the copy
#: checks that it may still go on (the connection open, the lease held, the
#: share not revoked, the importer the same process): a revocation or a
#: closed connection stops a copy within one piece (about a millisecond).
PIECE = 8 << 20
#: Copies an importer's connection may have queued or running at once.
MAX_QUEUED = 64


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
    os.close(fd)


class Process:
    """An importer's process, as the kernel knows it: its pid and a pidfd,
    which tells whether that very process still runs (a pid may be reused
    once it has exited; a pidfd never refers to another process)."""

    __slots__ = ("fd", "pid")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            raise ClosedError(f"process {pid} has exited") from None
        except (OSError, AttributeError):
            self.fd = None  # a kernel before 5.3: the pid alone

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
