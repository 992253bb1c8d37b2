"""What keeps an open view's memory and lease: :class:`MappingUse` counts
the users of a mapping (the view and every DLPack tensor made from it) and
unmaps it when the last lets go; a view's lease ends once, with the view or
with its bundle."""

from __future__ import annotations

import threading
import warnings
from typing import Any

from ._errors import ClosedError, GpuShareError

__all__ = ["MappingUse"]


class MappingUse:
    """Who still uses a view's mapping: the view itself and every DLPack
    tensor made from it.  The mapping is unmapped when the last of them lets
    go, never under a live array."""

    __slots__ = ("mapped", "users", "lock")

    def __init__(self, mapped: Any) -> None:
        self.mapped = mapped
        self.users = 1  # the view
        self.lock = threading.Lock()

    def acquire(self) -> None:
        with self.lock:
            if self.mapped is None:
                raise ClosedError("view is closed")
            self.users += 1

    def acquire_many(self, n: int) -> None:
        """:meth:`acquire` ``n`` times at once."""
        with self.lock:
            if self.mapped is None:
                raise ClosedError("view is closed")
            self.users += n

    def forget_in_child(self) -> None:
        """In a forked child: drop the parent's count (a thread of the parent
        may have held the lock at the fork: a new one)."""
        self.lock = threading.Lock()
        self.drop()

    def drop(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users > 0 or self.mapped is None:
                return
            mapped, self.mapped = self.mapped, None
        try:
            mapped.close()
        except BufferError:
            pass  # host arrays still use the mapping: it goes with the last of them
        except GpuShareError as exc:
            warnings.warn(f"unmapping a view failed; leaking it: {exc}", ResourceWarning, 2)


class _Pin:
    """Held by a DLPack tensor made from a view: the mapping lives while it does."""

    __slots__ = ("__weakref__",)


#: The lease of a bundle's view: none (the bundle holds the one lease).
_NO_LEASE: tuple = ()


def _end_lease(lease: list | tuple) -> None:
    """End the view's lease: the exporter revokes what it granted (a ucx-rma
    view's key stops working at once)."""
    if type(lease) is not list:
        return  # a bundle's view: its bundle ends the lease
    for held in lease:
        held.close()
    lease.clear()


class _Once:
    """What :func:`weakref.finalize` is to a view, for a view its bundle keeps
    (and closes): drops the view's use of the mapping once."""

    __slots__ = ("use",)

    def __init__(self, use: MappingUse) -> None:
        self.use: MappingUse | None = use

    @property
    def alive(self) -> bool:
        return self.use is not None

    def __call__(self) -> None:
        use, self.use = self.use, None
        if use is not None:
            use.drop()


def _release_view(use: MappingUse | None, lease: list | tuple) -> None:
    _end_lease(lease)
    if use is not None:
        use.drop()
