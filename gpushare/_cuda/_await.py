"""Awaiting queued CUDA work without polling it: a host function queued
after the work adds 1 to an eventfd of this process, which every event loop
awaiting such work reads (``loop.add_reader``); on each wake-up a loop looks
which of its waiters' work is complete and wakes those.

One eventfd per process, never closed (a host function queued before a
close would write into whatever took its number), and none per wait.  A
driver may run a host function late (the driver stand-in runs queued work
only when asked): a slow poll, from 1 ms doubling to 50 ms, asks each
waiter's ``done`` too.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["until"]

#: The fallback poll's first and longest interval, in seconds.
_POLL_FIRST, _POLL_LONGEST = 1e-3, 5e-2

_lock = threading.Lock()
_fd = -1
_fd_pid = 0


def _eventfd() -> int:
    """This process's eventfd (a forked child makes its own)."""
    global _fd, _fd_pid
    with _lock:
        if _fd_pid != os.getpid():
            _fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            _fd_pid = os.getpid()
        return _fd


class _Waiters:
    """One event loop's waiters: futures and how to tell their work done."""

    __slots__ = ("fd", "items", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.fd = fd
        self.items: dict[asyncio.Future, Callable[[], bool]] = {}
        loop.add_reader(fd, self.woken)

    def woken(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass  # another loop read it first: look all the same
        for fut, done in list(self.items.items()):
            if fut.done():
                self.items.pop(fut, None)
            elif done():
                self.items.pop(fut, None)
                fut.set_result(None)


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waiters] = weakref.WeakKeyDictionary()


def _waiters(loop: asyncio.AbstractEventLoop) -> _Waiters:
    fd = _eventfd()
    waiters = _by_loop.get(loop)
    if waiters is None or waiters.fd != fd:
        waiters = _by_loop[loop] = _Waiters(loop, fd)
    return waiters


async def until(done: Callable[[], bool], notify: Callable[[int], Any]) -> None:
    """Return once ``done()`` is true.  ``notify(fd)`` queues, after the
    awaited work, a host function that adds 1 to eventfd ``fd``."""
    if done():
        return
    loop = asyncio.get_running_loop()
    waiters = _waiters(loop)
    fut = loop.create_future()
    waiters.items[fut] = done
    delay = _POLL_FIRST
    handle: asyncio.TimerHandle | None = None

    def poll() -> None:
        nonlocal delay, handle
        if fut.done():
            return
        if done():
            fut.set_result(None)
            return
        delay = min(delay * 2, _POLL_LONGEST)
        handle = loop.call_later(delay, poll)

    try:
        notify(waiters.fd)
        if done():  # complete before the host function was queued
            return
        handle = loop.call_later(delay, poll)
        await fut
    finally:
        if handle is not None:
            handle.cancel()
        waiters.items.pop(fut, None)
