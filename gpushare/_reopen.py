"""Reopening a share without a round trip to its exporter.

A view of a ``lifetime="revoked"`` share mapped on a path whose mapping
holds the memory itself (host-fd) gives the exporter nothing to take back
when it closes: the share lives until ``share.revoke()``.  So when such a
view closes, the importer keeps its lease and its mapping for
:data:`KEEP_FOR` seconds (at most :data:`MAX_KEPT` per exporter), and a
further ``gpushare.open`` of the same share in that time makes a new view
over them with no message at all.

What it must not do is open a share that was revoked.  The exporter keeps
a *state page*: a memfd of :data:`SLOTS` 8-byte words, one per such share,
holding a number (its epoch) while the share lives and another (zero) from
the moment it ends (written under the export's lock, before
``share.revoke()`` returns).  Importers on the node get the page once per
control connection, read-only and sealed, and a reopen first reads the
share's word: if it changed, the kept lease is given back and the open
asks the exporter, which refuses it.  A slot given to another share later
carries another epoch.

This module holds both sides: :class:`StatePage` (the exporter's) and
:class:`PageReader` and :class:`Kept` (an importer's, per connection).
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ._errors import InvalidInputError
from ._memory import check_memfd

__all__ = ["StatePage", "PageReader", "Kept", "SLOTS", "PAGE_BYTES", "KEEP_FOR", "MAX_KEPT", "check_keep"]

#: Shares one exporter process tracks on its state page at once (beyond
#: them, views of further shares are not kept: they reopen with a round trip).
SLOTS = 1 << 16
PAGE_BYTES = SLOTS * 8
#: Seconds a closed view's lease and mapping are kept for a reopen.
KEEP_FOR = 2.0
#: Closed views kept per exporter connection (the oldest goes first).
MAX_KEPT = 64
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; fcntl does not export it
_WORD = struct.Struct("=Q")
_EPOCH_LIMIT = 1 << 63


def _libc() -> Any:
    """libc's mmap and munmap (Python's mmap keeps a duplicate of the fd for
    as long as the mapping lives: one fd more per connection)."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = libc
    return _LIBC


_LIBC: Any = None


