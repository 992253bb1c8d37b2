"""Awaiting queued CUDA work without polling it: a host function queued
after the work adds 1 to the eventfd of the event loop awaiting it, which
the loop reads (``loop.add_reader``); on each wake-up the loop looks which of
its waiters' work is complete and wakes those.

One eventfd per event loop (a loop that shared one with others could miss
its wake-up when another read it first), none per wait, and never closed: a
host function queued before a close would write into whatever took its
number.  The eventfd of a loop that is gone serves the next loop (a late
host function then wakes that loop once for nothing).  A driver may run a
host function late (the driver stand-in runs queued work only when asked):
a slow poll, from 1 ms doubling to 10 ms, asks each waiter's ``done`` too
(also for a wake-up that found the work's state locked by another thread).
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
_POLL_FIRST, _POLL_LONGEST = 1e-3, 1e-2

_lock = threading.Lock()
#: Eventfds of loops that are gone, for the next loops (this process's).
_free: list[int] = []
_free_pid = 0


def _take_eventfd() -> int:
    global _free_pid
    with _lock:
        if _free_pid != os.getpid():  # a forked child: the parent's are not its own
            _free.clear()
            _free_pid = os.getpid()
        if _free:
            return _free.pop()
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def _give_back(fd: int, pid: int) -> None:
    with _lock:
        if pid == os.getpid() == _free_pid:
            _free.append(fd)


class _Waiters:
    """One event loop's waiters (futures and how to tell their work done),
    and its eventfd."""

    __slots__ = ("fd", "items", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = _take_eventfd()
        self.items: dict[asyncio.Future, Callable[[], bool]] = {}
        weakref.finalize(self, _give_back, self.fd, os.getpid())
        try:
            loop.add_reader(self.fd, self.woken)
        except NotImplementedError:  # a loop that watches no fds: its waiters have the poll alone
            pass

    def woken(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        for fut, done in list(self.items.items()):
            if fut.done() or _settle(fut, done):
                self.items.pop(fut, None)


def _settle(fut: asyncio.Future, done: Callable[[], bool]) -> bool:
    """Whether ``done()`` says the work is complete, and if so give ``fut`` its result; a
    ``done`` that raises gives ``fut`` its exception (raised by the awaiting task, never in the
    loop's callbacks, where it would leave the task waiting)."""
    try:
        if not done():
            return False
    except Exception as exc:  # noqa: BLE001 - the awaiting task raises it
        fut.set_exception(exc)
        return True
    fut.set_result(None)
    return True


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waiters] = weakref.WeakKeyDictionary()


def _waiters(loop: asyncio.AbstractEventLoop) -> _Waiters:
    waiters = _by_loop.get(loop)
    if waiters is None:
        waiters = _by_loop[loop] = _Waiters(loop)
    return waiters


async def until(done: Callable[[], bool], notify: Callable[[int], Any]) -> None:
    """Return once ``done()`` is true, or raise what it raised.  ``notify(fd)`` queues, after
    the awaited work, a host function that adds 1 to eventfd ``fd``."""
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
        if fut.done() or _settle(fut, done):
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
