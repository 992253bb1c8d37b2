"""Address ranges found by bisection (``gpushare._ranges``): which of an agent's memory handles
registers a transfer's local buffer, which buffer this process allocated holds an array."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpushare import ucx
from gpushare._ranges import Ranges


class _Handle:
    closed = False


class _Counted(list):
    """A list that counts the entries read from it (bisection's probes included)."""

    reads = 0

    def __getitem__(self, i):
        _Counted.reads += 1
        return super().__getitem__(i)


def _ranges(spans, mtype="host"):
    r, handles = Ranges(lambda h: not h.closed), []
    for lo, hi in spans:
        h = _Handle()
        handles.append(h)
        r.add(lo, hi, mtype, lambda h=h: h)
    return r, handles


def _found(r, address, nbytes, mtype="host"):
    return [ref() for ref in r.candidates(address, nbytes, mtype)]


def test_each_range_is_found_and_nothing_outside_it():
    spans = [(i * 8192, i * 8192 + 4096) for i in range(1000)]
    random.Random(1).shuffle(spans)  # added in any order
    r, handles = _ranges(spans)
    by_start = {lo: h for (lo, _), h in zip(spans, handles)}
    for lo, hi in spans:
        assert _found(r, lo, hi - lo) == [by_start[lo]]
        assert _found(r, lo + 100, 10) == [by_start[lo]]
        assert _found(r, lo, hi - lo + 1) == []  # one byte past its end
        assert _found(r, hi, 1) == []  # the gap after it
        assert _found(r, lo, 16, "cuda") == []  # another memory type


def test_overlapping_ranges_are_all_found_the_latest_start_first():
    r, (arena, inner, other) = _ranges([(0, 1 << 30), (4096, 8192), (1 << 20, (1 << 20) + 4096)])
    assert _found(r, 5000, 100) == [inner, arena]
    assert _found(r, 9000, 100) == [arena]
    assert _found(r, (1 << 20) + 10, 10) == [other, arena]
    assert _found(r, (1 << 30) - 1, 2) == []


def _count_reads(r):
    """Make every list of ``r`` count the entries read from it."""
    r._classes = {c: _Counted(entries) for c, entries in r._classes.items()}


def _reads_per_lookup(r, lookups):
    """The most entries any one of ``lookups`` (address, nbytes, expected count) read."""
    _count_reads(r)
    most = 0
    for address, nbytes, expected in lookups:
        _Counted.reads = 0
        assert len(_found(r, address, nbytes)) == expected, address
        most = max(most, _Counted.reads)
    return most


def test_a_lookup_reads_a_few_entries_however_many_there_are():
    """Without overlap a lookup is a bisection and one or two entries: at most 40 reads of
    4,000 entries (asking every handle would read 4,000)."""
    n = 4000
    r, _ = _ranges([(i * 8192, i * 8192 + 4096) for i in range(n)])
    lookups = [(i * 8192 + 10, 100, 1) for i in range(n)] + [(i * 8192 + 5000, 100, 0) for i in range(n)]
    assert _reads_per_lookup(r, lookups) <= 40


@pytest.mark.parametrize("long_size", [1 << 30, 16 << 20, 40 << 10], ids=["1GiB", "16MiB", "40KiB"])
def test_long_ranges_do_not_stretch_every_lookup(long_size):
    """Ranges of other sizes beside 2,000 small ones (an arena of 1 GiB, a buffer of 16 MiB or
    of 40 KiB, below them in memory, so they hold none of them): a lookup, found or not,
    still reads at most 40 entries."""
    n = 2000
    base = 1 << 40
    r, _ = _ranges([(base + i * 8192, base + i * 8192 + 4096) for i in range(n)] + [(base - long_size, base)])
    lookups = ([(base + i * 8192 + 5000, 100, 0) for i in range(n)] + [(base + i * 8192 + 8, 100, 1) for i in range(n)]
               + [(base - 4096, 100, 1)])
    assert _reads_per_lookup(r, lookups) <= 40


def test_an_addition_during_a_look_never_hides_a_handle_that_was_there(monkeypatch):
    """A handle added (below the one looked up) while a reader bisects shifts the entries the
    reader is about to read: the reader sees the version change and looks again."""
    from gpushare import _ranges as module

    r, (target,) = _ranges([(1 << 20, (1 << 20) + 4096)])
    real = module.bisect.bisect_left
    added = []

    def bisect_then_add(*args, **kwargs):
        at = real(*args, **kwargs)
        if not added:
            h = _Handle()
            added.append(h)
            r.add(0, 4096, "host", lambda: h)  # before the target: shifts it up by one
        return at

    monkeypatch.setattr(module.bisect, "bisect_left", bisect_then_add)
    assert _found(r, (1 << 20) + 8, 8) == [target]
    assert added


def test_entries_of_closed_and_dropped_handles_are_pruned_as_the_list_grows():
    r = Ranges(lambda h: not h.closed)
    open_ = []
    for i in range(1000):
        h = _Handle()
        if i % 10 == 0:
            open_.append(h)
        else:
            h.closed = True
        r.add(i * 4096, (i + 1) * 4096, "host", lambda h=h: h)
    assert len(r) <= 2 * len(open_) + 17
    for h in open_:
        i = open_.index(h) * 10
        assert _found(r, i * 4096, 4096) == [h]


def test_an_agent_finds_each_of_2000_handles_of_a_batch():
    """A state dict registered tensor by tensor: each buffer is found in its own handle."""
    with ucx.Agent(transports="tcp") as agent:
        arrays = [np.full(4096, i % 256, np.uint8) for i in range(2000)]
        handles = [agent.create_memory_handle(a.nbytes, a) for a in arrays]
        for a, mh in zip(arrays, handles):
            assert agent._registration(a.ctypes.data, a.nbytes, "host") is mh._native
            assert agent._registration(a.ctypes.data + 4000, 96, "host") is mh._native
        handles[7].close()
        assert agent._registration(arrays[7].ctypes.data, 16, "host") is None
        for mh in handles:
            mh.close()


def test_the_buffer_holding_each_of_2000_arrays_is_found_by_bisection(monkeypatch):
    """``gs.empty`` arrays, each a buffer of its own (a state dict allocated tensor by tensor):
    each array's buffer is found, a plain array is found in none, and no lookup reads more
    than 40 entries of the process's buffers (asking each would read 2,000 and more)."""
    import gpushare as gs
    from gpushare._paths import host_fd

    monkeypatch.setattr(host_fd, "_allocated", Ranges(host_fd._exportable))  # this test's buffers alone
    arrays = [gs.empty(4096, dtype=np.uint8) for _ in range(2000)]
    plain = [np.zeros(4096, np.uint8) for _ in range(100)]
    _count_reads(host_fd._allocated)
    most = 0
    for a in arrays:
        _Counted.reads = 0
        found = host_fd.containing(a.ctypes.data + 8, 16)
        assert found is not None and found[1] == 8
        assert found[0].ptr == a.ctypes.data
        most = max(most, _Counted.reads)
    for a in plain:
        _Counted.reads = 0
        assert host_fd.containing(a.ctypes.data, a.nbytes) is None
        most = max(most, _Counted.reads)
    assert most <= 40, most


def test_a_bundle_of_2000_buffers_sorts_its_tensors_out_by_bisection(monkeypatch):
    """Exporting a tree of 2,000 arrays, each a ``gs.empty`` buffer of its own, finds each
    tensor's allocation among those found before reading at most 40 entries (asking each
    allocation found so far would read up to 1,999); every tensor is its own part."""
    import gpushare as gs
    from gpushare import _export_tree

    most = [0]

    class Counting(Ranges):
        __slots__ = ()

        def add(self, *args):
            super().add(*args)
            _count_reads(self)

        def candidates(self, *args):
            _Counted.reads = 0
            found = super().candidates(*args)
            most[0] = max(most[0], _Counted.reads)
            return found

    monkeypatch.setattr(_export_tree, "Ranges", Counting)
    tree = {f"w{i}": gs.empty(64, dtype=np.float32) for i in range(2000)}
    share = gs.export(tree, paths=["cma"])  # host-fd would need an fd per buffer in one grant
    try:
        assert share.allocations == 2000
        assert 0 < most[0] <= 40, most[0]
    finally:
        share.revoke()


def test_a_child_forked_while_another_thread_adds_can_add_and_look():
    """The parent's lock is held (an addition under way in another thread) at the fork: the
    child adds and looks up without waiting for it."""
    import os
    import threading

    r, (h,) = _ranges([(4096, 8192)])
    holding, release = threading.Event(), threading.Event()

    def hold():
        with r._lock:
            holding.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    holding.wait(10)
    try:
        import warnings

        with warnings.catch_warnings():  # Python 3.12 warns of a fork beside threads: the point here
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit 0 only if both work
            try:
                other = _Handle()
                r.add(1 << 20, (1 << 20) + 4096, "host", lambda: other)
                ok = _found(r, (1 << 20) + 8, 8) == [other] and _found(r, 5000, 8) == [h]
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
        import time

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child hung on the lock held at the fork")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        t.join(10)