def _map_page(fd: int, prot: int) -> int:
    """Map the whole page of ``fd`` shared; its address."""
    address = _libc().mmap(None, PAGE_BYTES, prot, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping the state page: {os.strerror(err)}")
    return address


def _unmap(address: int) -> None:
    _libc().munmap(address, PAGE_BYTES)


class StatePage:
    """The exporter's state page (one per exporting process).  Its words are
    written here through a writable mapping made before the memfd was
    sealed against new writers; importers can only read it."""

    def __init__(self) -> None:
        fd = os.memfd_create("gs-reopen-states", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            address = _map_page(fd, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                            | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            except BaseException:
                _unmap(address)
                raise
        except BaseException:
            os.close(fd)
            raise
        #: The memfd (sealed), kept to send duplicates of; the one fd the page costs.
        self.fd = fd
        self._words = (ctypes.c_uint64 * SLOTS).from_address(address)
        # Not at exit: another thread may still write a word then (the kernel unmaps it with the process).
        weakref.finalize(self, _unmap, address).atexit = False
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next_slot = 0
        self._next_epoch = 1

    def assign(self) -> tuple[int, int] | None:
        """A slot for a share that lives, and its epoch (None when all are taken)."""
        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif self._next_slot < SLOTS:
                slot = self._next_slot
                self._next_slot += 1
            else:
                return None
            epoch = self._next_epoch
            self._next_epoch += 1
            self._words[slot] = epoch
        return slot, epoch

    def clear(self, slot: int) -> None:
        """The share of ``slot`` ended: no importer reopens it from now on."""
        with self._lock:
            self._words[slot] = 0
            self._free.append(slot)

    def give(self) -> int:
        """A duplicate of the page's fd, to send to an importer (the caller owns it)."""
        return os.dup(self.fd)


def make_page() -> StatePage | None:
    """The state page, or None where this kernel cannot make one (no
    memfd sealing): views are then not kept."""
    try:
        return StatePage()
    except (OSError, AttributeError):
        return None


class PageReader:
    """An importer's read-only mapping of an exporter's state page (no fd kept)."""

    __slots__ = ("_words", "_unmap", "__weakref__")

    def __init__(self, fd: int) -> None:
        """Map the page behind ``fd`` (which the caller keeps and closes);
        anything but a memfd of :data:`PAGE_BYTES` bytes sealed against
        shrinking is refused."""
        check_memfd(fd, PAGE_BYTES, "the exporter's state page", "a state page is")
        address = _map_page(fd, mmap.PROT_READ)
        self._words: Any = (ctypes.c_uint64 * SLOTS).from_address(address)
        self._unmap = weakref.finalize(self, _unmap, address)
        self._unmap.atexit = False  # another thread may still read it at exit

    def holds(self, slot: int, epoch: int) -> bool:
        """Whether the share of ``slot`` still lives with ``epoch`` (False once closed)."""
        return self._unmap.alive and self._words[slot] == epoch

    def close(self) -> None:
        """Unmap (the callers hold the connection's lock, as :meth:`holds`'s do)."""
        self._unmap()


def check_keep(value: Any) -> tuple[int, int] | None:
    """An open reply's ``keep`` (slot, epoch), or None where it is absent;
    a malformed one is refused."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(type(v) is int for v in value) or not 0 <= value[0] < SLOTS
            or not 0 < value[1] < _EPOCH_LIMIT):
        raise InvalidInputError("the exporter sent a malformed 'keep' with an open")
    return value[0], value[1]


class Kept:
    """One connection's closed views kept for a reopen: by key, the lease,
    the mapping's users (:class:`gpushare._view_use.MappingUse`, one count held
    here) and the share's slot and epoch on the page.  Its caller holds the
    connection's (re-entrant) lock around every method.

    A view closed by the garbage collector while a method changes the
    entries (in the same thread, so under the same lock) is not kept:
    :meth:`put` refuses it then (:attr:`busy`), and after :meth:`clear`."""

    __slots__ = ("page", "entries", "busy", "_closed", "_timer", "_call_later", "_on_tick")

    def __init__(self, call_later: Callable[[float, Callable[[], Any]], Any], on_tick: Callable[[], None]) -> None:
        """``call_later(seconds, fn)`` sets a timer; ``on_tick`` is what it
        calls (in the service thread), to end the entries due."""
        self.page: PageReader | None = None
        #: key -> (lease, use, slot, epoch, when it was kept)
        self.entries: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        #: Set while a method changes :attr:`entries`.
        self.busy = False
        self._closed = False
        self._timer: Any = None
        self._call_later = call_later
        self._on_tick = on_tick

    def put(self, key: tuple, lease: Any, use: Any, slot: int, epoch: int) -> list[tuple] | None:
        """Keep ``lease`` and a count of ``use`` under ``key``; returns the
        entries pushed out (the caller ends them, outside the lock), or None
        when nothing can be kept now (no page, cleared, or re-entered)."""
        if self.page is None or self._closed or self.busy:
            return None
        entry = (lease, use, slot, epoch, time.monotonic())
        out = []
        self.busy = True
        try:
            old = self.entries.pop(key, None)
            if old is not None:
                out.append(old)
            self.entries[key] = entry
            while len(self.entries) > MAX_KEPT:
                out.append(self.entries.popitem(last=False)[1])
        finally:
            self.busy = False
        if self._timer is None:
            self._timer = self._call_later(KEEP_FOR, self._tick)
        return out

    def take(self, key: tuple) -> tuple[tuple | None, tuple | None]:
        """Remove the entry of ``key``: (the entry, None) if the page says its
        share still lives, else (None, the entry, for the caller to end)."""
        if self.busy:
            return None, None
        self.busy = True
        try:
            entry = self.entries.pop(key, None)
        finally:
            self.busy = False
        if entry is None:
            return None, None
        if self.page is None or not self.page.holds(entry[2], entry[3]):
            return None, entry
        return entry, None

    def expired(self) -> list[tuple]:
        """Remove and return the entries kept :data:`KEEP_FOR` seconds or more."""
        now, out = time.monotonic(), []
        if self.busy:
            return out  # the next tick takes them
        self.busy = True
        try:
            while self.entries:
                key, entry = self.entries.popitem(last=False)
                if now - entry[4] < KEEP_FOR:
                    self.entries[key] = entry
                    self.entries.move_to_end(key, last=False)
                    break
                out.append(entry)
        finally:
            self.busy = False
        return out

    def clear(self) -> list[tuple]:
        """Remove and return every entry; nothing is kept from now on."""
        self._closed = True
        out = list(self.entries.values())
        self.entries.clear()
        return out

    def _tick(self) -> None:
        self._on_tick()

    def rearm(self) -> None:
        """After a tick (caller holds the lock): the timer that fired is
        gone; wake again when the oldest entry is due."""
        self._timer = None
        if self.entries:
            oldest = next(iter(self.entries.values()))[4]
            self._timer = self._call_later(max(0.0, oldest + KEEP_FOR - time.monotonic()), self._tick)
