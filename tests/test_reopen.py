"""Reopening a share from a closed view's kept lease, with no round trip
(gpushare/_reopen.py): only where closing changes nothing at the exporter,
never after a revoke or the exporter's end, bounded in time and number."""

from __future__ import annotations

import fcntl
import mmap
import os
import pickle
import signal

import numpy as np
import pytest

import gpushare as gs
from gpushare import _reopen
from gpushare._errors import InvalidInputError
from gpushare._exporter.registry import get_exporter

from _procs import Child, wait_for
import _reopen_peer


@pytest.fixture
def child():
    c = Child(_reopen_peer.setup)
    yield c
    c.close()


def _share(fill: int = 7, lifetime="revoked", n: int = 4096):
    buf = gs.empty(n, "uint8")
    np.asarray(buf)[:] = fill
    share = gs.export(buf, lifetime=lifetime)
    return buf, share, pickle.dumps(share)


def _messages() -> int:
    return get_exporter().stats()["messages"]


def test_reopen_asks_the_exporter_nothing_and_sees_the_memory(child):
    buf, share, blob = _share(7)
    got = child.call("open_close", blob, 1)
    assert got["firsts"] == [7] and got["kept"] == 1
    before = _messages()
    np.asarray(buf)[0] = 9  # the memory is shared: the kept mapping sees it
    got = child.call("open_close", blob, 20)
    assert _messages() == before  # twenty opens and closes, not one message
    assert got["firsts"] == [9] * 20
    assert len(set(got["leases"])) == 1  # the one kept lease
    assert "host-fd" in got["why"]
    child.call("write_through", blob, 5)  # and writes go the other way
    assert np.asarray(buf)[0] == 5
    share.revoke()


def test_revoked_share_is_not_reopened_from_a_kept_view(child):
    buf, share, blob = _share()
    assert child.call("open_close", blob, 1)["kept"] == 1
    share.revoke()  # the state page says so before revoke() returns
    got = child.call("try_open", blob)
    assert got.startswith("ClosedError") and "revoked" in got
    st = child.call("status")
    assert st["kept"] == 0
    assert wait_for(lambda: get_exporter().stats()["leases"] == 0, 10)  # the kept lease was given back


def test_kept_view_ends_after_a_while_lease_and_mapping(child):
    buf, share, blob = _share()
    base = child.call("status")
    child.call("open_close", blob, 1)
    st = child.call("status")
    assert st["kept"] == 1 and st["leases"] == 1 and st["maps"] == base["maps"] + 1
    assert wait_for(lambda: child.call("status")["kept"] == 0, _reopen.KEEP_FOR + 5)
    st = child.call("status")
    assert st["leases"] == 0 and st["maps"] == base["maps"]  # unmapped, the lease ended at the exporter too
    assert wait_for(lambda: get_exporter().stats()["leases"] == 0, 10)
    share.revoke()


def test_an_array_over_a_closed_view_outlives_the_kept_view(child):
    buf, share, blob = _share(3)
    assert child.call("open_keep_array", blob) == 3
    np.asarray(buf)[0] = 4
    assert child.call("first_byte_of_kept_array") == 4
    assert wait_for(lambda: child.call("status")["kept"] == 0, _reopen.KEEP_FOR + 5)
    np.asarray(buf)[0] = 6
    assert child.call("first_byte_of_kept_array") == 6  # the array still holds the mapping
    share.revoke()


def test_a_view_closed_while_a_keep_is_under_way_is_not_kept(child):
    buf, share, blob = _share(1)
    got = child.call("close_inside_keep", blob)
    first, second = got["ids"]
    assert got["busy_inside"] == [True]
    assert got["kept_ids"] == [first] and got["reopened"] == first  # the first kept, and reopened
    assert got["lease_ids"] == [first] and got["kept"] == 1  # the second's lease ended: nothing lost, nothing kept twice
    assert wait_for(lambda: child.call("status") == {"kept": 0, "leases": 0, "maps": 0}, _reopen.KEEP_FOR + 5)
    share.revoke()


@pytest.mark.parametrize("lifetime", ["auto", "closed", 3, "none"])
def test_policies_where_a_close_counts_are_not_kept(child, lifetime):
    holder = _reopen_peer  # a weak-referenceable object stays alive for "none" below
    buf, share, blob = _share(lifetime=lifetime)
    holder.buf = buf
    try:
        before = _messages()
        if lifetime == "closed":
            got = child.call("open_close", blob, 1)
            assert child.call("try_open", blob).startswith("ClosedError")  # ended at the close
        else:
            got = child.call("open_close", blob, 3)
            assert len(set(got["leases"])) == 3  # a lease of its own each
            if lifetime == 3:
                assert "lifetime=3 allows 3 imports" in child.call("try_open", blob)
        assert got["kept"] == 0
        assert _messages() > before
    finally:
        del holder.buf


