"""Address ranges, each with a tag and a reference to what owns it, found by bisection: which
of an agent's memory handles registers a transfer's local buffer
(``gpushare._ucx.Agent._registration``, the tag its memory type), which buffer this process
allocated holds an array (``gpushare._paths.host_fd.containing``,
``gpushare._cuda.vmm.containing``), which allocation found so far holds a tensor of a tree being
exported (``gpushare._export_tree._Found``).  A batch of N buffers each in a range of its own (a
state dict registered or allocated tensor by tensor) costs O(N log N) to look up, where asking
every range cost O(N^2).

Ranges are kept in one list per size class (lengths of the same bit length), each sorted by
start: a range of class c is shorter than 2**c, so only the entries of that class that start
within 2**c before the end of what is looked up can hold it, and where ranges do not overlap
those are two or three.  A lookup costs a bisection per class present, however large or small
the ranges beside it.

Readers take no lock unless an addition overlaps their look: an addition inserts into its
class's list in place between two increments of a version number (odd while it is under way),
and a reader that sees the version odd, or changed by the end of its look, looks again under
the lock, so it never misses a range that was there before it began.  A pruning, or a class
seen for the first time, publishes new lists.  Each candidate found is for the caller to check
against its owner (a closed owner, or one whose address was reused, is the caller's to skip).
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._types import Regrowth

__all__ = ["Ranges"]

# (start, end, tag, reference to the owner: a weak one, or a function that returns it)
Entry = tuple[int, int, Any, Callable[[], Any]]


def _start(entry: Entry) -> int:
    return entry[0]


class Ranges:
    """The ranges added so far; those whose owner is gone, or no longer ``alive(owner)``, are
    pruned when the entries have doubled since the last pruning (:class:`Regrowth`), so adding
    costs O(1) amortized in Python (an insertion moves pointers in C) and they number at most
    about twice the most owners alive at once."""

    __slots__ = ("_alive", "_classes", "_count", "_pruning", "_version", "_lock", "__weakref__")

    def __init__(self, alive: Callable[[Any], bool]) -> None:
        self._alive = alive
        #: size class (bit length of the length) -> its entries, sorted by start
        self._classes: dict[int, list[Entry]] = {}
        self._count = 0
        self._pruning = Regrowth(16)
        self._version = 0
        self._lock = threading.Lock()
        _instances.add(self)

    def __len__(self) -> int:
        return self._count

    def add(self, start: int, end: int, tag: Any, ref: Callable[[], Any]) -> None:
        """Add the range ``[start, end)`` of the owner ``ref`` refers to."""
        entry = (start, end, tag, ref)
        size_class = (end - start).bit_length()
        held: list[Any] = []  # owners looked at by a pruning: let go after the lock
        with self._lock:
            self._version += 1  # odd: readers meanwhile look again under the lock
            try:
                classes = self._classes
                if self._pruning.due(self._count):
                    classes = {}
                    for c, entries in self._classes.items():
                        kept = []
                        for e in entries:
                            owner = e[3]()
                            if owner is not None and self._alive(owner):
                                kept.append(e)
                                held.append(owner)
                        if kept:
                            classes[c] = kept
                    self._pruning.kept = self._count = sum(map(len, classes.values()))
                if size_class not in classes:
                    classes = {**classes, size_class: []}
                bisect.insort_right(classes[size_class], entry, key=_start)
                self._classes = classes
                self._count += 1
            finally:
                self._version += 1
        del held

    def candidates(self, address: int, nbytes: int, tag: Any) -> list[Callable[[], Any]]:
        """References to the owners of the ranges with ``tag`` that hold ``[address, address +
        nbytes)``, the one that starts last first."""
        version = self._version
        if not version & 1:
            found = self._look(address, nbytes, tag)
            if self._version == version:
                return found
        with self._lock:
            return self._look(address, nbytes, tag)

    def _look(self, address: int, nbytes: int, tag: Any) -> list[Callable[[], Any]]:
        end = address + nbytes
        found = []
        for size_class, entries in list(self._classes.items()):
            last = bisect.bisect_right(entries, address, key=_start)
            first = bisect.bisect_left(entries, end - (1 << size_class), 0, last, key=_start)
            for i in range(last - 1, first - 1, -1):
                lo, hi, t, ref = entries[i]
                if end <= hi and t == tag:
                    found.append((lo, ref))
        if len(found) > 1:
            found.sort(key=_start, reverse=True)
        return [ref for _, ref in found]


#: Every Ranges of this process, for the fork handler below.
_instances: weakref.WeakSet[Ranges] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child: a lock another thread of the parent held at the fork stays held here
    for good; each Ranges gets a new one (the entries are whole: an insertion is one step)."""
    for ranges in list(_instances):
        ranges._lock = threading.Lock()
        ranges._version += ranges._version & 1


os.register_at_fork(after_in_child=_after_fork_in_child)
