"""The address ranges of an agent's memory handles, kept sorted by start, so that a transfer
finds the handle that registers its local buffer (``Agent._registration``) by bisection instead
of asking every handle: a batch of N buffers each registered by a handle of its own (a state
dict registered tensor by tensor) costs O(N log N), where it cost O(N^2).

Readers take no lock.  An addition inserts into the one sorted list in place (a reader that
meets it may miss the handle being added, or see an entry twice), and a pruning publishes a
new list, so a reader's indices stay inside the list it holds.  A handle missed is no error:
the transfer registers its buffer for itself, as for any unregistered buffer.  Each candidate
found is checked against its handle (``MemoryHandle._covering``), so an entry of a closed or
dropped handle is never used.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Ranges"]

# (start, end, memory type, weak reference to the handle)
Entry = tuple[int, int, str, Callable[[], Any]]


def _start(entry: Entry) -> int:
    return entry[0]


class Ranges:
    """The entries of the handles made so far, sorted by start; those of closed or dropped
    handles are pruned when the list has grown past twice what its last pruning kept (plus
    16), so adding costs O(1) amortized in Python (an insertion moves pointers in C) and the
    list holds at most about twice the most handles open at once."""

    __slots__ = ("_entries", "_longest", "_kept")

    def __init__(self) -> None:
        self._entries: list[Entry] = []
        #: The longest range's length: no entry that starts further before an address holds it.
        self._longest = 0
        self._kept = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, start: int, end: int, memory_type: str, ref: Callable[[], Any]) -> None:
        """Add a handle's range; the caller serialises additions (the agent's lock)."""
        entries = self._entries
        if len(entries) > 2 * self._kept + 16:
            entries = [e for e in entries if (h := e[3]()) is not None and not h.closed]
            self._kept = len(entries)
            self._longest = max((e[1] - e[0] for e in entries), default=0)
        self._longest = max(self._longest, end - start)  # before the entry: a reader never misses it for this
        bisect.insort_right(entries, (start, end, memory_type, ref), key=_start)
        self._entries = entries

    def candidates(self, address: int, nbytes: int, memory_type: str) -> Iterator[Callable[[], Any]]:
        """References to the handles whose ranges hold ``[address, address + nbytes)`` as
        ``memory_type`` memory, the one that starts last first.  Only entries that start within
        the longest range's length before the end are looked at: where ranges do not overlap,
        one or two."""
        entries, longest = self._entries, self._longest
        end = address + nbytes
        last = bisect.bisect_right(entries, address, key=_start)
        first = bisect.bisect_left(entries, end - longest, 0, last, key=_start)
        for i in range(last - 1, first - 1, -1):
            _, hi, mtype, ref = entries[i]
            if end <= hi and mtype == memory_type:
                yield ref
