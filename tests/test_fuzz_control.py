"""Property tests of the control channel's parser, and of a live exporter fed
frames an attacker chooses: any bytes give messages or InvalidInputError, and
the exporter keeps serving."""

from __future__ import annotations

import json
import socket
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpushare as gs
from gpushare import _control

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_give_messages_or_invalid_input(data):
    buf = bytearray(data)
    try:
        messages = _control.take_frames(buf)
    except gs.InvalidInputError:
        return
    assert all(isinstance(m, dict) for m in messages)
    assert len(buf) <= len(data)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_any_json_gives_a_message_or_invalid_input(value):
    body = json.dumps(value).encode()
    try:
        message = _control.parse(body)
    except gs.InvalidInputError:
        return
    assert isinstance(message, dict)


def test_deep_nesting_and_huge_numbers_are_refused():
    for body in (b"[" * 50_000 + b"]" * 50_000, b'{"a":' * 30 + b"1" + b"}" * 30, b'{"n": ' + b"9" * 5000 + b"}"):
        try:
            _control.parse(body)
        except gs.InvalidInputError:
            continue
        raise AssertionError(f"accepted {body[:40]!r}")


_frames = st.lists(
    st.one_of(
        st.binary(max_size=64).map(lambda b: struct.pack("!I", len(b)) + b),
        json_values.map(lambda v: json.dumps(v).encode()).map(lambda b: struct.pack("!I", len(b)) + b),
        st.builds(lambda op, extra: json.dumps({"op": op, **extra}).encode(),
                  st.sampled_from(["hello", "auth", "open", "close", "failed", "x"]),
                  st.dictionaries(st.sampled_from(["v", "nonce", "proof", "id", "share", "token", "path", "lease"]),
                                  json_values, max_size=4)).map(lambda b: struct.pack("!I", len(b)) + b),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_frames)
def test_a_live_exporter_survives_chosen_frames_and_keeps_serving(frames):
    share = _share()
    host, port = share.control[0]
    with socket.create_connection((host, port), timeout=5) as s:
        try:
            s.sendall(b"".join(frames))
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            while s.recv(65536):
                pass  # answers, then it hangs up: it must not hang
        except (ConnectionResetError, BrokenPipeError):
            pass
    with gs.open(share, exclude=["same-process"], timeout=10) as view:
        out = bytearray(4)
        view.get(out)
        assert out == bytes(range(4))


_SHARE: list = []


def _share() -> gs.Share:
    if not _SHARE:
        _SHARE.append(gs.export(np.arange(64, dtype=np.uint8), lifetime="revoked"))
    return _SHARE[0]
