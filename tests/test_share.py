"""The sharing API (export / open / View) over real processes."""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import signal
import time
import warnings
import weakref

import numpy as np
import pytest

import gpushare as gs
from gpushare import _control
from gpushare._exporter.registry import registered

from _procs import Box, Child, wait_for as _wait_for
import _share_peer

MiB = 1 << 20


#: The paths that copy plain memory: cma on this node by default, ucx-rma when asked for.
COPIED = [pytest.param({}, "cma", id="cma"), pytest.param({"prefer": "ucx-rma"}, "ucx-rma", id="ucx-rma")]


# ---------------------------------------------------------------- plain data


def test_share_is_plain_immutable_data():
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    share = gs.export(arr)
    again = pickle.loads(pickle.dumps(share))
    assert again == share and hash(again) == hash(share)
    assert share.nbytes == 4000 and share.shape == (10, 100) and share.typestr == "<f4"
    assert share.device == "host"
    assert share.offers == ("same-process", "cma", "ucx-rma")
    with pytest.raises(AttributeError):
        share.nbytes = 5
    with pytest.raises(TypeError):
        gs.Share()


@pytest.mark.parametrize(
    "index,value,match",
    [
        (0, 2, "format version"),
        (1, "zz", "share id"),
        (2, b"short", "token"),
        (3, -1, "exporter_pid"),
        (5, (("not-an-ip", 5),), "IP address"),
        (5, (("127.0.0.1", 70000),), "control port"),
        (5, (), "control"),
        (6, 0, "nbytes"),
        (6, 1 << 60, "nbytes"),
        (6, True, "nbytes"),
        (7, "gpu", "device"),
        (8, (3, 3), "shape"),
        (9, "f4", "typestr"),
        (10, ("teleport",), "unknown path"),
        (10, ("ucx-rma", "ucx-rma"), "distinct"),
        (11, "forever", "lifetime"),
    ],
)
def test_tampered_share_fields_are_refused(index, value, match):
    share = gs.export(np.zeros(64, np.uint8))
    fn, fields = share.__reduce__()
    fields = list(fields)
    fields[index] = value
    # What unpickling a tampered share calls: the validating constructor.
    with pytest.raises(gs.InvalidInputError, match=match):
        fn(*fields)


def test_open_rejects_non_shares_and_bad_arguments():
    with pytest.raises(gs.InvalidInputError):
        gs.open({"share_id": "x"})
    share = gs.export(np.zeros(8, np.uint8))
    with pytest.raises(gs.InvalidInputError, match="unknown path"):
        gs.open(share, prefer=["warp-drive"])
    with pytest.raises(gs.InvalidInputError):
        gs.open(share, timeout=0)
    with pytest.raises(gs.InvalidInputError):
        gs.export(np.zeros(8, np.uint8), lifetime="forever")
    with pytest.raises(gs.InvalidInputError):
        gs.export(np.zeros(8, np.uint8), lifetime=0)
    with pytest.raises(gs.InvalidInputError):
        gs.export(np.zeros(100, np.uint8)[::2])


# ---------------------------------------------------------------- paths


def test_same_process_hands_back_the_original():
    arr = np.arange(16, dtype=np.uint8)
    share = gs.export(arr)
    with gs.open(share) as view:
        assert view.path == "same-process"
        assert "this process exported it" in view.why
        assert np.asarray(view).__array_interface__["data"][0] == arr.ctypes.data
        out = bytearray(4)
        view.get(out, 2)
        assert bytes(out) == bytes([2, 3, 4, 5])
        view.put(b"\xff\xff", 14)
    assert arr[14] == 255 and arr[15] == 255
    with pytest.raises(gs.ClosedError):
        view.get(bytearray(1))