def test_kept_views_are_bounded_per_exporter(child):
    shares = [_share(i % 250) for i in range(_reopen.MAX_KEPT + 6)]
    st = child.call("open_many", [blob for _, _, blob in shares])
    assert st["kept"] == _reopen.MAX_KEPT
    assert st["leases"] == _reopen.MAX_KEPT
    assert wait_for(lambda: get_exporter().stats()["leases"] == _reopen.MAX_KEPT, 10)
    for _, share, _ in shares:
        share.revoke()


def test_reopen_after_the_exporter_died_is_refused():
    exporter = Child(_reopen_peer.setup)
    importer = Child(_reopen_peer.setup)
    try:
        blob = exporter.call("export_revoked", 11)
        assert importer.call("open_close", blob, 2)["firsts"] == [11, 11]
        assert importer.call("status")["kept"] == 1
        os.kill(exporter.proc.pid, signal.SIGKILL)
        exporter.proc.join(10)
        got = importer.call("try_open", blob)  # at once: the hang-up is seen even before the service thread
        assert got.split(":")[0] in ("ExporterUnreachableError", "ClosedError"), got
        assert wait_for(lambda: importer.call("status") == {"kept": 0, "leases": 0, "maps": 0}, 10)
    finally:
        exporter.close()
        importer.close()


def test_a_sealed_buffer_is_not_reopened_writable(child):
    hb = gs.allocate(4096, device="host")
    np.asarray(hb)[:] = 2
    share = gs.export(hb, lifetime="revoked")
    blob = pickle.dumps(share)
    assert child.call("open_close", blob, 1)["path"] == "host-fd"
    assert child.call("status")["kept"] == 1
    hb.seal()  # a writable share of a sealed buffer goes by copies from now on
    got = child.call("open_close", blob, 1)
    assert got["path"] != "host-fd" and got["firsts"] == [2]  # asked: the exporter refused host-fd
    assert child.call("status")["kept"] == 0
    share.revoke()


def test_a_forked_child_asks_the_exporter_itself(child):
    buf, share, blob = _share(8)
    before = _messages()
    got = child.call("fork_open", blob)
    assert got["exit"] == 0 and got["child"] == (True, 8)
    assert got["kept"] == 1  # the parent's kept view stays the parent's
    assert _messages() > before + 1  # the child connected and opened with messages of its own
    share.revoke()


# -- the page itself --------------------------------------------------------

def test_state_page_words_and_slots():
    page = _reopen.StatePage()
    try:
        reader = _reopen.PageReader(page.fd)
        a, b = page.assign(), page.assign()
        assert a[0] != b[0] and a[1] != b[1]
        assert reader.holds(*a) and reader.holds(*b)
        page.clear(a[0])
        assert not reader.holds(*a) and reader.holds(*b)
        c = page.assign()
        assert c[0] == a[0] and c[1] != a[1]  # the slot again, under another epoch
        assert not reader.holds(*a) and reader.holds(*c)
        reader.close()
    finally:
        os.close(page.fd)


def test_state_page_cannot_be_written_by_an_importer():
    page = _reopen.StatePage()
    try:
        fd = page.give()
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, _reopen.PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"\xff" * 8, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)
    finally:
        os.close(page.fd)


def test_page_reader_refuses_what_is_not_a_page(tmp_path):
    fd = os.memfd_create("x", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _reopen.PAGE_BYTES)
        with pytest.raises(InvalidInputError, match="not sealed against shrinking"):
            _reopen.PageReader(fd)  # may shrink under the mapping
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with pytest.raises(InvalidInputError, match="bytes; a state page is"):
            _reopen.PageReader(fd)
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(InvalidInputError):
            _reopen.PageReader(r)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("keep", [[1], [1, 2, 3], ["1", 2], [-1, 2], [_reopen.SLOTS, 2], [1, 0], [1, 1 << 63],
                                  [True, 2], [1.0, 2], {"a": 1}, "x"])
def test_malformed_keep_is_refused(keep):
    with pytest.raises(InvalidInputError):
        _reopen.check_keep(keep)


def test_wellformed_keep():
    assert _reopen.check_keep(None) is None
    assert _reopen.check_keep([0, 1]) == (0, 1)
    assert _reopen.check_keep((_reopen.SLOTS - 1, (1 << 63) - 1)) == (_reopen.SLOTS - 1, (1 << 63) - 1)
