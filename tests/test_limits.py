"""Per-connection limits of the exporter (docs/limits.md): what one importer
may cost it in file descriptors, leases and queued replies, and that a peer
at or past a limit never stops the exporter serving the others.

The exporter runs in a process of its own with ``RLIMIT_NOFILE`` at 4,096;
the misbehaving importers are processes of their own that speak the
control protocol directly, and are killed at the end."""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import threading
from typing import Any

import numpy as np
import pytest

import gpushare as gs

from _procs import Child, wait_for

MiB = 1 << 20
#: The descriptor limit of the exporter under test.
FD_LIMIT = 4096


# ---------------------------------------------------------------- the exporter


def _exporter_setup() -> dict:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    log: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log.append(record.getMessage())

    logging.getLogger("gpushare.export").addHandler(Keep(logging.WARNING))
    return {"_handlers": _EXPORTER, "shares": [], "objs": [], "log": log, "_reply": {"pid": os.getpid()}}


def _export_arrays(state: dict, n: int, size: int) -> list:
    """``n`` plain NumPy arrays, one share each (array ``i`` holds ``i + k``)."""
    shares = []
    for i in range(n):
        a = np.arange(i, i + size, dtype=np.int64)
        state["objs"].append(a)
        shares.append(gs.export(a, lifetime="revoked"))
    state["shares"] += shares
    return shares


def _export_memfd(state: dict, size: int, fill: int) -> Any:
    a = gs.empty(size, np.uint8)
    a[:] = fill
    state["objs"].append(a)
    share = gs.export(a, lifetime="revoked")
    state["shares"].append(share)
    return share


def _counts(state: dict) -> dict:
    from gpushare._exporter.registry import get_exporter

    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {"fds": len(os.listdir("/proc/self/fd")), "rss": int(status["VmRSS"].split()[0]) << 10,
            "hwm": int(status["VmHWM"].split()[0]) << 10, **get_exporter().stats()}


def _limit(state: dict, n: int) -> int:
    from gpushare._exporter import sessions

    old, sessions.MAX_LEASES = sessions.MAX_LEASES, n
    return old


def _warnings(state: dict) -> list[str]:
    return list(state["log"])


def _exhaust(state: dict) -> int:
    """Take every free descriptor of this process (kept until :func:`_release`)."""
    held = state.setdefault("held", [])
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        return len(held)


def _release(state: dict) -> None:
    for fd in state.pop("held", []):
        os.close(fd)


_EXPORTER = {"arrays": _export_arrays, "memfd": _export_memfd, "counts": _counts, "limit": _limit,
             "warnings": _warnings, "exhaust": _exhaust, "release": _release}


@pytest.fixture
def exporter():
    child = Child(_exporter_setup)
    yield child
    assert child.close() == 0


# ------------------------------------------------ an importer speaking the wire


def _peer_setup() -> dict:
    return {"_handlers": _PEER, "_reply": {"pid": os.getpid()}}


def _connect(share: Any) -> socket.socket:
    """A control connection to ``share``'s exporter over its Unix socket,
    past the mutual challenge (the key is the multiprocessing one, which
    every process of the test shares)."""
    from gpushare import _auth, _control
    from gpushare._paths.broker import control_address

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(control_address(share.exporter_pid, share.control[0][1]))
    sock.settimeout(30)
    mine = _auth.new_nonce()
    _control.send(sock, {"op": "hello", "v": _control.PROTOCOL, "nonce": mine})
    hello = _control.recv(sock)
    assert _auth.verify("exporter", mine, hello["nonce"], hello["proof"])
    _control.send(sock, {"op": "auth", "proof": _auth.proof("importer", mine, hello["nonce"])})
    return sock


def _hoard(state: dict, share: Any, n: int) -> int:
    """Open ``share`` over cma ``n`` times on one connection and keep every
    lease; how many the exporter granted."""
    from gpushare import _control

    sock = state["sock"] = _connect(share)
    request = {"op": "open", "share": share.share_id, "token": share.token, "path": "cma"}

    def send() -> None:
        for start in range(1, n + 1, 1000):
            sock.sendall(b"".join(_control.pack({**request, "id": i}) for i in range(start, min(start + 1000, n + 1))))

    sender = threading.Thread(target=send)
    sender.start()
    granted = 0
    for _ in range(n):
        reply = _control.recv(sock, timeout=30)
        granted += reply.get("ok") is True and isinstance(reply.get("lease"), int)
    sender.join()
    return granted


