"""Host-memory sharing between real processes through memfds and the broker."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _procs import Child, wait_for
from _same_node_peer import counts

import gpushare as gs
from gpushare import _service
from gpushare._descriptors import PosixFdBufferDescriptor
from gpushare._paths import broker as broker_mod
from gpushare._process import node_identity
from gpushare._paths import host_fd

PAGE = host_fd.PAGE


def forged(desc: PosixFdBufferDescriptor, **changes: object) -> PosixFdBufferDescriptor:
    """A copy of ``desc`` with some fields replaced, built the way unpickling does."""
    fields = dict(zip(PosixFdBufferDescriptor._FIELDS, desc._fields(), strict=True))
    fields.update(changes)
    return PosixFdBufferDescriptor._from_fields(*fields.values())


@pytest.fixture
def no_leaks():
    """Fails the test if fds or memfd mappings in this process outlive it.
    The broker and the service thread (fds for the life of the process) are
    started first."""
    broker_mod.get_broker()
    # Connections and UCX agents of earlier tests close a moment after their
    # last use: let them go first.
    service = _service.get_service()
    wait_for(lambda: service.stats()["connections"] == 0 and service.stats()["timers"] == 0, 10)
    gc.collect()
    before, fds_before = counts(), _fd_targets()
    yield
    # The service thread closes the broker's side of a connection just after
    # the importer's side: give it a moment.
    deadline = time.monotonic() + 5
    while counts() != before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    after = counts()
    if after != before:  # say which fds, so that a leak can be traced
        fds_after = _fd_targets()
        opened = {fd: t for fd, t in fds_after.items() if fds_before.get(fd) != t}
        closed = {fd: t for fd, t in fds_before.items() if fds_after.get(fd) != t}
        assert after == before, f"opened {opened}, closed {closed}"


def _fd_targets() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


@pytest.fixture
def child():
    c = Child(_setup_importer)
    yield c
    assert c.close() == 0


def _setup_importer() -> dict:
    from _same_node_peer import importer_setup

    return importer_setup()


def _setup_exporter(size: int, chunk_size: int | None, fill: int) -> dict:
    from _same_node_peer import exporter_setup

    return exporter_setup(size, chunk_size, fill)


def test_exported_in_one_process_mapped_in_another_writes_visible_both_ways(child, no_leaks):
    size = 3 * PAGE + 100  # three physical chunks, the last one partly used
    with gs.allocate(size, device="host", chunk_size=PAGE * 2) as buf:
        assert buf.sizes == (2 * PAGE, 2 * PAGE)
        mine = np.asarray(buf)
        mine[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
        desc = gs.export_buffer(buf)
        assert desc.sizes == buf.sizes and desc.size == size

        before = child.hello
        got = child.call("import", pickle.loads(pickle.dumps(desc)))
        assert got["size"] == size
        assert got["maps"] == before["maps"] + 2  # one mapping per memfd
        assert got["fds"] == before["fds"]  # fds closed once mapped

        # the importer sees what the exporter wrote, across the chunk boundary
        assert child.call("read", 2 * PAGE - 8, 16) == mine[2 * PAGE - 8 : 2 * PAGE + 8].tobytes()
        # the exporter sees the importer's writes, in both chunks: no copy anywhere
        child.call("write", 5, b"from-child")
        child.call("write", size - 4, b"tail")
        assert mine[5:15].tobytes() == b"from-child"
        assert mine[size - 4 :].tobytes() == b"tail"
        mine[PAGE * 2 : PAGE * 2 + 6] = np.frombuffer(b"parent", dtype=np.uint8)
        assert child.call("read", PAGE * 2, 6) == b"parent"

        after = child.call("close")
        assert after == {"fds": before["fds"], "maps": before["maps"]}
        del mine


def test_many_chunks_pass_in_several_scm_rights_messages(no_leaks):
    # 300 memfds: more than one SCM_RIGHTS message may carry
    with gs.allocate(300 * PAGE, device="host", chunk_size=PAGE) as buf:
        a = np.asarray(buf)
        a[::PAGE] = np.arange(300, dtype=np.uint16).astype(np.uint8)
        with gs.import_buffer(gs.export_buffer(buf)) as other:
            b = np.asarray(other)
            assert np.array_equal(b[::PAGE], a[::PAGE])
            assert len(other.sizes) == 300
            del b
        del a


def test_import_after_exporter_exit_keeps_mappings_and_refuses_new_imports(no_leaks):
    size = 5 * PAGE
    exporter = Child(_setup_exporter, size, 2 * PAGE, 0x5A)
    desc = exporter.hello["desc"]
    try:
        buf = gs.import_buffer(desc)
    finally:
        assert exporter.close() == 0
    assert not exporter.proc.is_alive()
    # What is promised: memory already mapped stays valid and writable ...
    view = np.asarray(buf)
    assert view.min() == view.max() == 0x5A
    view[:] = 7
    assert view.sum() == 7 * size
    # ... and a new import fails clearly: the broker is gone with its process.
    with pytest.raises(gs.ExporterUnreachableError, match="exited"):
        gs.import_buffer(desc)
    del view
    buf.close()


def test_wrong_token_refused_in_another_process(child, no_leaks):
    with gs.allocate(PAGE, device="host") as buf:
        desc = gs.export_buffer(buf)
        wrong = forged(desc, token=bytes(32))
        kind, message = child.call("try_import", wrong)
        assert kind == "AccessDeniedError"
        assert "wrong token" in message
        assert child.call("counts") == {k: child.hello[k] for k in ("fds", "maps")}
        # the right token still works afterwards
        assert child.call("try_import", desc) == ("ok", "")


def test_closed_buffer_is_no_longer_served(no_leaks):
    buf = gs.allocate(PAGE, device="host")
    desc = gs.export_buffer(buf)
    buf.close()
    with pytest.raises(gs.ExporterUnreachableError, match="not served"):
        gs.import_buffer(desc)


def test_size_reported_by_fd_must_match_descriptor(no_leaks):
    with gs.allocate(2 * PAGE, device="host") as buf:
        desc = gs.export_buffer(buf)
        with pytest.raises(
            gs.InvalidInputError, match=f"is {2 * PAGE} bytes; the descriptor says {4 * PAGE}"
        ):
            gs.import_buffer(forged(desc, sizes=(4 * PAGE,)))
        with pytest.raises(gs.InvalidInputError, match="offers 1 file descriptors; the descriptor names 2"):
            gs.import_buffer(forged(desc, sizes=(PAGE, PAGE)))
        with pytest.raises(gs.InvalidInputError, match="multiples of the page size"):
            gs.import_buffer(forged(desc, sizes=(2 * PAGE + 1,)))


def test_impostor_broker_and_other_node_are_refused(no_leaks):
    with gs.allocate(PAGE, device="host") as buf:
        desc = gs.export_buffer(buf)
        with pytest.raises(gs.AccessDeniedError, match="impostor"):
            gs.import_buffer(forged(desc, pid=os.getppid()))
        with pytest.raises(gs.UnsupportedError, match="only on the same node"):
            gs.import_buffer(forged(desc, node="another-boot:another-host"))
        with pytest.raises(gs.ExporterUnreachableError, match="nothing listens"):
            gs.import_buffer(forged(desc, address="\0gpushare-nobody-here"))


def test_silent_broker_times_out(no_leaks):
    with gs.allocate(PAGE, device="host") as buf:
        desc = gs.export_buffer(buf)
    address = f"\0gpushare-test-mute-{os.getpid()}"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        mute.bind(address)
        mute.listen(1)  # takes connections into the backlog, never answers
        silent = forged(desc, address=address)
        t0 = time.monotonic()
        with pytest.raises(gs.ExporterUnreachableError, match="no answer within 0.3 s"):
            host_fd.import_host(silent, timeout=0.3)
        assert time.monotonic() - t0 < 3
        t0 = time.monotonic()
        with pytest.raises(gs.ExporterUnreachableError, match="no answer within 0.4 s"):
            gs.import_buffer(silent, timeout=0.4)  # the public call keeps its timeout too
        assert time.monotonic() - t0 < 3
    finally:
        mute.close()


def test_close_is_idempotent_refuses_live_views_and_then_use(no_leaks):
    buf = gs.allocate(PAGE, device="host")
    view = np.asarray(buf)
    with pytest.raises(BufferError, match="still used"):
        buf.close()
    assert not buf.is_closed
    view[0] = 1  # still mapped
    del view
    buf.close()
    buf.close()
    assert buf.is_closed
    with pytest.raises(gs.ClosedError):
        np.asarray(buf)
    with pytest.raises(gs.ClosedError):
        gs.export_buffer(buf)


def test_dropped_buffers_release_everything(no_leaks):
    buf = gs.allocate(4 * PAGE, device="host", chunk_size=PAGE)
    imported = gs.import_buffer(gs.export_buffer(buf))
    view = np.asarray(imported)  # outlives the buffer object
    del imported, buf
    gc.collect()
    view[:] = 3  # the mapping is kept by the view ...
    assert int(view.sum()) == 3 * 4 * PAGE
    del view  # ... and goes with it (checked by no_leaks)


def test_host_buffer_api(no_leaks):
    with gs.allocate(PAGE + 1, device="host") as buf:
        assert isinstance(buf, gs.HostBuffer)
        assert buf.size == buf.nbytes == PAGE + 1 and buf.device == "host"
        m = buf.memoryview()
        assert len(m) == PAGE + 1 and not m.readonly
        m[0] = 9
        assert np.asarray(buf)[0] == 9
        assert np.asarray(buf).ctypes.data == buf.ptr  # a view, not a copy
        assert gs.export_buffer(buf) is gs.export_buffer(buf)
        assert "token" not in repr(gs.export_buffer(buf))
        m.release()
    with pytest.raises(TypeError):
        gs.HostBuffer()


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {"device": "host"}, "size is 0"),
        ((True,), {"device": "host"}, "bool"),
        ((PAGE,), {"device": "host", "chunk_size": 100}, "multiple of the page size"),
        ((PAGE,), {"device": "gpu"}, "expected 'host' \\(or 'cpu'\\) or a device ordinal"),
        ((1.5,), {"device": "host"}, "expected an integer"),
    ],
)
def test_allocate_refuses_bad_arguments(args, kwargs, match):
    with pytest.raises(gs.InvalidInputError, match=match):
        gs.allocate(*args, **kwargs)


def test_export_and_import_refuse_wrong_kinds(no_leaks):
    with gs.allocate(PAGE, device="host") as buf:
        with pytest.raises(gs.UnsupportedError, match="'posix-fd', not 'fabric'"):
            gs.export_buffer(buf, handle_type="fabric")
        with pytest.raises(gs.InvalidInputError, match="handle_type is 'nfs'"):
            gs.export_buffer(buf, handle_type="nfs")
        with gs.import_buffer(gs.export_buffer(buf)) as imported:
            with pytest.raises(gs.UnsupportedError, match="was imported"):
                gs.export_buffer(imported)
    with pytest.raises(gs.InvalidInputError, match="expects a descriptor"):
        gs.import_buffer(b"not a descriptor")


def run_forked(target, *args):
    """Run ``target(*args, conn)`` in a forked child; return what it sends."""
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, theirs))
    p.start()
    theirs.close()
    try:
        assert ours.poll(30), "forked child did not answer"
        return ours.recv()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)
        ours.close()
        assert p.exitcode == 0


def _fork_child(inherited, parent_desc, conn) -> None:
    try:
        with gs.allocate(PAGE, device="host") as buf:
            desc = gs.export_buffer(buf)
            with gs.import_buffer(desc) as again:
                np.asarray(again)[0] = 1
            # the parent's buffer, inherited: exported again, by this process's broker
            again_desc = gs.export_buffer(inherited)
            with gs.import_buffer(again_desc) as mapped:
                first = int(np.asarray(mapped)[0])
            conn.send(
                (
                    desc.address != parent_desc.address,
                    again_desc.address == desc.address != parent_desc.address,
                    desc.pid == os.getpid(),
                    first,
                    None,
                )
            )
    except BaseException as exc:  # noqa: BLE001
        conn.send((False, False, False, None, repr(exc)))


def test_forked_child_runs_its_own_broker(no_leaks):
    with gs.allocate(PAGE, device="host") as buf:
        np.asarray(buf)[0] = 77
        desc = gs.export_buffer(buf)
        new_broker, reexported, own_pid, first, error = run_forked(_fork_child, buf, desc)
        assert error is None
        assert new_broker and reexported and own_pid
        assert first == 77
        # the parent's broker was not disturbed by the child's
        with gs.import_buffer(desc) as again:
            assert again.size == PAGE
            assert gs.export_buffer(buf) is desc


def test_import_starts_nothing_and_the_broker_starts_on_first_export():
    code = (
        "import sys, threading, gpushare as gs\n"
        "print(threading.active_count(), any(m.startswith('cuda') for m in sys.modules))\n"
        "b = gs.allocate(4096, device='host')\n"
        "print(threading.active_count())\n"
        "gs.export_buffer(b)\n"
        "print(threading.active_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["1", "False", "1", "2"]


def test_node_identity_is_boot_id_and_host():
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert node_identity() == f"{f.read().strip()}:{socket.gethostname()}"


def _import_as_nobody(desc, conn) -> None:
    try:
        os.setgid(65534)
        os.setuid(65534)
        gs.import_buffer(desc)
        conn.send(("imported", ""))
    except BaseException as exc:  # noqa: BLE001
        conn.send((type(exc).__name__, str(exc)))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run an importer as another user")
def test_other_users_are_refused_by_peer_credentials(no_leaks):
    # fork, not spawn: the interpreter under test may not be readable by "nobody"
    with gs.allocate(PAGE, device="host") as buf:
        kind, message = run_forked(_import_as_nobody, gs.export_buffer(buf))
    assert kind == "AccessDeniedError", message
    assert "user id 65534 may not import memory of user id 0" in message


def test_a_silent_peer_neither_blocks_others_nor_stays(no_leaks, monkeypatch):
    monkeypatch.setattr(broker_mod, "TIMEOUT", 0.5)
    with gs.allocate(PAGE, device="host") as buf:
        desc = gs.export_buffer(buf)
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            silent.connect(desc.address)  # and never sends its request
            t0 = time.monotonic()
            with gs.import_buffer(desc) as other:  # served meanwhile
                assert other.size == PAGE
            assert time.monotonic() - t0 < 0.4
            silent.settimeout(5)
            assert silent.recv(64) == b""  # dropped at its deadline
            assert time.monotonic() - t0 < 3
        finally:
            silent.close()


def test_a_garbage_request_gets_a_clear_refusal(no_leaks):
    with gs.allocate(PAGE, device="host") as buf:
        desc = gs.export_buffer(buf)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(desc.address)
        s.sendall(b"GET / HTTP/1.0\r\n" + bytes(29))
        reply = s.recv(4096)
    magic, _, status, length, count = broker_mod._REPLY.unpack(reply[: broker_mod._REPLY.size])
    assert (magic, status, count) == (b"GSFD", broker_mod._BAD_REQUEST, 0)
    assert reply[broker_mod._REPLY.size :].decode() == "not a gpushare request of protocol 1"
    with gs.allocate(PAGE, device="host") as buf:  # and the broker still serves
        with gs.import_buffer(gs.export_buffer(buf)) as other:
            assert other.size == PAGE


def test_broker_stops_cleanly():
    b = broker_mod.Broker()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(b.address)  # served by the process's one service thread
    # The service thread serves it (the cma copy threads, if started, only copy).
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("gpushare") and not t.name.startswith("gpushare-cma")] == ["gpushare-service"]
    b.stop()
    b.stop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, pytest.raises(ConnectionRefusedError):
        s.connect(b.address)
    code = (
        "import time, gpushare as gs\n"
        "b = gs.allocate(4096, device='host'); gs.export_buffer(b)\n"
        "print(time.monotonic())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == ""
    assert time.monotonic() - float(out.stdout) < 2  # the exit did not wait on the broker


def test_public_names():
    names = {
        "allocate",
        "export_buffer",
        "import_buffer",
        "capabilities",
        "VirtualMemoryFabricBufferDescriptor",
        "PosixFdBufferDescriptor",
        "CudaIpcBufferDescriptor",
        "CudaPoolBufferDescriptor",
        "HostBuffer",
        "AccessDeniedError",
        "ExporterUnreachableError",
        "UnsupportedError",
        "CUDAError",
    }
    assert names <= set(gs.__all__)
    for name in names:
        assert getattr(gs, name).__doc__, name
    for error, builtin in [
        (gs.AccessDeniedError, PermissionError),
        (gs.ExporterUnreachableError, ConnectionError),
        (gs.UnsupportedError, Exception),
        (gs.CUDAError, Exception),
    ]:
        assert issubclass(error, gs.GpuShareError) and issubclass(error, builtin)
