"""The cma path: host memory gpushare did not allocate, shared with a process
on the same node, copied by the exporter with process_vm_readv/writev.
Every check is the exporter's: the tests forge requests the importer's own
checks would stop, and look at the exporter's memory."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import numpy as np
import pytest

import gpushare as gs
from gpushare._exporter.registry import registered

from _procs import Child, wait_for
import _share_peer


def test_a_plain_array_goes_to_a_same_node_peer_over_cma_both_ways(peer):
    a = np.arange(256 * 1024, dtype=np.float32).reshape(512, 512)
    share = gs.export(a)
    assert share.offers == ("same-process", "cma", "ucx-rma")
    opened = peer.call("open", "c1", share)
    assert opened["path"] == "cma" and opened["warnings"] == []
    assert "cross-memory attach" in opened["why"]
    assert peer.call("digest", "c1") == hashlib.sha256(a.tobytes()).hexdigest()
    assert peer.call("get", "c1", 4 * 1000, 8) == a.reshape(-1)[1000:1002].tobytes()
    peer.call("put", "c1", 12, b"\x00\x00\x80\x3f")  # 1.0f into element 3
    assert a.reshape(-1)[3] == 1.0
    peer.call("close", "c1")


def test_the_exporter_refuses_what_the_importer_should_not_ask(peer):
    a = np.full(4096, 7, np.uint8)
    ro = np.full(4096, 9, np.uint8)
    share, ro_share = gs.export(a), gs.export(ro, readonly=True)
    peer.call("open", "f1", share)
    peer.call("open", "f2", ro_share)
    # Past the end: the exporter's own bounds check answers.
    assert peer.call("forge_cma", "f1", "get", 4090, 64).startswith("OutOfBoundsError: exporter refused")
    assert peer.call("forge_cma", "f1", "put", 1 << 40, 8).startswith("OutOfBoundsError")
    # A put on a read-only share, sent without the view's own check.
    said = peer.call("forge_cma", "f2", "put", 0, 64)
    assert said.startswith("AccessDeniedError") and "read-only" in said
    assert (ro == 9).all()
    # An address the importer does not have: an error, and the exporter serves on.
    said = peer.call("forge_cma", "f1", "get", 0, 64, 8)
    assert said.startswith("GpuShareError") and "no writable memory at 0x8" in said
    assert peer.call("get", "f1", 0, 4) == b"\x07" * 4
    peer.call("close", "f1")
    peer.call("close", "f2")


def test_revocation_and_close_stop_cma_access_at_once(peer):
    a, b = np.full(1024, 1, np.uint8), np.full(1024, 2, np.uint8)
    sa, sb = gs.export(a, lifetime="revoked"), gs.export(b, lifetime="revoked")
    peer.call("open", "r1", sa)
    peer.call("open", "r2", sb)
    sa.revoke()
    with pytest.raises(gs.ClosedError, match="revoked"):
        peer.call("get", "r1", 0, 8)
    assert peer.call("get", "r2", 0, 4) == b"\x02" * 4  # the other share goes on
    # A closed view's lease is gone in the exporter too: a forged copy on it is refused.
    said = peer.call("forge_cma", "r2", "put", 0, 8, None, True)
    assert said.startswith("ClosedError") and (b == 2).all()
    peer.call("close", "r1")
    peer.call("close", "r2")
    sb.revoke()


def test_batches_and_asyncio_over_cma(peer):
    arrays = [np.full(64 * 1024, i, np.uint8) for i in range(4)]
    shares = [gs.export(x) for x in arrays]
    views = [gs.open(s, exclude=["same-process"]) for s in shares]  # this process imports from itself
    try:
        assert {v.path for v in views} == {"cma"}
        outs = [bytearray(4096) for _ in views]
        gs.get_batch([(v, 100, o) for v, o in zip(views, outs)]).wait(10)
        assert [bytes(o) for o in outs] == [bytes([i]) * 4096 for i in range(4)]
        gs.put_batch([(v, 0, b"\xff" * 16) for v in views]).wait(10)
        assert all((x[:16] == 255).all() and (x[16:] != 255).all() for x in arrays)

        async def roundtrip() -> bytes:
            await views[1].put_async(b"abc", 1000, timeout=10)
            out = bytearray(3)
            await views[1].get_async(out, 1000, timeout=10)
            return bytes(out)

        assert asyncio.run(roundtrip()) == b"abc"
    finally:
        for v in views:
            v.close()


def test_cma_copies_run_on_two_threads_whatever_the_number_of_views():
    from gpushare._paths import cma

    size = 2 * cma.PIECE  # copies of two pieces each
    arrays = [np.full(size, i % 256, np.uint8) for i in range(16)]
    shares = [gs.export(x) for x in arrays]
    views = [gs.open(s, exclude=["same-process"]) for s in shares]
    try:
        before = threading.active_count()
        out = bytearray(size)
        for i, v in enumerate(views):
            v.get(out)
            assert out[0] == out[-1] == i % 256
        assert threading.active_count() - before <= 2
        assert sum(t.name.startswith("gpushare-cma") for t in threading.enumerate()) == 2
    finally:
        for v in views:
            v.close()
    assert all(wait_for(lambda s=s: registered(s).opens == 0) for s in shares)


def test_an_exporter_the_kernel_keeps_out_falls_back_to_ucx_rma_with_a_warning():
    exporter, importer = Child(_share_peer.setup), Child(_share_peer.setup)
    try:
        if not exporter.call("no_ptrace"):
            pytest.fail("could not drop CAP_SYS_PTRACE in the exporter")
        importer.call("undumpable")  # now only a process with CAP_SYS_PTRACE may reach its memory
        share = exporter.call("export", "numpy", 8192)
        opened = importer.call("open", "k", share)
        assert opened["path"] == "ucx-rma"
        assert any(w.startswith("SlowPathWarning") and "cma failed" in w and "does not let the exporter" in w
                   for w in opened["warnings"]), opened
        assert importer.call("get", "k", 0, 4) == bytes(range(4))
    finally:
        importer.close()
        exporter.close()


def test_a_same_node_peer_served_over_ucx_rma_is_warned(peer):
    a = np.arange(4096, dtype=np.uint8)
    share = gs.export(a, paths=["ucx-rma"])  # the exporter offers nothing else
    opened = peer.call("open", "w1", share)
    assert opened["path"] == "ucx-rma"
    assert any(w.startswith("SlowPathWarning") and "network transport" in w for w in opened["warnings"])
    peer.call("close", "w1")
    opened = peer.call("open", "w2", share, {"prefer": ["ucx-rma"]})  # asked for: no warning
    assert opened["warnings"] == []
    peer.call("close", "w2")


def test_revocation_stops_copies_already_queued(peer):
    big = 64 << 20
    a = np.zeros(big, np.uint8)
    share = gs.export(a, lifetime="revoked")
    assert peer.call("open", "q", share)["path"] == "cma"
    peer.call("put_batch_async", "q", 16, 9, big)  # 1 GiB of puts queued at the exporter (about 0.1 s of copying)
    time.sleep(0.01)
    share.revoke()
    time.sleep(0.05)  # at most the piece in progress at the revocation lands after it
    seen = int(a.sum())
    time.sleep(1.0)
    assert int(a.sum()) == seen, "a copy went on after the share was revoked"
    assert "ClosedError" in peer.call("batch_errors")
    peer.call("close", "q")


def test_an_object_that_shrank_since_export_is_not_served_past_its_end(peer):
    data = bytearray(256 * 1024)
    share = gs.export(data, lifetime="revoked")
    del data[5:]  # nothing pins it between export and the first open
    opened = peer.call("open", "s", share)
    assert opened["path"] == "ucx-rma"  # cma refused the open: the object is not what was exported
    assert any("is 5 bytes now" in w for w in opened["warnings"]), opened
    with pytest.raises(gs.OutOfBoundsError, match="outside|past"):
        peer.call("get", "s", 0, 1024)
    peer.call("close", "s")
    share.revoke()
