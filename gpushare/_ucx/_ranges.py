"""The address ranges of an agent's memory handles, kept sorted by start, so that a transfer
finds the handle that registers its local buffer (``Agent._registration``) by bisection instead
of asking every handle: a batch of N buffers each registered by a handle of its own (a state
dict registered tensor by tensor) costs O(N log N), where it cost O(N^2).

Readers take no lock unless an addition overlaps their look: an addition inserts into the
sorted list in place between two increments of a version number (odd while it is under way),
and a reader that sees the version odd, or changed by the end of its look, looks again under
the lock, so it never misses a handle that was there before it began (a handle it misses would
not be held by the transfer: see ``MemoryHandle._covering`` and ``forTransfer``).  A pruning
publishes a new list.  Each candidate found is checked against its handle
(``MemoryHandle._covering``), so an entry of a closed or dropped handle is never used.

Ranges of at least :data:`LONG` bytes are kept apart, in a short list looked at whole: the
sorted list is searched only as far back as its longest range reaches, which one large
registration (an arena) would otherwise stretch over every entry.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Ranges", "LONG"]

#: Ranges at least this long are looked at whole rather than by bisection.
LONG = 64 << 20

# (start, end, memory type, weak reference to the handle)
Entry = tuple[int, int, str, Callable[[], Any]]


def _start(entry: Entry) -> int:
    return entry[0]


def _live(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if (h := e[3]()) is not None and not h.closed]


class Ranges:
    """The entries of the handles made so far; those of closed or dropped handles are pruned
    when the entries have grown past twice what the last pruning kept (plus 16), so adding
    costs O(1) amortized in Python (an insertion moves pointers in C) and they number at most
    about twice the most handles open at once."""

    __slots__ = ("_entries", "_long", "_longest", "_kept", "_version", "_lock")

    def __init__(self) -> None:
        self._entries: list[Entry] = []  # shorter than LONG, sorted by start
        self._long: list[Entry] = []  # at least LONG
        #: The longest range in _entries: no entry that starts further before an address holds it.
        self._longest = 0
        self._kept = 0
        self._version = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries) + len(self._long)

    def add(self, start: int, end: int, memory_type: str, ref: Callable[[], Any]) -> None:
        """Add a handle's range."""
        entry = (start, end, memory_type, ref)
        with self._lock:
            self._version += 1  # odd: readers meanwhile look again under the lock
            try:
                if len(self) > 2 * self._kept + 16:
                    self._entries, self._long = _live(self._entries), _live(self._long)
                    self._kept = len(self)
                    self._longest = max((e[1] - e[0] for e in self._entries), default=0)
                if end - start >= LONG:
                    self._long = [*self._long, entry]
                else:
                    self._longest = max(self._longest, end - start)
                    bisect.insort_right(self._entries, entry, key=_start)
            finally:
                self._version += 1

    def candidates(self, address: int, nbytes: int, memory_type: str) -> list[Callable[[], Any]]:
        """References to the handles whose ranges hold ``[address, address + nbytes)`` as
        ``memory_type`` memory: of the sorted ranges, the one that starts last first (only
        those that start within the longest sorted range's length before the end are looked
        at), then the long ones."""
        version = self._version
        if not version & 1:
            found = self._look(address, nbytes, memory_type)
            if self._version == version:
                return found
        with self._lock:
            return self._look(address, nbytes, memory_type)

    def _look(self, address: int, nbytes: int, memory_type: str) -> list[Callable[[], Any]]:
        entries, longest, long_ = self._entries, self._longest, self._long
        end = address + nbytes
        last = bisect.bisect_right(entries, address, key=_start)
        first = bisect.bisect_left(entries, end - longest, 0, last, key=_start)
        found = []
        for i in range(last - 1, first - 1, -1):
            _, hi, mtype, ref = entries[i]
            if end <= hi and mtype == memory_type:
                found.append(ref)
        for lo, hi, mtype, ref in long_:
            if lo <= address and end <= hi and mtype == memory_type:
                found.append(ref)
        return found