def _flood(state: dict, share: Any, batches: int, kind: str) -> dict:
    """Send ``batches`` requests of 160 KiB each and read nothing: whether
    the exporter hung up before all went out, and after how many."""
    from gpushare import _control

    sock = state["sock"] = _connect(share)
    if kind == "ping":
        one = _control.pack({"op": "ping", "id": 1})
    else:  # an open whose reply carries the share's memfd
        one = _control.pack({"op": "open", "id": 1, "share": share.share_id, "token": share.token, "path": kind})
    batch = one * (160 * 1024 // len(one))
    for i in range(batches):
        try:
            sock.sendall(batch)
        except (BrokenPipeError, ConnectionResetError):
            return {"dropped": True, "sent": i}
    return {"dropped": False, "sent": batches}


def _flood_in_background(state: dict, share: Any, batches: int, kind: str) -> None:
    def run() -> None:
        state["flood"] = _flood(state, share, batches, kind)

    state["thread"] = threading.Thread(target=run)
    state["thread"].start()


def _flood_result(state: dict) -> dict:
    state["thread"].join(120)
    return state["flood"]


_PEER = {"hoard": _hoard, "flood": _flood_in_background, "flood_result": _flood_result}


def _kill(child: Child) -> None:
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.join(10)
    child.conn.close()


# ---------------------------------------------------------------- the tests


def test_one_consumer_reads_ten_thousand_plain_arrays_from_an_exporter_at_4096_fds(exporter):
    """Each array a share of its own, every view open at once: a cma lease
    costs the exporter no descriptor (one pidfd per connection)."""
    n, size = 10_000, 16
    base = exporter.call("counts")
    shares = exporter.call("arrays", n, size, timeout=120)
    views = []
    try:
        for share in shares:
            views.append(gs.open(share))
        assert {v.path for v in views} == {"cma"}
        out = np.empty(size, np.int64)
        for i, view in enumerate(views):
            view.get(out)
            assert out[0] == i and out[-1] == i + size - 1
        during = exporter.call("counts")
        assert during["leases"] == n
        assert during["fds"] - base["fds"] < 32  # the connection and its pidfd, not one per lease
    finally:
        for view in views:
            view.close()
    assert wait_for(lambda: exporter.call("counts")["leases"] == 0)


def test_a_memfd_share_costs_one_fd_per_export_and_none_per_lease(exporter):
    """gs.empty memory: its memfd, and one duplicate per share (its own
    registration); a host-fd lease sends duplicates with its reply and
    keeps none."""
    exporter.call("memfd", 4096, 1)  # the fd broker starts with the first
    base = exporter.call("counts")
    shares = [exporter.call("memfd", 4096, 9) for _ in range(10)]
    exported = exporter.call("counts")
    assert exported["fds"] - base["fds"] == 2 * 10  # each buffer's memfd, each share's duplicate
    views = [gs.open(share) for share in shares for _ in range(20)]
    try:
        assert {v.path for v in views} == {"host-fd"}
        assert all((np.asarray(v) == 9).all() for v in views)
        during = exporter.call("counts")
        assert during["leases"] == 200
        assert during["fds"] - exported["fds"] <= 1  # this process's connection
    finally:
        for view in views:
            view.close()


def test_an_importer_holding_20000_cma_leases_does_not_stop_the_exporter_serving_others(exporter):
    (plain,) = exporter.call("arrays", 1, 512)
    mapped = exporter.call("memfd", 4096, 7)
    base = exporter.call("counts")
    hoarder = Child(_peer_setup)
    try:
        assert hoarder.call("hoard", plain, 20_000, timeout=120) == 20_000
        assert exporter.call("warnings") == []
        during = exporter.call("counts")
        assert during["leases"] == 20_000
        assert during["fds"] - base["fds"] < 32
        # Another importer is served on both paths meanwhile.
        with gs.open(plain) as view:
            assert view.path == "cma"
            out = np.empty(512, np.int64)
            view.get(out)
            assert (out == np.arange(512)).all()
        with gs.open(mapped) as view:
            assert view.path == "host-fd"
            assert (np.asarray(view) == 7).all()
    finally:
        _kill(hoarder)
    assert wait_for(lambda: exporter.call("counts")["leases"] == 0)
    # Every descriptor the hoarder cost is back (the views above closed theirs).
    assert wait_for(lambda: exporter.call("counts")["fds"] <= base["fds"] + 1)  # at most this process's link


def test_an_exporter_out_of_descriptors_still_grants_cma_leases_on_a_connection(exporter):
    """Once the importer's connection is there, a further cma open needs no
    descriptor: an exporter whose table is full still grants it, and the
    importer's views go on working."""
    shares = exporter.call("arrays", 51, 8)
    first = gs.open(shares[0])
    views = []
    try:
        assert exporter.call("exhaust") > 0
        try:
            views = [gs.open(share) for share in shares[1:]]
            out = np.empty(8, np.int64)
            for i, view in enumerate([first, *views]):
                assert view.path == "cma"
                view.get(out)
                assert (out == np.arange(i, i + 8)).all()
        finally:
            exporter.call("release")
    finally:
        for view in [first, *views]:
            view.close()


def test_an_open_beyond_the_lease_limit_is_refused_naming_it(exporter):
    """The limit, lowered in the exporter to keep the test short: the open
    past it fails with a gpushare error naming the limit; a lease given back
    makes room again."""
    limit = exporter.call("limit", 50)
    assert limit == 1 << 16  # what docs/limits.md states
    (plain,) = exporter.call("arrays", 1, 8)
    views = [gs.open(plain) for _ in range(50)]
    try:
        with pytest.raises(gs.InvalidInputError, match="holds 50 leases of this exporter already.*MAX_LEASES"):
            gs.open(plain)
        views.pop().close()
        views.append(gs.open(plain))
    finally:
        for view in views:
            view.close()


@pytest.mark.parametrize("kind", ["ping", "host-fd"])
def test_a_peer_that_asks_and_never_reads_is_dropped_and_its_memory_freed(exporter, kind):
    """Batches of 160 KiB of requests, no reply read: once its unread replies
    pass the bound, the exporter hangs up and drops them.  When the bound
    was checked once per read of the socket and counted only the bytes of
    each queued reply (not the objects holding it), these pings grew the
    exporter by about 100 MiB before it hung up; host-fd opens held their
    memfds until it ran out of descriptors."""
    from gpushare._exporter import sessions

    (plain,) = exporter.call("arrays", 1, 512)
    share = exporter.call("memfd", 4096, 3) if kind == "host-fd" else plain
    base = exporter.call("counts")
    bad = Child(_peer_setup)
    try:
        with gs.open(plain) as view:
            bad.call("flood", share, 64, kind)
            out = np.empty(512, np.int64)
            for _ in range(20):  # served while the peer floods
                view.get(out)
                assert (out == np.arange(512)).all()
            flood = bad.call("flood_result", timeout=150)
        assert flood["dropped"], flood
        during = exporter.call("counts")
        # The peak: the bound, and what one read of requests adds beyond it.
        assert during["hwm"] - base["rss"] < 64 * MiB, (during["hwm"] - base["rss"]) / MiB
        assert during["fds"] < base["fds"] + 16
        # Dropped for that reason (not, say, for running out of descriptors).
        said = exporter.call("warnings")
        assert any("unread" in line and f"at most {sessions.MAX_BACKLOG}" in line for line in said), said
        with gs.open(share) as view:  # and it serves others after
            assert view.nbytes == share.nbytes
    finally:
        _kill(bad)
    assert wait_for(lambda: exporter.call("counts")["fds"] <= base["fds"] + 1)  # at most this process's link
    after = exporter.call("counts")
    assert after["queued_bytes"] == 0 and after["queued_fds"] == 0
    assert after["rss"] - base["rss"] < 32 * MiB
