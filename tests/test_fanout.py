"""A share handed to many processes: the default lifetime ("auto") keeps it
openable for every worker of a Pool, a ProcessPoolExecutor or a Queue, in
every start method, and ends it once the exporter no longer holds it."""

from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
import pickle
import weakref
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

import gpushare as gs
from gpushare._exporter.registry import get_exporter, registered

from _procs import Box, wait_for
import _fanout_worker

METHODS = _fanout_worker.METHODS


def _expect(a: np.ndarray) -> dict:
    return {k: v for k, v in _fanout_worker.digest(a).items() if k not in ("type", "strides")}


def _check(report: dict, a: np.ndarray, paths: tuple[str, ...]) -> None:
    assert "error" not in report, report
    assert report["path"] in paths
    want = _expect(a)
    assert {k: report[k] for k in want} == want
    if report["mapped"] is not None:
        assert report["mapped"] == (want["dtype"], want["shape"], want["sha"])


@pytest.fixture(scope="module")
def arrays():
    plain = (np.arange(3000, dtype=np.float32) * 0.5).reshape(30, 100)  # not gpushare's: cma
    mapped = gs.zeros((64, 8), dtype=np.int16)  # gpushare's: host-fd
    mapped[:] = np.arange(512, dtype=np.int16).reshape(64, 8)
    return plain, mapped


@pytest.mark.parametrize("method", METHODS)
def test_pool_workers_all_open_a_share_with_the_default_lifetime(method, arrays):
    plain, mapped = arrays
    plain_share, mapped_share = gs.export(plain), gs.export(mapped)
    assert plain_share.lifetime == mapped_share.lifetime == "auto"
    with mp.get_context(method).Pool(3) as pool:
        reports = pool.map(_fanout_worker.read, [plain_share, mapped_share] * 4, chunksize=1)
    for i, report in enumerate(reports):
        _check(report, plain if i % 2 == 0 else mapped, ("cma",) if i % 2 == 0 else ("host-fd",))
    assert registered(plain_share) is not None  # still held here: still openable


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_executor_workers_all_open_a_temporary_share(method, arrays):
    plain, _ = arrays
    with ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        # The share and its array exist only in the argument list.
        reports = list(ex.map(_fanout_worker.read, [gs.export(plain.copy())] * 5))
    for report in reports:
        _check(report, plain, ("cma",))


@pytest.mark.parametrize("method", METHODS)
def test_queue_readers_all_open_a_share_the_exporter_dropped(method, arrays):
    _, mapped = arrays
    ctx = mp.get_context(method)
    inbox, outbox = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_fanout_worker.from_queue, args=(inbox, outbox)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        share = gs.export(mapped)
        for _ in procs:
            inbox.put(share)
        del share  # only the pickles in the queue are left; the array is still alive here
        reports = [outbox.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
    for report in reports:
        _check(report, mapped, ("host-fd",))
    assert all(p.exitcode == 0 for p in procs)


# ------------------------------------------------------------ the "auto" rules


def _gone(ref) -> bool:
    gc.collect()
    return ref() is None


def test_auto_keeps_the_object_while_the_share_is_held_and_ends_with_it(peer):
    box = Box(4096)
    ref = weakref.ref(box)
    share = gs.export(box)
    del box
    export = registered(share)
    for i in range(3):  # one importer after another: each finds it open
        assert peer.call("open", f"a{i}", share)["path"] == "cma"
        assert peer.call("digest", f"a{i}") == hashlib.sha256(bytes(np.arange(4096, dtype=np.uint64)
                                                                    .astype(np.uint8))).hexdigest()
        peer.call("close", f"a{i}")
    assert wait_for(lambda: export.opens == 0)
    assert ref() is not None  # the Share keeps it, like a reference
    share_id = share.share_id
    copy = pickle.loads(pickle.dumps(share))
    del share
    assert wait_for(lambda: _gone(ref))  # nothing here holds it, no import is open: ended
    assert wait_for(lambda: export.retired and get_exporter().get(share_id) is None)
    with pytest.raises(gs.ClosedError, match="held neither the Share nor the object"):
        peer.call("open", "late", copy)


def test_auto_share_sent_and_dropped_lives_until_its_first_import(peer):
    box = Box(4096)
    ref = weakref.ref(box)
    wire = gs.export(box).to_bytes()  # the Share and the object are gone here at once
    del box
    gc.collect()
    assert ref() is not None  # a share that left awaits its first import
    share = gs.Share.from_bytes(wire)
    peer.call("open", "s1", share)
    peer.call("close", "s1")
    assert wait_for(lambda: _gone(ref))  # after it, nothing here needs it
    with pytest.raises(gs.ClosedError, match="no longer available"):
        peer.call("open", "s2", share)


def test_auto_share_stays_openable_while_the_object_lives(peer):
    a = np.arange(4096, dtype=np.uint8)
    share = gs.export(a)
    peer.call("open", "o1", share)
    share_id = share.share_id
    del share  # the exporter keeps using the array: late importers still find it
    peer.call("close", "o1")
    export = get_exporter().get(share_id)
    assert wait_for(lambda: export.opens == 0 and export.obj is None)  # held weakly now
    peer.call("open", "o2", export_share(export))
    assert export.obj is a  # held again while the import is open
    peer.call("close", "o2")
    assert wait_for(lambda: export.obj is None)
    del a
    assert wait_for(lambda: export.retired)


def export_share(export) -> gs.Share:
    """A share naming ``export`` (as an importer holding a copy has it)."""
    exp = get_exporter()
    from gpushare._process import node_key
    from gpushare._share import SHARE_FORMAT

    return gs.Share._make(SHARE_FORMAT, export.share_id, export.token, __import__("os").getpid(), node_key(),
                          exp.addresses, export.nbytes, "host", (export.nbytes,), "|u1", export.offers, "auto",
                          None, False)


def test_auto_share_never_sent_ends_with_the_share():
    box = Box(64)
    ref = weakref.ref(box)
    share = gs.export(box)
    share_id = share.share_id
    del box, share  # never pickled, never opened: nobody can open it
    assert wait_for(lambda: _gone(ref))
    # the export ends once the object's finalizer has run its course (another thread may hold the export then)
    assert wait_for(lambda: get_exporter().get(share_id) is None)


def test_auto_unweakrefable_object_is_kept_while_the_share_is(peer):
    data = bytearray(range(256)) * 16
    share = gs.export(data)
    del data
    peer.call("open", "b1", share)
    peer.call("close", "b1")
    assert peer.call("open", "b2", share)["path"] == "cma"
    assert peer.call("digest", "b2") == hashlib.sha256(bytes(range(256)) * 16).hexdigest()
    peer.call("close", "b2")
    export = registered(share)
    del share
    assert wait_for(lambda: export.retired)
