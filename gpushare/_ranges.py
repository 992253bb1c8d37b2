"""Address ranges kept sorted by start, each with a tag and a weak reference to what owns it,
found by bisection: which of an agent's memory handles registers a transfer's local buffer
(``gpushare._ucx.Agent._registration``, the tag its memory type), which buffer this process
allocated holds an array (``gpushare._paths.host_fd.containing``,
``gpushare._cuda.vmm.containing``).  A batch of N buffers each in a range of its own (a state
dict registered or allocated tensor by tensor) costs O(N log N) to look up, where asking every
range cost O(N^2).

Readers take no lock unless an addition overlaps their look: an addition inserts into the
sorted list in place between two increments of a version number (odd while it is under way),
and a reader that sees the version odd, or changed by the end of its look, looks again under
the lock, so it never misses a range that was there before it began.  A pruning publishes a new
list.  Each candidate found is for the caller to check against its owner (a closed owner, or
one whose address was reused, is the caller's to skip).

Ranges of at least :data:`LONG` bytes are kept apart, in a short list looked at whole: the
sorted list is searched only as far back as its longest range reaches, which one large range
(an arena) would otherwise stretch over every entry.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Ranges", "LONG"]

#: Ranges at least this long are looked at whole rather than by bisection.
LONG = 64 << 20

# (start, end, tag, weak reference to the owner)
Entry = tuple[int, int, Any, Callable[[], Any]]


def _start(entry: Entry) -> int:
    return entry[0]


class Ranges:
    """The ranges added so far; those whose owner is gone, or no longer ``alive(owner)``, are
    pruned when the entries have grown past twice what the last pruning kept (plus 16), so
    adding costs O(1) amortized in Python (an insertion moves pointers in C) and they number at
    most about twice the most owners alive at once."""

    __slots__ = ("_alive", "_entries", "_long", "_longest", "_kept", "_version", "_lock")

    def __init__(self, alive: Callable[[Any], bool]) -> None:
        self._alive = alive
        self._entries: list[Entry] = []  # shorter than LONG, sorted by start
        self._long: list[Entry] = []  # at least LONG
        #: The longest range in _entries: no entry that starts further before an address holds it.
        self._longest = 0
        self._kept = 0
        self._version = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries) + len(self._long)

    def _live(self, entries: list[Entry]) -> list[Entry]:
        return [e for e in entries if (owner := e[3]()) is not None and self._alive(owner)]

    def add(self, start: int, end: int, tag: Any, ref: Callable[[], Any]) -> None:
        """Add the range ``[start, end)`` of the owner ``ref`` refers to."""
        entry = (start, end, tag, ref)
        with self._lock:
            self._version += 1  # odd: readers meanwhile look again under the lock
            try:
                if len(self) > 2 * self._kept + 16:
                    self._entries, self._long = self._live(self._entries), self._live(self._long)
                    self._kept = len(self)
                    self._longest = max((e[1] - e[0] for e in self._entries), default=0)
                if end - start >= LONG:
                    self._long = [*self._long, entry]
                else:
                    self._longest = max(self._longest, end - start)
                    bisect.insort_right(self._entries, entry, key=_start)
            finally:
                self._version += 1

    def candidates(self, address: int, nbytes: int, tag: Any) -> list[Callable[[], Any]]:
        """References to the owners of the ranges with ``tag`` that hold ``[address, address +
        nbytes)``: of the sorted ranges, the one that starts last first (only those that start
        within the longest sorted range's length before the end are looked at), then the long
        ones."""
        version = self._version
        if not version & 1:
            found = self._look(address, nbytes, tag)
            if self._version == version:
                return found
        with self._lock:
            return self._look(address, nbytes, tag)

    def _look(self, address: int, nbytes: int, tag: Any) -> list[Callable[[], Any]]:
        entries, longest, long_ = self._entries, self._longest, self._long
        end = address + nbytes
        last = bisect.bisect_right(entries, address, key=_start)
        first = bisect.bisect_left(entries, end - longest, 0, last, key=_start)
        found = []
        for i in range(last - 1, first - 1, -1):
            _, hi, t, ref = entries[i]
            if end <= hi and t == tag:
                found.append(ref)
        for lo, hi, t, ref in long_:
            if lo <= address and end <= hi and t == tag:
                found.append(ref)
        return found
