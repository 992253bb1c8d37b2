"""Facts about processes and nodes, below everything else.

- :class:`PerProcess`: one service object per process, made on first use,
  stopped at exit, made anew in a forked child (which never touches its
  parent's).
- :func:`node_identity`, :func:`node_key`, :func:`check_same_node`: what
  "the same node" means.
- :func:`process_state`, :func:`peer_timeout`, :func:`wait_alive`,
  :func:`await_alive`, :class:`Stopped`: whether a peer still answers.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ._errors import ClosedError, ExporterUnreachableError, InvalidInputError, UnsupportedError

__all__ = ["QUIET", "PerProcess", "Stopped", "await_alive", "check_same_node", "node_identity", "node_key",
           "peer_timeout", "process_state", "state_of", "wait_alive"]

T = TypeVar("T")

#: Seconds the exit hook of a :class:`PerProcess` waits for a make under way
#: in another thread (loading UCX takes well under one) before it gives up.
EXIT_WAIT = 10.0


class PerProcess(Generic[T]):
    """Holds this process's instance of a service.

    Parameters
    ----------
    make
        Builds the service (starting its threads, sockets...).
    stop
        Stops it cleanly; called at interpreter exit in the process that made it.
    abandon
        Called in a forked child on the parent's instance: drop what the child
        inherited (a listening socket) without touching the parent's threads.

    The exit hook is in place before the first make begins, and waits for a
    make still under way in another thread (a background warm-up), at most
    :data:`EXIT_WAIT` seconds, to stop what it made: no thread of the
    service outlives the interpreter.  Once the hook has run, :meth:`get`
    raises :class:`ClosedError` rather than make a service nobody would stop.
    """

    def __init__(self, make: Callable[[], T], *, stop: Callable[[T], None],
                 abandon: Callable[[T], None]) -> None:
        self._make, self._stop, self._abandon = make, stop, abandon
        self._lock = threading.Lock()
        self._obj: T | None = None
        self._pid = 0
        self._hooks = False
        self._exited = False

    def get(self) -> T:
        """This process's instance, made now if there is none."""
        with self._lock:
            if self._obj is not None and self._pid != os.getpid():
                self._abandon(self._obj)
                self._obj = None
            if self._exited:
                raise ClosedError("the process is exiting: its gpushare services are stopped")
            if not self._hooks:
                # Before the make: an exit during it still stops what it makes.
                atexit.register(self._at_exit)
                os.register_at_fork(after_in_child=self._after_fork)
                self._hooks = True
            if self._obj is None:
                self._obj = self._make()
                self._pid = os.getpid()
            return self._obj

    def current(self) -> T | None:
        """This process's instance if one was made, without making one."""
        obj = self._obj
        return obj if obj is not None and self._pid == os.getpid() else None

    def _at_exit(self) -> None:
        # A make under way holds the lock: let it finish (bounded), then stop
        # what it made; no make begins afterwards.
        got = self._lock.acquire(timeout=EXIT_WAIT)
        try:
            self._exited = True
            obj = self.current()
        finally:
            if got:
                self._lock.release()
        if obj is not None:
            self._stop(obj)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # it may have been held by a thread that did not survive
        self._exited = False
        if self._obj is not None:
            self._abandon(self._obj)
            self._obj = None


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process ``pid`` on this node (``"R"``,
    ``"S"``, ``"T"`` stopped by a signal, ``"t"`` by a debugger, ``"Z"``
    exited and not yet reaped...): ``None`` when there is no such process,
    ``""`` when its state cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    fields = data.rsplit(b")", 1)[-1].split()
    return fields[0].decode("ascii", "replace") if fields else ""


# ---------------------------------------------------------------- nodes


@functools.cache
def node_identity() -> str:
    """This node's identity: the kernel boot id and the host name (read once)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{boot_id}:{socket.gethostname()}"


@functools.cache
def node_key() -> str:
    """What "same node" means for the mapped paths: the same kernel boot, host
    name and network namespace (the fd broker's socket lives in the latter)."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{node_identity()}:netns={netns}"


def check_same_node(desc: Any) -> None:
    """Refuse a same-node descriptor (``desc.node``) made on another node."""
    here = node_identity()
    if desc.node != here:
        raise UnsupportedError(
            f"the buffer was exported on node {desc.node!r}; this is {here!r}; "
            "posix-fd sharing works only on the same node"
        )


# ---------------------------------------------------------------- liveness of a peer

#: Seconds of silence from an exporter, while a transfer waits on it, after
#: which the importer asks it for a sign of life (a ``ping``).
QUIET = 1.0


def peer_timeout() -> float:
    """Seconds an exporter may leave a ping unanswered before a waiting
    transfer gives up on it as stopped, frozen or cut off
    (``GPUSHARE_PEER_TIMEOUT``, default 3)."""
    value = os.environ.get("GPUSHARE_PEER_TIMEOUT", "3")
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidInputError(f"GPUSHARE_PEER_TIMEOUT is {value!r}; expected seconds") from None
    if not 0 < seconds < 1e6:
        raise InvalidInputError(f"GPUSHARE_PEER_TIMEOUT is {value!r}; expected a positive number of seconds")
    return seconds


def wait_alive(wait: Callable[[float | None], bool], link: Any, timeout: float | None) -> bool:
    """``wait(seconds)`` until it returns True, at most ``timeout`` seconds
    (None: no limit); False when they pass.  Every second of waiting, ask
    ``link`` (a lease or control link, or None) whether the exporter still
    answers: its :class:`ExporterUnreachableError` ends the wait."""
    if wait(min(QUIET, timeout) if timeout is not None else QUIET):
        return True
    deadline = None if timeout is None else time.monotonic() + timeout - QUIET
    while True:
        if link is not None:
            link.check_alive()
        step = QUIET if deadline is None else min(QUIET, deadline - time.monotonic())
        if step <= 0:
            return False
        if wait(step):
            return True


async def await_alive(awaitable: Any, link: Any) -> Any:
    """Await ``awaitable``, asking ``link.check_alive()`` after each second of
    waiting, as :func:`wait_alive` does for threads."""
    import asyncio

    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=QUIET)
        if done:
            return task.result()
        if link is not None:
            try:
                link.check_alive()
            except BaseException:
                task.cancel()  # the transfer itself stays in flight, its buffer held
                raise


class Stopped:
    """For a wait on an exporter on this node: ends it when the exporting
    process is stopped by a signal or has exited (its state in /proc), so
    that a frozen exporter is reported at once, not at the timeout."""

    __slots__ = ("node", "pid")

    def __init__(self, pid: int, node: str) -> None:
        self.pid, self.node = pid, node

    def check_alive(self) -> None:
        state = state_of(self.pid, self.node)
        if state and "waits in the kernel" not in state:
            raise ExporterUnreachableError(f"the exporter (pid {self.pid}) does not answer{state}")

    __call__ = check_alive


def state_of(pid: int, node: str) -> str:
    """ " (it is stopped by a signal)" and the like, for an exporter on this
    node whose state says why it is silent; else ""."""
    if node != node_key():
        return ""
    state = process_state(pid)
    if state is None:
        return " (it has exited)"
    return {"T": " (it is stopped by a signal)", "t": " (it is stopped by a debugger)",
            "Z": " (it has exited)", "X": " (it has exited)", "D": " (it waits in the kernel)"}.get(state, "")
