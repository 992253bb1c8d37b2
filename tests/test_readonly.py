"""Read-only shares over host-fd: the importer gets the memfds opened
read-only and maps them read-only, so it cannot make the memory writable;
a sealed buffer cannot be written through any new mapping, by anyone."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

import gpushare as gs


def test_a_read_only_share_is_mapped_read_only_and_stays_so(peer):
    src = gs.empty(4 * 4096, np.uint8)
    src[:] = 9
    share = gs.export(src, readonly=True)
    assert peer.call("open", "ro", share)["path"] == "host-fd"
    tried = peer.call("try_writing", "ro")
    assert tried["perms"].startswith("r-") and tried["perms"][3] == "s", tried  # r--s: read, shared
    assert tried["mprotect"] == "EACCES"  # the fd is read-only: no writable pages, ever
    assert tried["memoryview_readonly"] is True and tried["put"].startswith("InvalidInputError")
    assert (src == 9).all()
    peer.call("close", "ro")
    writable = gs.export(src)  # the same buffer, shared writable: unaffected
    assert peer.call("open", "rw", writable)["path"] == "host-fd"
    peer.call("put", "rw", 0, b"\x01")
    assert src[0] == 1
    peer.call("close", "rw")


def test_a_sealed_buffer_cannot_be_mapped_writable_by_anyone():
    buf = gs.allocate(4096, device="host")
    mine = np.asarray(buf)
    mine[:] = 5
    assert not buf.sealed
    buf.seal()
    assert buf.sealed
    mine[0] = 6  # the exporter's own mapping stays writable
    fd = buf._res.fds[0]
    again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # what any process holding the fd could do
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(again, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(again, b"x", 0)
    finally:
        os.close(again)
    assert bytes(mine[:2]) == b"\x06\x05"
    with pytest.raises(gs.UnsupportedError, match="only the process that allocated"):
        imported = gs.import_buffer(gs.export_buffer(buf))
        try:
            imported.seal()
        finally:
            imported.close()
    del mine
    buf.close()
    with pytest.raises(gs.ClosedError):
        buf.seal()


def test_a_sealed_buffer_goes_writable_by_copies_and_read_only_by_mapping(peer):
    buf = gs.allocate(8192, device="host")
    src = np.asarray(buf)
    src[:] = 3
    buf.seal()
    writable, readonly = gs.export(buf), gs.export(buf, readonly=True)
    assert writable.offers == ("same-process", "cma", "ucx-rma")  # no writable mapping can be made
    assert readonly.offers[:2] == ("same-process", "host-fd")
    assert peer.call("open", "w", writable)["path"] == "cma"
    peer.call("put", "w", 0, b"\x04\x04")  # the exporter writes through its own mapping
    assert bytes(src[:3]) == b"\x04\x04\x03"
    assert peer.call("open", "r", readonly)["path"] == "host-fd"
    assert peer.call("try_writing", "r")["mprotect"] == "EACCES"
    assert peer.call("get", "r", 0, 3) == b"\x04\x04\x03"
    peer.call("close", "w")
    peer.call("close", "r")