def test_host_fd_between_processes_is_zero_copy_both_ways(peer):
    buf = gs.allocate(2 * MiB, device="host")
    host = np.asarray(buf)
    host[:] = 1
    share = gs.export(buf)
    assert share.offers == ("same-process", "host-fd", "ucx-rma")
    info = peer.call("open", "hfd", share)
    assert info["path"] == "host-fd"
    assert "same node" in info["why"] and "not same-process" in info["why"]
    assert info["warnings"] == []
    # Importer writes through a NumPy array on the mapping; the exporter sees it.
    peer.call("array_write", "hfd", 12345, 77)
    assert host[12345] == 77
    # Exporter writes; the importer reads it.
    host[100:104] = [9, 8, 7, 6]
    assert peer.call("get", "hfd", 100, 4) == bytes([9, 8, 7, 6])
    peer.call("put", "hfd", 2 * MiB - 3, b"end")
    assert bytes(host[-3:]) == b"end"
    peer.call("close", "hfd")


@pytest.mark.parametrize("how, path", COPIED)
def test_numpy_array_goes_over_a_copying_path(peer, how, path):
    arr = np.arange(MiB, dtype=np.uint32)
    share = gs.export(arr)
    info = peer.call("open", "rma", share, how)
    assert info["path"] == path and info["warnings"] == []
    assert "not host-fd: not offered" in info["why"]
    assert peer.call("get", "rma", 4 * 10, 8) == arr[10:12].tobytes()
    peer.call("put", "rma", 0, np.array([123456789], np.uint32).tobytes())
    assert arr[0] == 123456789
    peer.call("close", "rma")


@pytest.mark.parametrize("how, path", COPIED)
def test_remote_view_refuses_zero_copy_and_checks_bounds(how, path):
    child = Child(_share_peer.setup)
    try:
        share = child.call("export", "numpy", 4096)
        with gs.open(share, **how) as view:
            assert view.path == path
            with pytest.raises(gs.UnsupportedError, match="use view.get"):
                np.asarray(view)
            with pytest.raises(gs.OutOfBoundsError):
                view.get(bytearray(10), 4090)
            with pytest.raises(gs.InvalidInputError):
                view.get(bytearray(10), -1)
            # Destinations refused whatever the path, each with the general path's reason.
            ro = np.zeros(8, np.uint8)
            ro.flags.writeable = False
            with pytest.raises(gs.InvalidInputError, match="read-only"):
                view.get(ro)
            with pytest.raises(gs.InvalidInputError, match="read-only"):
                view.get(b"immutable")
            with pytest.raises(gs.InvalidInputError, match="contiguous"):
                view.get(np.zeros(16, np.uint8)[::2])
            with pytest.raises(gs.InvalidInputError, match="contiguous"):
                view.get(memoryview(bytearray(16))[::2])
            with pytest.raises(gs.OutOfBoundsError):
                view.get(np.zeros(8, np.uint8), 4090)
            with pytest.raises(gs.OutOfBoundsError):
                view.put(memoryview(b"x" * 8), 4090)
            out = bytearray(4096)
            view.get(out)
            assert out == bytes(np.arange(4096, dtype=np.uint64).astype(np.uint8))

            async def go():
                await view.put_async(b"async!", 10)
                back = bytearray(6)
                await view.get_async(back, 10)
                return bytes(back)

            assert asyncio.run(go()) == b"async!"
        with pytest.raises(gs.ClosedError):
            view.get(bytearray(8))
    finally:
        child.close()


def test_exclusion_and_preference(peer):
    buf = gs.allocate(MiB, device="host")
    share = gs.export(buf, lifetime="revoked")
    info = peer.call("open", "ex", share, {"exclude": ["host-fd"]})
    assert info["path"] == "ucx-rma" and "excluded by the caller" in info["why"]
    assert info["warnings"] == []  # the caller asked for it: no warning
    peer.call("close", "ex")
    info = peer.call("open", "pref", share, {"prefer": "ucx-rma"})
    assert info["path"] == "ucx-rma"
    peer.call("close", "pref")
    share.revoke()


def test_environment_variable_excludes_for_the_whole_job(monkeypatch):
    monkeypatch.setenv("GPUSHARE_EXCLUDE_PATHS", "host-fd")
    child = Child(_share_peer.setup)
    try:
        buf = gs.allocate(MiB, device="host")
        info = child.call("open", "env", gs.export(buf))
        assert info["path"] == "ucx-rma"
        assert "excluded" in info["why"]
    finally:
        child.close()


