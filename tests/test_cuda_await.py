"""Awaiting queued CUDA work (``gpushare._cuda._await``): the loop wakes when
the host function queued after the work writes to the process's eventfd,
without polling; the slow poll covers a driver that runs it late."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from gpushare._cuda import _await

from _procs import in_threads


@pytest.fixture
def no_poll(monkeypatch):
    """The fallback poll an hour away: only the eventfd can wake a waiter."""
    monkeypatch.setattr(_await, "_POLL_FIRST", 3600.0)


def _later(fd: int, flag: list[bool], delay: float = 0.05) -> None:
    """What the driver's host function does once the work is complete, from a thread of its own."""

    def run() -> None:
        time.sleep(delay)
        flag.append(True)
        os.eventfd_write(fd, 1)

    threading.Thread(target=run, daemon=True).start()


def test_the_eventfd_wakes_a_waiter_without_the_poll(no_poll):
    flag: list[bool] = []

    async def main() -> None:
        await asyncio.wait_for(_await.until(lambda: bool(flag), lambda fd: _later(fd, flag)), 10)

    asyncio.run(main())
    assert flag == [True]


def test_waiters_whose_work_is_not_done_stay_asleep(no_poll):
    first: list[bool] = []
    second: list[bool] = []

    async def main() -> None:
        a = asyncio.ensure_future(_await.until(lambda: bool(first), lambda fd: _later(fd, first, 0.02)))
        b = asyncio.ensure_future(_await.until(lambda: bool(second), lambda fd: None))
        await asyncio.wait_for(a, 10)
        assert not b.done()  # woken, looked, and waiting on
        second.append(True)
        os.eventfd_write(_await._by_loop[asyncio.get_running_loop()].fd, 1)
        await asyncio.wait_for(b, 10)
        assert not _await._by_loop[asyncio.get_running_loop()].items  # nothing left behind

    asyncio.run(main())


def test_loops_in_two_threads_each_wake_on_their_own(no_poll):
    flags: list[list[bool]] = [[], []]

    def run(i: int) -> None:
        asyncio.run(asyncio.wait_for(_await.until(lambda: bool(flags[i]), lambda fd: _later(fd, flags[i])), 10))

    errors = in_threads([lambda i=i: run(i) for i in range(2)], 30)
    assert not errors and flags == [[True], [True]]


def test_the_poll_finds_work_a_late_driver_never_announces():
    flag: list[bool] = []

    def announce_nothing(fd: int) -> None:
        threading.Timer(0.02, lambda: flag.append(True)).start()

    asyncio.run(asyncio.wait_for(_await.until(lambda: bool(flag), announce_nothing), 10))
    assert flag == [True]


def test_a_failed_notify_and_a_cancelled_wait_leave_no_waiter(no_poll):
    class Refused(Exception):
        pass

    def refuse(fd: int) -> None:
        raise Refused

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(Refused):
            await _await.until(lambda: False, refuse)
        task = asyncio.ensure_future(_await.until(lambda: False, lambda fd: None))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not _await._by_loop[loop].items

    asyncio.run(main())


def test_work_done_before_the_wait_costs_no_notify():
    calls: list[int] = []
    asyncio.run(_await.until(lambda: True, calls.append))
    assert calls == []


def test_a_gone_loops_eventfd_serves_the_next_loop():
    import gc

    async def fd_of_this_loop() -> int:
        return _await._waiters(asyncio.get_running_loop()).fd

    fds = set()
    for _ in range(20):
        fds.add(asyncio.run(fd_of_this_loop()))
        gc.collect()
    assert len(fds) <= 3, fds  # not one per loop (those of loops gone before this test may serve too)


def test_a_done_that_raises_is_raised_by_the_waiter(no_poll):
    """Asked in the loop's callback (woken by the eventfd), ``done`` raises: the waiting task
    raises it, and the loop's other waiters are still served."""
    calls: list[int] = []
    other: list[bool] = []

    def done() -> bool:
        calls.append(1)
        if len(calls) > 2:  # not the two looks made in the task itself: the one the eventfd wakes
            raise RuntimeError("the work failed")
        return False

    async def main() -> None:
        a = asyncio.ensure_future(_await.until(done, lambda fd: _later(fd, [])))
        b = asyncio.ensure_future(_await.until(lambda: bool(other), lambda fd: _later(fd, other, 0.1)))
        with pytest.raises(RuntimeError, match="the work failed"):
            await asyncio.wait_for(a, 10)
        await asyncio.wait_for(b, 10)

    asyncio.run(main())
