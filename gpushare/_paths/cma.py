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
import threading
from collections.abc import Callable
from typing import Any

from .._errors import AccessDeniedError, ClosedError, InvalidInputError, UnsupportedError

__all__ = ["available", "check_access", "copy", "copier"]

log = logging.getLogger("gpushare")

#: Copies up to this size run on the service thread (tens of microseconds);
#: larger ones on the copy threads, so the control channel keeps answering
#: and two large copies run at once.
INLINE = 1 << 20

#: Bytes the exporter moves per system call (the kernel pins the pages of
#: each call; bounded pieces keep one transfer from pinning gigabytes).
PIECE = 64 << 20


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


def copy(pid: int, local: int, remote: int, n: int, *, into_remote: bool) -> None:
    """Copy ``n`` bytes between ``local`` (this process) and ``remote`` (in
    process ``pid``): into the remote process for an importer's get, out of
    it for a put.  Raises :class:`InvalidInputError` for an address the
    remote process does not have mapped (or not writable), and
    :class:`AccessDeniedError` / :class:`ClosedError` as :func:`check_access`."""
    libc = _calls()
    fn = libc.process_vm_writev if into_remote else libc.process_vm_readv
    done = 0
    while done < n:
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
    shares and importers.  Copies larger than :data:`INLINE` run here, not
    on the service thread, so they do not hold up the control channel.
    Daemon threads: a copy that never ends does not hold up the
    interpreter's exit."""

    THREADS = 2

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(self.THREADS):
            threading.Thread(target=self._run, name=f"gpushare-cma-{i}", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job()
            except BaseException:  # noqa: BLE001 - a job reports its own errors; the thread goes on
                log.exception("a cma copy job failed")
            del job


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
