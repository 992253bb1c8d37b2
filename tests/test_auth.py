"""Peers prove they hold the same key before anything else crosses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import gpushare as gs
from gpushare import _auth, _control
from gpushare._process import node_key

from _procs import Child
import _share_peer


def _program(tmp_path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


EXPORTER = """
    import json, sys
    import numpy as np
    import gpushare as gs
    share = gs.export(np.arange(64, dtype=np.uint8), lifetime="revoked")
    print(share.to_bytes().hex(), flush=True)
    sys.stdin.readline()
"""

IMPORTER = """
    import sys
    import gpushare as gs
    share = gs.Share.from_bytes(bytes.fromhex(sys.argv[1]))
    try:
        with gs.open(share, timeout=20) as view:
            out = bytearray(4)
            view.get(out)
            print("opened", view.path, out.hex())
    except gs.AccessDeniedError as exc:
        print("denied", exc)
"""


@pytest.mark.parametrize("shared_key", [False, True])
def test_separate_programs_need_a_shared_key(tmp_path, shared_key):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("GPUSHARE_AUTHKEY", None)
    if shared_key:
        env["GPUSHARE_AUTHKEY"] = "a key both programs were given"
    with subprocess.Popen([sys.executable, _program(tmp_path, "exp.py", EXPORTER)], env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as exporter:
        try:
            share_hex = exporter.stdout.readline().strip()
            r = subprocess.run([sys.executable, _program(tmp_path, "imp.py", IMPORTER), share_hex], env=env,
                               capture_output=True, text=True, timeout=60)
        finally:
            exporter.stdin.write("\n")
            exporter.stdin.flush()
            exporter.wait(30)
    if shared_key:
        words = r.stdout.split()
        assert words[0] == "opened" and words[2] == "00010203", r.stdout + r.stderr
    else:
        assert r.stdout.startswith("denied"), r.stdout + r.stderr
        assert "GPUSHARE_AUTHKEY" in r.stdout


def test_a_program_and_its_multiprocessing_children_need_no_setup():
    exporter = Child(_share_peer.setup)  # a spawned child: it inherited this process's authkey
    try:
        share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
        with gs.open(share) as view:
            out = bytearray(4)
            view.get(out)
            assert out == bytes(range(4))
    finally:
        exporter.close()


def _impostor(accepted: list) -> tuple[socket.socket, threading.Thread]:
    """A listener that answers hello as an exporter would, without the key,
    and records everything an importer sends it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            try:
                while True:
                    msg = _control.recv(conn, 10)
                    accepted.append(msg)
                    if msg.get("op") == "hello":
                        _control.send(conn, {"op": "hello", "ok": True, "v": _control.PROTOCOL, "pid": 1,
                                             "nonce": bytes(16), "proof": bytes(32)})
            except (EOFError, OSError, gs.GpuShareError):
                return

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return listener, t


def test_an_importer_tells_an_impostor_nothing_and_refuses_it():
    real = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    seen: list = []
    listener, t = _impostor(seen)
    try:
        fields = dict(zip(gs.Share._NAMES, real._fields_, strict=True))
        fields["control"] = (("127.0.0.1", listener.getsockname()[1]),)
        fields["exporter_pid"] = 1  # not a process of this node's: TCP, no local socket
        forged = gs.Share._make(*fields.values())
        with pytest.raises(gs.AccessDeniedError, match="could not prove it holds"):
            gs.open(forged, exclude=["same-process"], timeout=10)
        t.join(10)
        assert [m.get("op") for m in seen] == ["hello"]  # the share's token never left this process
        assert all(real.token not in json.dumps(_control.encode(m)).encode() for m in seen)
        # Nor anything about this process: no pid, no node before the exporter proved the key.
        assert set(seen[0]) == {"op", "v", "nonce"}
        wire = json.dumps(_control.encode(seen[0]))
        assert str(os.getpid()) not in wire and node_key() not in wire
    finally:
        listener.close()
        real.revoke()


def test_the_exporter_refuses_a_wrong_proof_before_reading_anything_else():
    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    host, port = share.control[0]
    with socket.create_connection((host, port), timeout=10) as s:
        mine = _auth.new_nonce()
        _control.send(s, {"op": "hello", "v": _control.PROTOCOL, "nonce": mine})
        hello = _control.recv(s, 10)
        assert _auth.verify("exporter", mine, hello["nonce"], hello["proof"])  # the exporter proved itself
        _control.send(s, {"op": "auth", "proof": bytes(32)})
        reply = _control.recv(s, 10)
        assert reply["code"] == "denied" and "payload" not in reply
        with pytest.raises((EOFError, ConnectionResetError)):
            _control.send(s, {"op": "open", "id": 1, "share": share.share_id, "token": share.token,
                              "path": "ucx-rma"})
            _control.recv(s, 10)  # hung up: nothing more is read
    share.revoke()