def test_failed_probe_falls_back_with_a_warning():
    exporter = Child(_share_peer.setup)
    try:
        share = exporter.call("export", "host", MiB, {"lifetime": "revoked"})
        exporter.call("stop_broker")  # the host-fd probe will fail for real
        with pytest.warns(gs.SlowPathWarning, match="fell back to ucx-rma") as record:
            view = gs.open(share)
        assert record[0].filename == __file__  # at the caller of gs.open
        assert view.path == "ucx-rma"
        assert "host-fd failed" in view.why
        out = bytearray(16)
        view.get(out)
        assert out == bytes(range(16))
        view.close()
        # The same fallback as an error, with nothing left open.
        fds = len(os.listdir("/proc/self/fd"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", gs.SlowPathWarning)
            with pytest.raises(gs.SlowPathWarning):
                gs.open(share)
        assert _wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds)
    finally:
        exporter.close()


# ---------------------------------------------------------------- lifetimes


def test_closed_lifetime_ends_when_every_importer_closed(peer):
    box = Box(4096)
    share = gs.export(box, lifetime="closed")
    ref = weakref.ref(box)
    del box
    gc.collect()
    assert ref() is not None  # the exporter keeps it alive for the importers
    peer.call("open", "l1", share)
    peer.call("open", "l2", share)
    peer.call("close", "l1")
    gc.collect()
    assert ref() is not None  # one importer still has it open
    peer.call("close", "l2")
    assert _wait_for(lambda: (gc.collect(), ref() is None)[1])
    with pytest.raises(gs.ClosedError, match="no longer available.*lifetime='auto', lifetime=N or 'revoked'"):
        gs.open(share, exclude=["same-process"])


def test_lifetime_n_imports(peer):
    share = gs.export(np.zeros(4096, np.uint8), lifetime=2)
    peer.call("open", "n1", share)
    peer.call("open", "n2", share)
    with pytest.raises(gs.ClosedError, match="as many times as its lifetime allows"):
        peer.call("open", "n3", share)
    export = registered(share)
    peer.call("close", "n1")
    peer.call("close", "n2")
    assert _wait_for(lambda: export.retired)
    assert _wait_for(lambda: registered(share) is None)  # the registry forgot it


def test_lifetime_none_keeps_nothing_alive(peer):
    box = Box(4096)
    share = gs.export(box, lifetime="none")
    ref = weakref.ref(box)
    del box
    gc.collect()
    assert ref() is None
    with pytest.raises(gs.ClosedError, match="no longer available"):
        peer.call("open", "none", share)
    with pytest.raises(gs.InvalidInputError, match="weak"):
        gs.export(bytearray(10), lifetime="none")


@pytest.mark.parametrize("how, path", COPIED)
def test_revocation_stops_remote_access_but_not_existing_mappings(peer, how, path):
    arr = np.ones(MiB, np.uint8)
    buf = gs.allocate(MiB, device="host")
    rma_share = gs.export(arr, lifetime="revoked")
    fd_share = gs.export(buf, lifetime="revoked")
    assert peer.call("open", "rv-rma", rma_share, how)["path"] == path
    assert peer.call("open", "rv-fd", fd_share)["path"] == "host-fd"
    rma_share.revoke()
    fd_share.revoke()
    # Remote access stops at once...
    with pytest.raises(gs.ClosedError, match="revoked"):
        peer.call("get", "rv-rma", 0, 16)
    # ...but a mapping already made on this node cannot be taken back.
    np.asarray(buf)[:4] = 5
    assert peer.call("get", "rv-fd", 0, 4) == b"\x05" * 4
    # And nobody can open either share any more.
    for share in (rma_share, fd_share):
        with pytest.raises(gs.ClosedError, match="revoked"):
            peer.call("open", "again", share)
    peer.call("close", "rv-rma")
    peer.call("close", "rv-fd")


def _memfds() -> list[int]:
    """The inode of each memfd this process holds, once per descriptor."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                found.append(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass  # the descriptor listdir itself held
    return found


@pytest.mark.parametrize("lifetime", ["revoked", "auto", "closed", 3])
def test_a_with_block_revokes_the_share_at_its_exit(peer, lifetime):
    arr = np.arange(MiB, dtype=np.uint8)
    arr_ref = weakref.ref(arr)
    others = set(_memfds())
    buf = gs.allocate(MiB, device="host")
    np.asarray(buf)[:4] = 7
    mine = set(_memfds()) - others

    def fds_of_buf() -> int:  # its own, and those of a share's fd registration
        return sum(ino in mine for ino in _memfds())

    fds_before = fds_of_buf()
    assert fds_before >= 1
    with gs.export(arr, lifetime=lifetime) as cma_share, gs.export(buf, lifetime=lifetime) as fd_share:
        assert peer.call("open", "scoped-cma", cma_share)["path"] == "cma"
        assert peer.call("open", "scoped-fd", fd_share)["path"] == "host-fd"
        assert peer.call("get", "scoped-cma", 0, 4) == bytes([0, 1, 2, 3])
        assert registered(cma_share) is not None and registered(fd_share) is not None
        assert fds_of_buf() > fds_before  # the host-fd share's registration holds its memfds
    try:
        # The block's end revoked both: no open, and the copied view lost access...
        for share in (cma_share, fd_share):
            assert registered(share) is None
            with pytest.raises(gs.ClosedError, match="revoked"):
                peer.call("open", "again", share)
        with pytest.raises(gs.ClosedError, match="revoked"):
            peer.call("get", "scoped-cma", 0, 4)
        # ...while a mapping made on this node stays valid, as for share.revoke().
        np.asarray(buf)[:4] = 9
        assert peer.call("get", "scoped-fd", 0, 4) == b"\x09" * 4
        # The share's fd registration (its memfds) is withdrawn at once.
        assert fds_of_buf() == fds_before
    finally:
        peer.call("close", "scoped-cma")
        peer.call("close", "scoped-fd")
    # The exporter holds the array no longer: once the importer's cma lease
    # (which pins the memory for a copy in flight) has ended, it is freed.
    del arr
    assert _wait_for(lambda: gc.collect() is not None and arr_ref() is None, timeout=5)
    assert fds_of_buf() == fds_before


def test_a_with_block_left_by_an_exception_revokes_and_the_exception_goes_on(peer):
    arr = np.ones(4096, np.uint8)
    arr_ref = weakref.ref(arr)
    with pytest.raises(KeyError, match="inside"):
        with gs.export(arr, lifetime="revoked") as share:
            assert peer.call("open", "raised", share)["path"] == "cma"
            raise KeyError("inside")
    try:
        with pytest.raises(gs.ClosedError, match="revoked"):
            peer.call("open", "again", share)
        with pytest.raises(gs.ClosedError, match="revoked"):
            peer.call("get", "raised", 0, 4)
    finally:
        peer.call("close", "raised")
    del arr
    assert _wait_for(lambda: gc.collect() is not None and arr_ref() is None, timeout=5)


def test_a_with_block_of_a_bundle_and_a_share_revoked_inside_it():
    tree = {"a": np.arange(4, dtype=np.int32), "b": np.ones(3)}
    with gs.export(tree, lifetime="revoked") as bundle_share:
        assert isinstance(bundle_share, gs.BundleShare)
        with gs.open(pickle.loads(pickle.dumps(bundle_share))) as bundle:
            assert bundle["a"].get().tolist() == [0, 1, 2, 3]
    assert registered(bundle_share) is None
    with pytest.raises(gs.ClosedError, match="revoked"):
        gs.open(pickle.loads(pickle.dumps(bundle_share)))
    # Revoked in the block already: the exit leaves it as it is.
    with gs.export(np.ones(8), lifetime="revoked") as share:
        share.revoke()
    assert registered(share) is None


def test_only_the_exporter_can_scope_a_share_with_with(peer):
    share = peer.call("export", "numpy", 64)
    with pytest.raises(gs.ClosedError, match=r"^only the exporting process \(pid \d+\) can scope this share"):
        with share:
            pass
    # Refused before anything happened: the share is still the exporter's to use.
    assert peer.call("open", "still", share)["nbytes"] == 64
    peer.call("close", "still")


def test_only_the_exporter_can_revoke(peer):
    share = peer.call("export", "numpy", 64)
    with pytest.raises(gs.ClosedError, match="only the exporting process"):
        share.revoke()


def test_importer_death_counts_as_closed():
    box = Box(MiB)
    share = gs.export(box)
    ref = weakref.ref(box)
    del box
    child = Child(_share_peer.setup)
    try:
        assert child.call("open", "doomed", share)["path"] == "cma"
        export = registered(share)
        assert export.opens == 1
        del share  # lifetime "auto": the share ends with its last import once nothing here holds it
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.join(10)
    finally:
        child.close()
    assert _wait_for(lambda: export.opens == 0 and export.retired)
    assert _wait_for(lambda: (gc.collect(), ref() is None)[1])


# ---------------------------------------------------------------- bad peers


def test_forged_token_is_denied():
    share = gs.export(np.zeros(64, np.uint8))
    fn, fields = share.__reduce__()
    fields = list(fields)
    fields[2] = os.urandom(32)
    with pytest.raises(gs.AccessDeniedError, match="wrong token"):
        gs.open(fn(*fields), exclude=["same-process"])


def test_unknown_share_id_is_refused():
    share = gs.export(np.zeros(64, np.uint8))
    fn, fields = share.__reduce__()
    fields = list(fields)
    fields[1] = "0" * 32
    with pytest.raises(gs.ClosedError, match="no such share"):
        gs.open(fn(*fields))


def test_dead_exporter_gives_a_clear_error_quickly():
    child = Child(_share_peer.setup)
    share = child.call("export", "host", 4096)
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.join(10)
    child.close()
    start = time.monotonic()
    # the message says what happened, and what to do
    with pytest.raises(gs.ExporterUnreachableError,
                       match=rf"the exporter \(pid {share.exporter_pid}\) has exited.*export the buffer again"):
        gs.open(share, timeout=5)
    assert time.monotonic() - start < 10


def test_exporter_restarts_after_fork():
    parent_share = gs.export(np.zeros(16, np.uint8))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            arr = np.arange(8, dtype=np.uint8)
            share = gs.export(arr)
            ok = share.exporter_pid == os.getpid() and share.control != parent_share.control
            with gs.open(share) as view:
                ok = ok and view.path == "same-process"
            code = 0 if ok else 2
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with gs.open(parent_share) as view:
        assert view.path == "same-process"


@pytest.mark.parametrize("how, path", COPIED)
def test_views_refuse_use_after_fork_and_the_child_starts_fresh(how, path):
    exporter = Child(_share_peer.setup)
    try:
        share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
        view = gs.open(share, **how)
        assert view.path == path
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    view.get(bytearray(8))
                except gs.ClosedError as exc:
                    code = 0 if "fork" in str(exc) else 2
                if code == 0:  # a fresh open in the child works, on its own connection
                    with gs.open(share, **how) as again:
                        out = bytearray(8)
                        again.get(out)
                        code = 0 if out == bytes(range(8)) else 4
                        # UCX does not survive fork: the child goes over cma and says why
                        if path == "ucx-rma" and (again.path != "cma" or "forked from" not in again.why):
                            code = 5
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        out = bytearray(8)
        view.get(out)  # the parent's view still works
        assert out == bytes(range(8))
        view.close()
    finally:
        exporter.close()


@pytest.mark.parametrize("how, path", COPIED)
def test_exporter_stalling_or_dying_mid_transfer_fails_in_bounded_time(how, path):
    exporter = Child(_share_peer.setup)
    try:
        share = exporter.call("export", "numpy", 8 * MiB, {"lifetime": "revoked"})
        view = gs.open(share, **how)
        assert view.path == path
        os.kill(exporter.proc.pid, signal.SIGSTOP)
        dst = bytearray(8 * MiB)
        start = time.monotonic()
        with pytest.raises(gs.WaitTimeoutError):
            view.get(dst, timeout=1.0)
        os.kill(exporter.proc.pid, signal.SIGKILL)
        exporter.proc.join(10)
        with pytest.raises(gs.ClosedError if path == "cma" else gs.UCXError):
            view.get(bytearray(16), timeout=30)
        assert time.monotonic() - start < 40
        view.close()
    finally:
        exporter.close()


def test_revocation_also_kills_descriptors_handed_out_before(peer):
    buf = gs.allocate(MiB, device="host")
    np.asarray(buf)[:4] = 42
    share = gs.export(buf, lifetime="revoked")
    assert peer.call("open", "kd", share)["path"] == "host-fd"
    handed_out = registered(share).descriptors["host-fd"]
    assert peer.call("import_desc", handed_out) == b"\x2a" * 4
    share.revoke()
    with pytest.raises(gs.ExporterUnreachableError, match="not served"):
        peer.call("import_desc", handed_out)
    # Other exports of the same buffer are not affected.
    other = gs.export(buf, lifetime="revoked")
    assert peer.call("open", "kd2", other)["path"] == "host-fd"
    peer.call("close", "kd2")
    peer.call("close", "kd")
    other.revoke()


def test_read_only_memory_is_shared_read_only(peer):
    data = bytes(range(64))
    share = gs.export(data, lifetime="revoked")
    assert share.readonly
    with gs.open(share) as view:
        with pytest.raises(gs.InvalidInputError, match="read-only"):
            view.put(b"x")
        assert np.asarray(view).flags.writeable is False
    peer.call("open", "ro", share)
    with pytest.raises(gs.InvalidInputError, match="read-only"):
        peer.call("put", "ro", 0, b"\x07")
    assert peer.call("get", "ro", 0, 4) == bytes(range(4))
    peer.call("close", "ro")
    assert data == bytes(range(64))
    arr = np.zeros(16, np.uint8)
    assert gs.export(arr, readonly=True).readonly
    assert not gs.export(arr).readonly


def test_same_process_view_of_a_host_buffer_is_an_array():
    buf = gs.allocate(4096, device="host")
    share = gs.export(buf, lifetime="revoked")
    with gs.open(share) as view:
        a = np.asarray(view)
        a[0] = 5
        assert np.asarray(buf)[0] == 5
        assert view.memoryview()[0] == 5
        del a
    share.revoke()


def test_lifetime_none_does_not_keep_the_object_alive_after_remote_opens(peer):
    box = Box(4096)
    share = gs.export(box, lifetime="none")
    ref = weakref.ref(box)
    assert peer.call("open", "n-rma", share, {"prefer": "ucx-rma"})["path"] == "ucx-rma"
    peer.call("close", "n-rma")
    export = registered(share)
    assert _wait_for(lambda: export.state.get("ucx-rma") is None)
    del box
    assert _wait_for(lambda: (gc.collect(), ref() is None)[1])
    assert _wait_for(lambda: export.retired and not export.registrations)


def test_paths_argument_limits_offers_and_registrations():
    buf = gs.allocate(4096, device="host")
    share = gs.export(buf, paths=["ucx-rma"], lifetime="revoked")
    assert share.offers == ("ucx-rma",)
    assert registered(share).registrations == []
    assert registered(share).descriptors == {}
    share.revoke()


def test_control_host_variable_is_checked(monkeypatch):
    from gpushare._exporter.registry import Exporter

    monkeypatch.setenv("GPUSHARE_CONTROL_HOST", "localhost")
    with pytest.raises(gs.InvalidInputError, match="GPUSHARE_CONTROL_HOST"):
        Exporter()


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00\x00\x00\x05hello",
        b"\xff\xff\xff\xff" + b"x" * 100,
        b"\x00\x00\x00\x02[]",
        b'\x00\x00\x00\x0e{"op": "open"}',
        b"\x00\x00\x00\x04" + bytes([0xC3, 0x28, 0xA0, 0xA1]),
    ],
)
def test_control_channel_survives_garbage(payload):
    import socket
    import struct
    import json

    arr = np.arange(64, dtype=np.uint8)
    share = gs.export(arr, lifetime="revoked")
    host, port = share.control[0]
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(payload)
        s.settimeout(15)
        try:
            while s.recv(4096):
                pass  # the exporter answers or just closes; it must close
        except (ConnectionResetError, socket.timeout) as exc:
            assert not isinstance(exc, socket.timeout), "the exporter kept a garbage connection open"
    # A peer that does not hold the key gets no further than the challenge,
    # whatever it sends: refused cleanly.
    def ask(s, message):
        body = json.dumps(message).encode()
        s.sendall(struct.pack("!I", len(body)) + body)
        n = struct.unpack("!I", s.recv(4))[0]
        return json.loads(s.recv(n))

    with socket.create_connection((host, port), timeout=5) as s:
        assert ask(s, {"op": "hello", "v": _control.PROTOCOL})["code"] == "denied"  # no nonce, no challenge
    with socket.create_connection((host, port), timeout=5) as s:
        hello = ask(s, {"op": "hello", "v": _control.PROTOCOL, "nonce": {"b": "00" * 16}})
        assert hello["ok"] is True and "proof" in hello
        reply = ask(s, {"op": "open", "id": 7, "share": share.share_id, "token": share.token.hex(),
                        "path": "ucx-rma"})  # the right token, but no proof of the key first
        assert reply["code"] == "denied" and "payload" not in reply
    # The exporter still serves real importers.
    child = Child(_share_peer.setup)
    try:
        assert child.call("open", "after-garbage", share)["path"] == "cma"
        assert child.call("get", "after-garbage", 0, 4) == bytes(range(4))
    finally:
        child.close()
    share.revoke()


def test_cuda_paths_are_chosen_only_where_cuda_can_map():
    from gpushare._open_plan import choose
    from gpushare._cuda import _driver as _cuda
    from gpushare._process import node_key
    from gpushare._share import SHARE_FORMAT, Share

    share = Share._make(SHARE_FORMAT, "1" * 32, b"\0" * 32, 1, node_key(), (("127.0.0.1", 9),), 4096, 0,
                        (4096,), "|u1", ("same-process", "posix-fd", "cuda-ipc", "ucx-rma"), "closed", None,
                        False)
    order, left_out, _ = choose(share, None, None)
    if _cuda.unavailable_reason() is None:
        assert order[:2] == ["posix-fd", "cuda-ipc"]
    else:  # no driver here: straight to ucx-rma, saying why, with no failed probe
        assert order == ["ucx-rma"]
        assert any("cannot map CUDA memory" in why for why in left_out)


@pytest.mark.parametrize("how, path", COPIED)
def test_exporter_exits_cleanly_with_views_open(how, path):
    exporter = Child(_share_peer.setup)
    share = exporter.call("export", "numpy", MiB, {"lifetime": "revoked"})
    view = gs.open(share, **how)
    try:
        assert view.path == path
        start = time.monotonic()
        assert exporter.close(timeout=30) == 0  # a normal exit, not a kill after a hang
        assert time.monotonic() - start < 30
        with pytest.raises(gs.ClosedError if path == "cma" else gs.UCXError):
            view.get(bytearray(16), timeout=30)
        with pytest.raises(gs.ExporterUnreachableError):
            gs.open(share, timeout=5)
    finally:
        view.close()


def test_a_host_share_registers_its_fds_with_the_broker_once_and_revoking_withdraws_them():
    from gpushare._paths.broker import get_broker

    broker = get_broker()
    with gs.allocate(4096, device="host") as buf:
        before = len(broker)
        share = gs.export(buf, lifetime="revoked")
        assert len(broker) == before + 1  # the share's own registration, not the buffer's as well
        view = gs.open(share, exclude=["same-process"])
        try:
            assert view.path == "host-fd"
        finally:
            view.close()
        share.revoke()
        assert len(broker) == before  # nothing of the share is left served
