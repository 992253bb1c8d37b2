"""One service object per process: made on first use, stopped at exit, made
anew in a forked child (which never touches its parent's)."""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerProcess", "process_state"]

T = TypeVar("T")


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
    """

    def __init__(self, make: Callable[[], T], *, stop: Callable[[T], None],
                 abandon: Callable[[T], None]) -> None:
        self._make, self._stop, self._abandon = make, stop, abandon
        self._lock = threading.Lock()
        self._obj: T | None = None
        self._pid = 0
        self._hooks = False

    def get(self) -> T:
        """This process's instance, made now if there is none."""
        with self._lock:
            if self._obj is not None and self._pid != os.getpid():
                self._abandon(self._obj)
                self._obj = None
            if self._obj is None:
                self._obj = self._make()
                self._pid = os.getpid()
            if not self._hooks:
                atexit.register(self._at_exit)
                os.register_at_fork(after_in_child=self._after_fork)
                self._hooks = True
            return self._obj

    def current(self) -> T | None:
        """This process's instance if one was made, without making one."""
        obj = self._obj
        return obj if obj is not None and self._pid == os.getpid() else None

    def _at_exit(self) -> None:
        obj = self.current()
        if obj is not None:
            self._stop(obj)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # it may have been held by a thread that did not survive
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
