"""The service thread's connections read by a waiting thread itself
(Connection.read_until): who reads, when the service thread reads again,
and how a wait ends when the connection does."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gpushare._connection import Protocol
from gpushare._service import get_service

from _procs import wait_for as _wait_for


class Record(Protocol):
    """Keeps every byte and the thread that handled it."""

    def __init__(self, fail: type[BaseException] | None = None) -> None:
        self.data = bytearray()
        self.threads: list[str] = []
        self.lost: list[BaseException | None] = []
        self.fail = fail

    def data_received(self, conn, fds):
        self.threads.append(threading.current_thread().name)
        self.data += conn.rbuf
        conn.rbuf.clear()
        if self.fail is not None:
            raise self.fail("while handling the bytes")

    def connection_lost(self, conn, exc):
        self.lost.append(exc)


def _send_once_read_directly(conn, peer, data: bytes) -> None:
    """Send ``data`` from another thread once ``conn`` is read by a waiting thread (not before)."""
    def send():
        assert _wait_for(lambda: conn._direct, 5.0)
        peer.sendall(data)

    threading.Thread(target=send, daemon=True).start()


@pytest.fixture
def pair():
    service = get_service()
    mine, peer = socket.socketpair()
    proto = Record()
    conn = service.connect(mine, proto)
    service.run(lambda: None)  # registered
    yield service, conn, proto, peer
    peer.close()
    service.run(conn.close)


def test_a_waiting_thread_reads_its_reply_itself_and_the_service_thread_reads_again_after(pair):
    service, conn, proto, peer = pair
    _send_once_read_directly(conn, peer, b"reply")
    assert conn.read_until(lambda: proto.data == b"reply", 5.0) is True
    assert proto.threads == [threading.current_thread().name]
    peer.sendall(b" later")  # nobody waits: the service thread reads it
    assert _wait_for(lambda: proto.data == b"reply later", 5.0)
    assert proto.threads[1:] == ["gpushare-service"]


def test_one_thread_reads_at_a_time_and_the_others_are_told_to_wait_their_way(pair):
    service, conn, proto, peer = pair
    answers: list = []
    reader = threading.Thread(target=lambda: answers.append(conn.read_until(lambda: len(proto.data) >= 2, 5.0)))
    reader.start()
    assert _wait_for(lambda: conn._direct, 5.0)
    assert conn.read_until(lambda: False, 1.0) is None  # another thread reads it so already
    assert service.run(lambda: conn.read_until(lambda: False, 1.0)) is None  # never in the service thread
    peer.sendall(b"ab")
    reader.join(5.0)
    assert answers == [True] and proto.threads == [reader.name]


def test_a_wait_that_times_out_leaves_the_bytes_to_the_service_thread(pair):
    service, conn, proto, peer = pair
    t0 = time.monotonic()
    assert conn.read_until(lambda: False, 0.2) is False
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert not conn._direct
    peer.sendall(b"x")
    assert _wait_for(lambda: proto.data == b"x", 5.0)
    assert proto.threads == ["gpushare-service"]


def test_a_hang_up_ends_the_wait_at_once(pair):
    service, conn, proto, peer = pair
    threading.Timer(0.05, peer.close).start()
    t0 = time.monotonic()
    assert conn.read_until(lambda: False, 10.0) is False
    assert time.monotonic() - t0 < 2.0
    assert conn.closed and _wait_for(lambda: proto.lost == [None], 5.0)


def test_a_close_by_another_thread_ends_the_wait_at_once(pair, monkeypatch):
    from gpushare import _connection

    monkeypatch.setattr(_connection, "_DIRECT_STEP", 60.0)  # only the close can end this poll early
    service, conn, proto, peer = pair
    threading.Timer(0.05, lambda: service.run(conn.close)).start()
    t0 = time.monotonic()
    assert conn.read_until(lambda: False, 30.0) is False
    assert time.monotonic() - t0 < 5.0
    assert conn.closed and _wait_for(lambda: proto.lost == [None], 5.0)


@pytest.mark.parametrize("fail", [KeyboardInterrupt, ValueError])
def test_an_exception_while_reading_drops_the_connection(fail):
    """An error from the protocol closes the connection, as in the service
    thread; an interrupt (a signal handler's exception) does too, and is raised."""
    service = get_service()
    mine, peer = socket.socketpair()
    proto = Record(fail=fail)
    conn = service.connect(mine, proto)
    service.run(lambda: None)
    try:
        _send_once_read_directly(conn, peer, b"cut")
        if fail is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt):
                conn.read_until(lambda: False, 5.0)
        else:
            assert conn.read_until(lambda: False, 5.0) is False
        # the bytes it was handling may be lost: the stream is not read on as if whole
        assert conn.closed and len(proto.lost) == 1 and isinstance(proto.lost[0], fail)
        assert proto.threads == [threading.current_thread().name]
        assert peer.recv(16) == b""  # the peer sees the end
    finally:
        peer.close()


def test_a_fork_closes_a_connection_the_service_thread_has_not_added_yet():
    """A caller reading its reply itself can be done with a connection before the
    service thread adds it: a fork then must still close it in the child."""
    import os

    service = get_service()
    mine, peer = socket.socketpair()
    hold, started = threading.Event(), threading.Event()

    def busy():
        started.set()
        hold.wait(10.0)

    service.call_soon(busy)  # the service thread runs nothing else meanwhile
    proto = Record()
    try:
        assert started.wait(5.0)
        conn = service.connect(mine, proto)
        assert conn.fileno not in service._conns  # not added yet
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    os.fstat(conn.fileno)
                    code = 2  # the child kept the inherited socket
                except OSError:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        hold.set()
    service.run(lambda: None)
    assert service._conns.get(conn.fileno) is conn  # the parent's is served as before
    peer.sendall(b"x")
    assert _wait_for(lambda: proto.data == b"x", 5.0)
    peer.close()
    service.run(conn.close)


@pytest.mark.parametrize("when", ["before its thread added it", "after stop"])
def test_stop_closes_a_connection_not_added_yet(when):
    """At exit the service closes every connection it was given, added or not; one
    given after it stopped is closed at once."""
    from gpushare._service import Service

    service = Service()
    mine, peer = socket.socketpair()
    proto = Record()
    hold = threading.Event()
    if when == "after stop":
        service.stop()
    else:
        service.call_soon(lambda: hold.wait(10.0))
    conn = service.connect(mine, proto)
    if when != "after stop":
        threading.Timer(0.2, hold.set).start()
        service.stop()
    try:
        assert conn.closed and proto.lost == [None]
        assert not service._adding
        peer.settimeout(5.0)
        assert peer.recv(1) == b""  # the peer sees the end
    finally:
        hold.set()
        peer.close()
