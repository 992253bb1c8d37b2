"""The sorted ranges of an agent's memory handles (``gpushare._ucx._ranges``): which handle
registers a transfer's local buffer, found by bisection."""

from __future__ import annotations

import random

import numpy as np

from gpushare import ucx
from gpushare._ucx._ranges import Ranges


class _Handle:
    closed = False


class _Counted(list):
    """A list that counts the entries read from it (bisection's probes included)."""

    reads = 0

    def __getitem__(self, i):
        _Counted.reads += 1
        return super().__getitem__(i)


def _ranges(spans, mtype="host"):
    r, handles = Ranges(), []
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


def test_a_lookup_reads_a_few_entries_however_many_there_are():
    """Without overlap a lookup is a bisection and one or two entries: at most 40 reads of
    4,000 entries each (asking every handle would read 4,000)."""
    n = 4000
    r, _ = _ranges([(i * 8192, i * 8192 + 4096) for i in range(n)])
    r._entries = _Counted(r._entries)
    _Counted.reads = 0
    for i in range(n):
        assert len(_found(r, i * 8192 + 10, 100)) == 1
        assert _found(r, i * 8192 + 5000, 100) == []
    assert _Counted.reads <= 40 * 2 * n, _Counted.reads


def test_entries_of_closed_and_dropped_handles_are_pruned_as_the_list_grows():
    r = Ranges()
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
