"""A share's import count cannot be moved by messages an importer chooses."""

from __future__ import annotations

import socket
import warnings

import numpy as np

import gpushare as gs
from gpushare import _auth, _control

from _procs import Child, wait_for
import _share_peer


def _session(share: gs.Share) -> socket.socket:
    """A control connection that has passed the challenge (this process holds the key)."""
    host, port = share.control[0]
    s = socket.create_connection((host, port), timeout=10)
    mine = _auth.new_nonce()
    _control.send(s, {"op": "hello", "v": _control.PROTOCOL, "nonce": mine})
    hello = _control.recv(s, 10)
    _control.send(s, {"op": "auth", "proof": _auth.proof("importer", mine, hello["nonce"])})
    return s


def test_failed_messages_buy_at_most_one_payload_per_path():
    buf = gs.allocate(4096, device="host")
    share = gs.export(buf, lifetime=1)
    assert share.offers == ("same-process", "host-fd", "ucx-rma")
    payloads = []
    with _session(share) as s:
        for i, path in enumerate(["ucx-rma", "ucx-rma", "host-fd", "host-fd", "ucx-rma", "host-fd"]):
            _control.send(s, {"op": "open", "id": i, "share": share.share_id, "token": share.token, "path": path})
            reply = _control.recv(s, 10)
            if reply.get("ok"):
                payloads.append(path)
                _control.send(s, {"op": "failed", "lease": reply["lease"]})  # "could not use it"
            else:
                assert reply["code"] == "exhausted", reply
    assert payloads == ["ucx-rma", "host-fd"]  # one per path, not one per message
    from gpushare._exporter.registry import registered

    assert wait_for(lambda: registered(share) is None)  # the connection's end applied the policy: retired
    buf.close()


def test_a_real_fallback_under_lifetime_1_is_one_import():
    exporter = Child(_share_peer.setup)
    try:
        share = exporter.call("export", "host", 4096, {"lifetime": 1})
        exporter.call("stop_broker")  # host-fd cannot be served: the importer falls back
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gs.SlowPathWarning)
            with gs.open(share) as view:
                assert view.path == "ucx-rma" and "host-fd failed" in view.why
                out = bytearray(4)
                view.get(out)
                assert out == bytes(range(4))
        try:
            gs.open(share)
        except gs.ClosedError as exc:
            assert "as many times as its lifetime allows" in str(exc) or "no longer available" in str(exc)
        else:
            raise AssertionError("a lifetime=1 share opened twice")
    finally:
        exporter.close()


def _setup_as_nobody() -> dict:
    import encodings.idna  # noqa: F401 - what the process needs later, loaded while it may read it
    import os

    import gpushare._open
    import gpushare._importer
    import gpushare._paths.broker
    import gpushare._paths.host_fd
    import gpushare._ucx._server  # noqa: F401

    gpushare._open_plan.choose  # noqa: B018
    os.setgid(65534)
    os.setuid(65534)
    return _share_peer.setup()


def test_a_refused_import_does_not_fall_back_to_a_path_that_grants_more():
    import os

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to run an importer as another user")
    buf = gs.allocate(4096, device="host")
    share = gs.export(buf, lifetime="revoked")
    other = Child(_setup_as_nobody)  # same program (same key), another user id
    try:
        with pytest.raises(gs.AccessDeniedError):
            other.call("open", "x", share)
        assert other.call("views") == []  # and nothing else was opened in its place
    finally:
        other.close()
        share.revoke()
        buf.close()


def test_a_connection_forgets_the_retries_of_shares_that_ended():
    """One connection fails to use 200 shares in turn (each then revoked): what it keeps of the
    retries they bought stays small, not one entry per share it ever failed to use; a share
    still live keeps its retry."""
    from gpushare._exporter.registry import get_exporter

    buf = gs.allocate(4096, device="host")
    live = gs.export(buf, lifetime=1)  # its one import spent: only the retry opens it again
    with _session(live) as s:
        _control.send(s, {"op": "open", "id": 0, "share": live.share_id, "token": live.token, "path": "host-fd"})
        reply = _control.recv(s, 10)
        assert reply.get("ok"), reply
        _control.send(s, {"op": "failed", "lease": reply["lease"]})
        for i in range(1, 201):
            share = gs.export(buf, lifetime="revoked")
            _control.send(s, {"op": "open", "id": i, "share": share.share_id, "token": share.token, "path": "host-fd"})
            reply = _control.recv(s, 10)
            assert reply.get("ok"), reply
            _control.send(s, {"op": "failed", "lease": reply["lease"]})
            share.revoke()
        _control.send(s, {"op": "open", "id": 999, "share": live.share_id, "token": live.token, "path": "ucx-rma"})
        assert _control.recv(s, 10).get("ok")  # the live share's retry is still there
        sessions = [x for x in get_exporter()._sessions if live.share_id in x.retries]
        assert len(sessions) == 1 and len(sessions[0].retries) <= 40, [len(x.retries) for x in sessions]
    from gpushare._exporter.registry import registered

    assert wait_for(lambda: registered(live) is None)  # its one import ended with the connection
    buf.close()