def test_set_authkey_checks_its_key_and_goes_back_to_the_default():
    with pytest.raises(gs.InvalidInputError, match="at least 16 bytes"):
        gs.set_authkey(b"short")
    with pytest.raises(gs.InvalidInputError, match="bytes or str"):
        gs.set_authkey(1234)
    gs.set_authkey("a key of at least sixteen bytes")
    try:
        assert _auth.key() == b"a key of at least sixteen bytes"
    finally:
        gs.set_authkey(None)
    import multiprocessing

    assert _auth.key() == bytes(multiprocessing.current_process().authkey)


def test_a_proof_is_bound_to_its_key_and_its_role():
    a, b = _auth.new_nonce(), _auth.new_nonce()
    token = bytes(range(32))
    for role in ("exporter", "importer", "producer", "consumer"):
        made = _auth.proof(role, a, b, secret=token)
        assert _auth.verify(role, a, b, made, secret=token)
        assert not _auth.verify(role, a, b, made)  # this process's key is another key
        assert not _auth.verify(role, b, a, made, secret=token)  # nonces in their order
        assert not _auth.verify(role, a, b, made, secret=bytes(32))
        others = {"exporter", "importer", "producer", "consumer"} - {role}
        assert not any(_auth.verify(other, a, b, made, secret=token) for other in others)
    assert _auth.verify("importer", a, b, _auth.proof("importer", a, b))  # the default: the process's key
    assert _auth.proof("importer", a, b) == _auth.proof("importer", a, b, secret=_auth.key())
    with pytest.raises(gs.InvalidInputError, match="no proof for role"):
        _auth.proof("stranger", a, b)


# ------------------------------------------------------------ keys and refusals

SHORT = "fifteen bytes!!"  # one byte short of the rule


def test_a_short_key_in_the_environment_is_named_with_the_rule_by_the_importer(monkeypatch):
    exporter = Child(_share_peer.setup)  # holds the key this process had at spawn
    try:
        share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
        monkeypatch.setenv("GPUSHARE_AUTHKEY", SHORT)
        with pytest.raises(gs.InvalidInputError, match="GPUSHARE_AUTHKEY is 15 bytes; a key must be at least 16 bytes"):
            gs.open(share, timeout=10)
    finally:
        exporter.close()


