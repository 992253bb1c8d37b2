"""How a channel waits: on its connection and, on one node, on a pidfd of
the peer, in ``poll`` or the asyncio loop; and what a peer's end means."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import socket
import threading
import time
from typing import Any

from .._paths.broker import peer_credentials
from .._process import QUIET

__all__ = ["EXIT_SHOWS"]



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
