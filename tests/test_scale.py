"""The control plane at scale: one service thread, leases as records, reuse, pruning."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

import gpushare as gs
from gpushare import _importer

from _procs import Child, in_threads, wait_for as _wait_for
import _share_peer

MiB = 1 << 20
#: Long enough for an idle control connection to go.
SETTLE = _importer.IDLE_LINGER + 1.5


@pytest.fixture
def exporter():
    child = Child(_share_peer.setup)
    yield child
    assert child.close() == 0


def test_thread_count_stays_flat_across_2000_host_fd_leases(exporter):
    share = exporter.call("export", "host", 4096, {"lifetime": "revoked"})
    importer = Child(_share_peer.setup)
    try:
        before = exporter.call("stats")
        assert importer.call("open_many", "all", [share], 2000, timeout=300) == ["host-fd"]
        during = exporter.call("stats")
        assert during["exporter"]["leases"] == 2000 and during["exporter"]["sessions"] == 1
        assert during["threads"] == before["threads"] < 10
        assert during["tasks"] == before["tasks"] < 10
        mine = importer.call("stats")
        assert mine["importer"] == {"connections": 1, "leases": 2000}
        assert mine["threads"] < 10
        # Idle with 2,000 leases: the service thread sleeps (no polling).
        time.sleep(1.0)
        assert exporter.call("stats")["cpu_s"] - during["cpu_s"] < 0.1
        assert importer.call("stats")["cpu_s"] - mine["cpu_s"] < 0.1
        importer.call("close_many", "all")
        assert _wait_for(lambda: exporter.call("stats")["exporter"]["leases"] == 0)
    finally:
        importer.close()


def test_thread_count_stays_flat_across_many_importers(exporter):
    shares = [exporter.call("export", "host", 4096, {"lifetime": "revoked"}) for _ in range(20)]
    before = exporter.call("stats")
    importers = [Child(_share_peer.setup) for _ in range(4)]
    try:
        for child in importers:
            assert child.call("open_many", "v", shares, 5, timeout=120) == ["host-fd"]
        during = exporter.call("stats")
        assert during["exporter"]["sessions"] == 4 and during["exporter"]["leases"] == 400
        assert during["threads"] == before["threads"] < 10
        assert during["tasks"] == before["tasks"] < 10
    finally:
        for child in importers:
            child.close()
    # The importers exited: the kernel closed their connections, ending every lease.
    assert _wait_for(lambda: exporter.call("stats")["exporter"]["leases"] == 0)
    assert exporter.call("stats")["exporter"]["sessions"] == 0


def test_broker_and_control_serve_fds_numbered_above_1024(exporter, monkeypatch):
    assert exporter.call("fill_fds", 1500) >= 1500
    share = exporter.call("export", "host", MiB, {"lifetime": "revoked"})
    desc = exporter.call("export_desc", 4096)
    for _ in range(3):  # and keeps serving afterwards
        with gs.open(share) as view:
            assert view.path == "host-fd"
            out = bytearray(4)
            view.get(out, 100)
            assert out == bytes(range(100, 104))
        with gs.import_buffer(desc) as buf:  # from the broker itself
            assert bytes(buf.memoryview()[:4]) == b"desc"
    # Over TCP, the fds come from the broker too.
    monkeypatch.setattr(_importer, "connect_local", lambda share, deadline: None)
    time.sleep(SETTLE)  # the local connection goes
    with gs.open(share) as view:
        assert view.path == "host-fd"
    assert exporter.call("stats")["exporter"]["local_sessions"] == 0


@pytest.mark.parametrize("kind,path", [("numpy", "ucx-rma"), ("numpy", "cma"), ("host", "host-fd")])
def test_no_connection_outlives_its_open(exporter, kind, path):
    share = exporter.call("export", kind, MiB, {"lifetime": "revoked"})
    importer = Child(_share_peer.setup)
    how = {"prefer": path}
    try:
        assert importer.call("cycle", share, 1, how) == path
        time.sleep(SETTLE)
        before = (importer.call("stats")["sockets"], exporter.call("stats")["sockets"])
        assert importer.call("cycle", share, 200, how, timeout=300) == path
        time.sleep(SETTLE)
        after = (importer.call("stats")["sockets"], exporter.call("stats")["sockets"])
        assert after == before
        assert importer.call("stats")["importer"]["connections"] == 0
        assert exporter.call("stats")["exporter"]["sessions"] == 0
    finally:
        importer.close()


def test_registry_returns_to_its_start_after_shares_end(exporter):
    exporter.call("export", "numpy", 64, {"lifetime": "revoked"})  # starts the exporter
    start = exporter.call("stats")
    closed = [exporter.call("export", "host", 4096, {"lifetime": "closed"}) for _ in range(20)]
    counted = [exporter.call("export", "numpy", 4096, {"lifetime": 2}) for _ in range(10)]
    revoked = [exporter.call("export", "host", 4096, {"lifetime": "revoked"}) for _ in range(10)]
    grown = exporter.call("stats")
    assert grown["exporter"]["exports"] == start["exporter"]["exports"] + 40
    for share in closed:
        with gs.open(share, exclude=["same-process"]) as view:
            assert view.path == "host-fd"
    for share in counted:
        for _ in range(2):
            with gs.open(share, exclude=["same-process", "cma"]) as view:
                assert view.path == "ucx-rma"
    exporter.call("revoke_all", revoked)
    assert _wait_for(lambda: exporter.call("stats")["exporter"]["exports"] == start["exporter"]["exports"])
    # Every share's own fd registration was withdrawn; the buffers' own go with them.
    exporter.call("drop_exports")
    assert _wait_for(lambda: exporter.call("stats")["broker"] == start["broker"])
    # A late open still hears why.
    with pytest.raises(gs.ClosedError, match="revoked"):
        gs.open(revoked[0])
    with pytest.raises(gs.ClosedError, match="no longer available"):
        gs.open(closed[0])


@pytest.mark.parametrize("local", [True, False], ids=["unix", "tcp"])
def test_a_further_open_of_the_same_exporter_is_one_request(exporter, monkeypatch, local):
    if not local:
        monkeypatch.setattr(_importer, "connect_local", lambda share, deadline: None)
    a = exporter.call("export", "host", 4096, {"lifetime": "revoked"})
    b = exporter.call("export", "host", 4096, {"lifetime": "revoked"})
    first = gs.open(a)
    try:
        before = exporter.call("stats")["exporter"]
        mine = _importer.get_importer().stats()["connections"]
        t0 = time.perf_counter()
        second = gs.open(b)
        elapsed = time.perf_counter() - t0
        after = exporter.call("stats")["exporter"]
        assert after["sessions"] == before["sessions"] == 1
        # Same node: the fds came with the reply, over the exporter's Unix socket.
        assert after["local_sessions"] == int(local)
        assert second.path == "host-fd"
        assert after["messages"] == before["messages"] + 1  # the open request, nothing else
        assert _importer.get_importer().stats()["connections"] == mine
        assert elapsed < 0.5, elapsed  # on a loaded 2-core machine; ~1 ms when idle
        second.close()
    finally:
        first.close()


def test_a_forked_child_drops_the_parents_leases(exporter):
    share = exporter.call("export", "host", 4096, {"lifetime": "revoked"})
    # Earlier tests' idle connections close on their own (2 s after their last use): one closing
    # around the fork would free its fd number for another file, which the child keeps.
    links = _importer.get_importer()._links
    assert _wait_for(lambda: not links, 10), links
    view = gs.open(share)
    link, = links.values()
    fd = link.conn.fileno
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                os.fstat(fd)
                code = 2  # the inherited control connection is still open
            except OSError:
                view.close()  # a no-op here: the parent's lease is not the child's
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert exporter.call("stats")["exporter"]["leases"] == 1  # the parent's lease is intact
    out = bytearray(4)
    view.get(out)
    assert out == bytes(range(4))
    view.close()
    assert _wait_for(lambda: exporter.call("stats")["exporter"]["leases"] == 0)


def test_a_silent_control_peer_does_not_block_others(exporter, monkeypatch):
    share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
    host, port = share.control[0]
    with socket.create_connection((host, port), timeout=5) as silent:
        silent.sendall(b"\x00\x00\x01\x00{")  # a frame that never completes
        t0 = time.monotonic()
        with gs.open(share) as view:
            out = bytearray(4)
            view.get(out)
        assert out == bytes(range(4)) and time.monotonic() - t0 < 5


def _hello_as_nobody(address, conn) -> None:
    try:
        os.setgid(65534)
        os.setuid(65534)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(address)
            body = b'{"op":"hello"}'
            try:
                s.sendall(len(body).to_bytes(4, "big") + body)
                conn.send(("answered", s.recv(4096)))
            except (BrokenPipeError, ConnectionResetError):
                conn.send(("answered", b""))  # closed under our feet
    except BaseException as exc:  # noqa: BLE001
        conn.send((type(exc).__name__, str(exc)))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
def test_the_local_control_socket_refuses_other_users():
    import multiprocessing as mp

    from gpushare._paths.broker import control_address

    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    address = control_address(os.getpid(), share.control[0][1])
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_hello_as_nobody, args=(address, theirs))
    proc.start()
    theirs.close()
    try:
        assert ours.poll(30)
        assert ours.recv() == ("answered", b"")  # closed before a byte was read
    finally:
        proc.join(10)
        ours.close()
    share.revoke()


def test_nothing_after_a_refused_hello_is_served():
    import json
    import struct

    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    host, port = share.control[0]

    def frame(message):
        body = json.dumps(message).encode()
        return struct.pack("!I", len(body)) + body

    open_request = {"op": "open", "id": 1, "share": share.share_id, "token": {"b": share.token.hex()},
                    "path": "ucx-rma"}
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(frame({"op": "open"}) + frame(open_request))  # no hello first
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    (n,) = struct.unpack("!I", data[:4])
    assert json.loads(data[4 : 4 + n])["message"] == "expected hello"
    assert len(data) == 4 + n  # one refusal, then the connection closed; the open went unanswered
    from gpushare._exporter.registry import registered

    assert registered(share).opens == 0
    share.revoke()


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (SIGSTOP takes effect asynchronously)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    for task in tasks:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "T":
                return False
    return True


def test_an_open_that_timed_out_gives_its_late_lease_back(exporter):
    import signal

    share = exporter.call("export", "host", 4096, {"lifetime": "revoked"})
    with gs.open(share):  # the connection exists; the next open is one request on it
        late_by = exporter.call("stats")["exporter"]["messages"] + 2  # the late open and its "failed"
        os.kill(exporter.proc.pid, signal.SIGSTOP)
        try:
            assert _wait_for(lambda: _stopped(exporter.proc.pid))
            t0 = time.monotonic()
            with pytest.raises(gs.ExporterUnreachableError):
                gs.open(share, timeout=1.0)
            assert time.monotonic() - t0 < 3
        finally:
            os.kill(exporter.proc.pid, signal.SIGCONT)
        # The exporter answers late; nobody waits, so the lease is handed back
        # (the exporter may count 1 before it read the late open: both are waited for).
        assert _wait_for(lambda: exporter.call("stats")["exporter"]["messages"] >= late_by)
        assert _wait_for(lambda: exporter.call("stats")["exporter"]["leases"] == 1)
        assert _wait_for(lambda: _importer.get_importer().stats()["leases"] == 1)
    assert _wait_for(lambda: exporter.call("stats")["exporter"]["leases"] == 0)


def test_a_peer_that_never_reads_its_replies_is_dropped(monkeypatch):
    import json
    import struct

    from gpushare._exporter import sessions

    monkeypatch.setattr(sessions, "MAX_BACKLOG", 64 << 10)
    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    host, port = share.control[0]

    def frame(message):
        body = json.dumps(message).encode()
        return struct.pack("!I", len(body)) + body

    request = frame({"op": "open", "id": 1, "share": "0" * 32, "token": {"b": "00" * 32}, "path": "ucx-rma"})
    from gpushare import _auth, _control

    with socket.create_connection((host, port), timeout=10) as s:
        # A peer that holds the key (this process's): past the challenge.
        mine = _auth.new_nonce()
        s.sendall(frame({"op": "hello", "v": _control.PROTOCOL, "nonce": {"b": mine.hex()}}))
        n = struct.unpack("!I", s.recv(4))[0]
        hello = _control.decode(json.loads(s.recv(n)))
        assert _auth.verify("exporter", mine, hello["nonce"], hello["proof"])
        s.sendall(frame({"op": "auth", "proof": {"b": _auth.proof("importer", mine, hello["nonce"]).hex()}}))
        dropped = False
        try:
            # Refusals fill both sockets' buffers (megabytes on loopback), then
            # pile up in the exporter, which hangs up.
            for _ in range(5_000):
                s.sendall(request * 64)
        except (BrokenPipeError, ConnectionResetError):
            dropped = True
        assert dropped
    with gs.open(share, exclude=["same-process"]) as view:  # and it serves others
        assert view.path == "cma"
    share.revoke()


def test_connection_deadlines_fire_once_at_their_latest_setting():
    from gpushare._connection import Protocol
    from gpushare._service import get_service

    service = get_service()
    fired: list[tuple[str, float]] = []

    class Mark(Protocol):
        def __init__(self, name):
            self.name = name

        def deadline_passed(self, conn):
            fired.append((self.name, time.monotonic()))
            conn.close()

    pairs = [socket.socketpair() for _ in range(3)]
    t0 = time.monotonic()
    later = service.connect(pairs[0][0], Mark("later"), t0 + 0.2)
    never = service.connect(pairs[1][0], Mark("never"), t0 + 0.2)
    earlier = service.connect(pairs[2][0], Mark("earlier"), t0 + 5.0)

    def move():
        later.deadline = t0 + 0.8
        never.deadline = None
        earlier.deadline = t0 + 0.4

    service.run(move)
    assert _wait_for(lambda: len(fired) == 2, 5)
    time.sleep(0.5)
    assert [name for name, _ in fired] == ["earlier", "later"]
    assert fired[0][1] - t0 >= 0.4 and fired[1][1] - t0 >= 0.8
    assert not never.closed
    service.run(never.close)
    for a, b in pairs:
        b.close()


def test_a_shares_region_is_added_on_its_first_remote_open_and_removed_when_no_view_is_open():
    from gpushare._exporter.registry import registered

    share = gs.export(np.arange(4096, dtype=np.uint64).astype(np.uint8), lifetime="revoked")
    export = registered(share)
    assert export.state.get("ucx-rma") is None  # exporting registers nothing
    importer = Child(_share_peer.setup)
    try:
        assert importer.call("open", "a", share, {"prefer": "ucx-rma"})["path"] == "ucx-rma"
        assert export.state.get("ucx-rma") is not None
        assert importer.call("get", "a", 0, 4) == bytes(range(4))
        importer.call("close", "a")
        assert _wait_for(lambda: export.state.get("ucx-rma") is None, 10)
        assert importer.call("open", "b", share, {"prefer": "ucx-rma"})["path"] == "ucx-rma"  # added again
        assert importer.call("get", "b", 4, 4) == bytes(range(4, 8))
        share.revoke()  # and removed when the share ends
        assert export.state.get("ucx-rma") is None
    finally:
        importer.close()


def test_a_hello_of_another_protocol_is_refused_clearly():
    import json
    import struct

    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    host, port = share.control[0]
    with socket.create_connection((host, port), timeout=10) as s:
        body = json.dumps({"op": "hello", "v": 1}).encode()
        s.sendall(struct.pack("!I", len(body)) + body)
        n = struct.unpack("!I", s.recv(4))[0]
        reply = json.loads(s.recv(n))
        assert s.recv(16) == b""  # and hung up
    from gpushare import _control

    assert reply["ok"] is False and f"control protocol 1; this exporter speaks {_control.PROTOCOL}" in reply["message"]
    share.revoke()


def test_threads_opening_at_once_share_one_connection(exporter):
    shares = [exporter.call("export", "host", 4096, {"lifetime": "revoked"}) for _ in range(4)]
    views = []

    def opener(i):
        for k in range(25):
            view = gs.open(shares[(i + k) % len(shares)])
            out = bytearray(4)
            view.get(out)
            assert out == bytes(range(4))
            views.append(view)

    errors = in_threads([lambda i=i: opener(i) for i in range(8)], 60)
    assert errors == [] and len(views) == 200
    stats = exporter.call("stats")["exporter"]
    assert stats["leases"] == 200
    assert _wait_for(lambda: exporter.call("stats")["exporter"]["sessions"] == 1)  # a racing extra one went
    # (a connection of an earlier test's exporter, which exited, may take a moment to go)
    assert _wait_for(lambda: _importer.get_importer().stats() == {"connections": 1, "leases": 200})
    for view in views:
        view.close()
    assert _wait_for(lambda: exporter.call("stats")["exporter"]["leases"] == 0)