def test_a_short_key_in_the_environment_fails_the_first_export(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), GPUSHARE_AUTHKEY=SHORT)
    r = subprocess.run([sys.executable, _program(tmp_path, "exp.py", EXPORTER)], env=env, capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode != 0 and not r.stdout
    assert "InvalidInputError: GPUSHARE_AUTHKEY is 15 bytes; a key must be at least 16 bytes" in r.stderr, r.stderr


def test_an_exporter_whose_key_went_bad_refuses_each_hello_and_says_why(monkeypatch):
    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    monkeypatch.setenv("GPUSHARE_AUTHKEY", SHORT)  # after the exporter started
    try:
        host, port = share.control[0]
        with socket.create_connection((host, port), timeout=10) as s:
            _control.send(s, {"op": "hello", "v": _control.PROTOCOL, "nonce": _auth.new_nonce()})
            reply = _control.recv(s, 10)  # an answer, not a connection closed in the service thread
        assert reply["code"] == "denied"
        assert "GPUSHARE_AUTHKEY is 15 bytes; a key must be at least 16 bytes" in reply["message"]
    finally:
        share.revoke()


def test_a_key_that_is_not_text_is_refused_clearly():
    with pytest.raises(gs.InvalidInputError, match="authkey is not valid UTF-8 text; a key must be at least 16"):
        gs.set_authkey("\ud800" * 20)
    with pytest.raises(gs.InvalidInputError, match="authkey is 5 bytes; a key must be at least 16 bytes"):
        gs.set_authkey(b"short")


def _refused(share: gs.Share) -> BaseException:
    with pytest.raises(gs.GpuShareError) as info:
        gs.open(share, exclude=["same-process"], timeout=10)
    return info.value


def _elsewhere(share: gs.Share) -> gs.Share:
    """The same share as an importer on another node reads it: no Unix socket, TCP to a non-loopback address."""
    fields = dict(zip(gs.Share._NAMES, share._fields_, strict=True))
    fields["node"] = "another-boot:another-host:net:[1]"
    return gs.Share._make(*fields.values())


def test_different_keys_get_one_message_on_this_node_and_from_another(monkeypatch):
    monkeypatch.setenv("GPUSHARE_AUTHKEY", "the exporter's key, sixteen bytes or more")
    exporter = Child(_share_peer.setup)
    try:
        share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
        monkeypatch.setenv("GPUSHARE_AUTHKEY", "this importer's key, another one")
        here, there = _refused(share), _refused(_elsewhere(share))
    finally:
        exporter.close()
    assert type(here) is type(there) is gs.AccessDeniedError
    assert str(here) == str(there) and "GPUSHARE_AUTHKEY" in str(here)


def test_an_exporter_refusing_this_process_proof_is_heard_as_a_refusal(monkeypatch):
    exporter = Child(_share_peer.setup)  # a connection of its own
    share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
    real = _auth.proof

    def forged(role, *args, **kwargs):
        made = real(role, *args, **kwargs)
        return bytes(32) if role == "importer" else made

    monkeypatch.setattr(_auth, "proof", forged)  # the exporter proves itself; this process's proof is wrong
    try:
        here, there = _refused(share), _refused(_elsewhere(share))
    finally:
        monkeypatch.undo()
        exporter.close()
    for exc in (here, there):  # not "stopped answering: control channel closed"
        assert type(exc) is gs.AccessDeniedError, repr(exc)
        assert "does not hold the exporter's key" in str(exc) and "GPUSHARE_AUTHKEY" in str(exc)
    assert str(here) == str(there)


@pytest.fixture
def fresh_refusal_log(monkeypatch):
    """A refusal log of its own, so that what earlier tests refused cannot use up its lines."""
    from gpushare._exporter import sessions

    monkeypatch.setattr(sessions, "refusals", sessions.RefusalLog())


def test_the_importer_says_who_it_is_after_the_proof(caplog, fresh_refusal_log):
    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    host, port = share.control[0]
    try:
        with socket.create_connection((host, port), timeout=10) as s, caplog.at_level("INFO", logger="gpushare"):
            mine = _auth.new_nonce()
            _control.send(s, {"op": "hello", "v": _control.PROTOCOL, "nonce": mine})
            hello = _control.recv(s, 10)
            _control.send(s, {"op": "auth", "proof": _auth.proof("importer", mine, hello["nonce"]), "pid": 4242,
                              "node": "n"})
            _control.send(s, {"op": "open", "id": 1, "share": "0" * 32, "token": bytes(32), "path": "ucx-rma"})
            assert _control.recv(s, 10)["code"] == "unknown"
    finally:
        share.revoke()
    assert any("(pid 4242, as it says)" in r.getMessage() for r in caplog.records), caplog.text


def test_the_exporter_logs_each_refusal_with_the_peer_and_the_reason(caplog, fresh_refusal_log):
    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    host, port = share.control[0]
    try:
        with caplog.at_level("INFO", logger="gpushare"):
            with socket.create_connection((host, port), timeout=10) as s:
                mine = _auth.new_nonce()
                _control.send(s, {"op": "hello", "v": _control.PROTOCOL, "nonce": mine})
                _control.recv(s, 10)
                _control.send(s, {"op": "auth", "proof": bytes(32)})
                assert _control.recv(s, 10)["code"] == "denied"
                me = "{}:{}".format(*s.getsockname()[:2])
            with socket.create_connection((host, port), timeout=10) as s:
                _control.send(s, {"op": "hello", "v": 1, "nonce": mine})
                assert _control.recv(s, 10)["code"] == "bad"
    finally:
        share.revoke()
    refused = [r for r in caplog.records if r.name.startswith("gpushare") and r.getMessage().startswith("refused")]
    denied = [r for r in refused if "(denied)" in r.getMessage()]
    assert len(denied) == 1 and denied[0].levelname == "WARNING" and me in denied[0].getMessage(), caplog.text
    assert "does not hold the exporter's key" in denied[0].getMessage()
    assert any("control protocol 1" in r.getMessage() and "(bad)" in r.getMessage() for r in refused), caplog.text


def test_a_flood_of_refusals_is_logged_at_most_so_often(caplog):
    from gpushare._exporter import sessions

    now = [100.0]
    limiter = sessions.RefusalLog(per_second=5, clock=lambda: now[0])
    with caplog.at_level("INFO", logger="gpushare"):
        allowed = sum(limiter.allow() for _ in range(1000))
        assert allowed == 5 and not caplog.records
        now[0] += 1.0
        assert limiter.allow()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "suppressed 995 more refusals (at most 5 are logged a second)"
