"""Property tests over every surface that takes bytes from another process:
shares (bytes and pickles), channel handles, the fd broker's requests and
replies, the exporter's offers as the importer reads them, and cma copy
requests as the exporter reads them.  Anything gives a result or a
GpuShareError; nothing crashes, hangs, leaks an fd, or touches memory
outside what was shared.  A surface whose bad input could crash the process
(an offer's UCX address) is fed in a child process, so that a crash fails
the test instead of ending the run."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpushare as gs
from gpushare import _open, _share
from gpushare._paths import broker as broker_mod

from _procs import Child
import _share_peer

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------ shares


@FAST
@given(st.binary(max_size=600))
def test_any_bytes_are_a_share_or_invalid_input(data):
    try:
        share = gs.Share.from_bytes(data)
    except gs.InvalidInputError:
        return
    assert gs.Share.from_bytes(share.to_bytes()) == share


@FAST
@given(st.dictionaries(st.sampled_from(gs.Share._NAMES + ("format", "extra")), json_values, max_size=20))
def test_any_share_shaped_json_is_a_share_or_invalid_input(fields):
    real = json.loads(gs.export(np.zeros(8, np.uint8), lifetime="revoked").to_bytes())
    real.update(fields)
    try:
        share = gs.Share.from_bytes(json.dumps(real).encode())
    except gs.InvalidInputError:
        return
    assert gs.Share.from_bytes(share.to_bytes()) == share


@FAST
@given(st.lists(json_values, min_size=0, max_size=20))
def test_any_pickled_fields_are_a_share_or_invalid_input(fields):
    blob = pickle.dumps((_share._rebuild_share, tuple(fields)))
    fn, args = pickle.loads(blob)
    try:
        share = fn(*args)
    except gs.InvalidInputError:
        return
    assert isinstance(share, gs.Share)
    assert pickle.loads(pickle.dumps(share)) == share


@FAST
@given(st.binary(max_size=800))
def test_any_bytes_are_a_channel_handle_or_invalid_input(data):
    try:
        handle = gs.ChannelHandle.from_bytes(data)
    except gs.InvalidInputError:
        return
    assert gs.ChannelHandle.from_bytes(handle.to_bytes()) == handle


# ------------------------------------------------------------------ mutated shares, opened

#: Values a mutated field takes besides every other field's own (types swapped).
_FIELD_VALUES = st.one_of(
    st.sampled_from([0, 1, 2, 7, 64, 4032, 4096, 1 << 40, -1, "host", "", "x", None, True, False, (), (1,),
                     (64,), (4096,), (4, 4), "|u1", "<f4", "<i8", "imports=2", "closed", "none",
                     ("host-fd",), ("cma",), ("ucx-rma",), ("posix-fd",), ("cuda-ipc",), ("fabric",),
                     ("same-process", "host-fd"), (("127.0.0.1", 1),), b"", bytes(32)]),
    json_values,
)


@pytest.fixture(scope="module")
def exported():
    """Shares of host memory to mutate: from this process and from another,
    of NumPy memory (cma) and of gpushare.allocate memory (host-fd)."""
    child = Child(_share_peer.setup)
    local = [np.zeros(64, np.uint8), gs.allocate(4096, device="host"), np.zeros((4, 4), np.float32)]
    shares = [gs.export(obj, lifetime="revoked") for obj in local]
    shares += [child.call("export", kind, 4096, {"lifetime": "revoked"}) for kind in ("numpy", "host")]
    yield shares
    for share in shares[:len(local)]:
        share.revoke()
    child.close()


def _open_mutated(base: gs.Share, share: gs.Share, how: dict) -> None:
    """Open ``share`` (``base`` with fields changed): a view of the memory
    ``base`` names, or a GpuShareError, never another exception."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gs.SlowPathWarning)  # a fallback is an open like any other here
            view = gs.open(share, timeout=3, **how)
    except gs.GpuShareError:
        return
    try:
        # a share that opens names the memory as its exporter made it: the exporter (or, in its own
        # process, its record) refuses one whose device, size, offset or read-only flag was changed
        said = (share.device == "host", share.nbytes, share.offset, share.readonly)
        assert said == (base.device == "host", base.nbytes, base.offset, base.readonly), (view, share, base)
        if view.path != "ucx-rma":  # a mapped or served view shows the memory as it is
            assert (view.device == "host") == (base.device == "host"), (view, share)
        try:
            view.get(bytearray(min(8, view.nbytes)))
        except gs.GpuShareError:
            pass
    finally:
        view.close()


_HOW = st.sampled_from([{}, {"exclude": ["same-process"]}, {"prefer": ["ucx-rma"]}, {"device": 0}])


@FAST
@given(st.data(), st.lists(st.tuples(st.sampled_from(gs.Share._NAMES), st.integers(0, 1 << 16), _FIELD_VALUES),
                           min_size=1, max_size=3), _HOW)
def test_every_mutated_pickled_share_opens_or_raises_a_gpushare_error(exported, data, changes, how):
    base = data.draw(st.sampled_from(exported))
    fields = dict(zip(gs.Share._NAMES, base._fields_, strict=True))
    for name, pick, value in changes:
        others = [v for v in base._fields_ if v is not None]
        fields[name] = others[pick % len(others)] if pick % 3 == 0 else value  # a field of another type, or any value
    try:
        fn, args = pickle.loads(pickle.dumps((_share._rebuild_share, tuple(fields.values()))))
        share = fn(*args)
    except gs.InvalidInputError:
        return
    _open_mutated(base, share, how)


@FAST
@given(st.data(), st.lists(st.tuples(st.sampled_from(gs.Share._NAMES), json_values), min_size=1, max_size=3), _HOW)
def test_every_mutated_share_in_bytes_opens_or_raises_a_gpushare_error(exported, data, changes, how):
    base = data.draw(st.sampled_from(exported))
    wire = json.loads(base.to_bytes())
    real = list(wire.values())
    for name, value in changes:
        wire[name] = data.draw(st.sampled_from(real)) if value is None else value
    try:
        share = gs.Share.from_bytes(json.dumps(wire).encode())
    except gs.InvalidInputError:
        return
    _open_mutated(base, share, how)


def test_a_share_that_says_cuda_for_host_memory_opens_no_view(exported):
    for base in exported:
        fields = dict(zip(gs.Share._NAMES, base._fields_, strict=True), device=0)
        share = gs.Share._make(*fields.values())
        for how in ({}, {"exclude": ["same-process"]}):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", gs.SlowPathWarning)
                    view = gs.open(share, timeout=5, **how)
            except gs.InvalidInputError as exc:
                assert "the share says CUDA memory (device 0), but its exporter serves host memory" in str(exc)
                continue
            with view:  # only where the importer cannot see the memory: the exporter serves every byte
                assert view.path == "ucx-rma", view


# ------------------------------------------------------------------ the fd broker


def _fake_broker(reply: bytes, n_fds: int) -> tuple[str, threading.Thread]:
    """A broker in this process that answers any request with ``reply`` and
    ``n_fds`` fds (of /dev/null) riding on its first byte."""
    address = f"\0gpushare-fuzz-{os.getpid()}-{threading.get_ident()}-{len(reply)}-{n_fds}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(1)

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(broker_mod._REQUEST.size)
                    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(n_fds)]
                    try:
                        if reply:
                            socket.send_fds(conn, [reply[:1]], fds)
                            conn.sendall(reply[1:])
                    finally:
                        for fd in fds:
                            os.close(fd)
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return address, t


@settings(max_examples=60, deadline=None)
@given(st.one_of(
    st.binary(max_size=64),
    st.builds(lambda status, length, count, tail: broker_mod._REPLY.pack(b"GSFD", 1, status, length, count) + tail,
              st.integers(0, 255), st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF), st.binary(max_size=40)),
), st.integers(0, 4), st.integers(1, 3))
def test_any_broker_reply_gives_fds_or_an_error_and_leaks_none(reply, n_fds, count):
    before = _fds()
    address, t = _fake_broker(reply, n_fds)
    try:
        fds = broker_mod.fetch_fds(address, 1, bytes(32), count, pid=os.getpid(), timeout=2)
    except gs.GpuShareError:
        fds = []
    t.join(5)
    for fd in fds:
        os.close(fd)
    assert _fds() == before


@settings(max_examples=80, deadline=None)
@given(st.binary(min_size=0, max_size=120))
def test_any_request_bytes_leave_the_broker_serving(request):
    with gs.allocate(4096, device="host") as buf:
        desc = gs.export_buffer(buf)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(desc.address)
            try:
                s.sendall(request)
                s.shutdown(socket.SHUT_WR)
                while socket.recv_fds(s, 4096, 8)[0]:
                    pass
            except OSError:
                pass
        with gs.import_buffer(desc) as again:  # the broker still serves
            assert again.size == 4096


# ------------------------------------------------------------------ offers, read by the importer


@pytest.fixture(scope="module")
def host_share():
    src = gs.empty(4096, np.uint8)
    return gs.export(src, lifetime="revoked")


@FAST
@given(st.sampled_from(["host-fd", "cma", "posix-fd", "cuda-ipc", "fabric"]), json_values)
def test_any_offer_payload_is_a_view_or_an_error(host_share, path, payload):
    before = _fds()
    try:
        view = _open._import(host_share, path, payload, 2.0, [], None, None)
    except gs.GpuShareError:
        pass
    else:
        view.close()
    # Nothing left open by the import.  (Not "the same set": an fd of an earlier test's, a
    # connection ending on its idle timeout in the service thread, may close meanwhile.)
    assert not _fds() - before


# ------------------------------------------------------------------ cma requests, read by the exporter


def test_any_cma_request_is_checked_by_the_exporter_and_leaves_its_memory_alone():
    canary = np.full(3 * 4096, 0xA5, np.uint8)
    middle = canary[4096:8192]  # the shared part; its neighbours must never change
    middle[:] = 7
    share = gs.export(middle, lifetime="revoked")
    child = Child(_share_peer.setup)
    try:
        assert child.call("open", "v", share)["path"] == "cma"
        said = child.call("fuzz_cma", "v", 400, timeout=300)
        assert said["requests"] == 400 and said["unanswered"] == 0 and said["ok"] >= 200, said
        assert (canary[:4096] == 0xA5).all() and (canary[8192:] == 0xA5).all()
        with gs.open(share, exclude=["same-process"]) as again:  # the exporter serves on
            again.get(bytearray(8))
    finally:
        child.close()
        share.revoke()


def test_struct_sizes_are_what_the_fuzzers_assume():
    assert broker_mod._REPLY.size == struct.calcsize("!4sBBHI")


def test_a_forged_offset_is_refused_before_anything_is_mapped(host_share):
    fields = list(host_share.__reduce__()[1])
    fields += [d for _, d in gs.Share._OPTIONAL][len(fields) - len(gs.Share._BASE):]
    for offset in (1 << 33, 1, 4096):
        forged = list(fields)
        forged[gs.Share._NAMES.index("offset")] = offset
        # the exporter refuses it (its record says where the bytes are), so no path is tried
        with pytest.raises(gs.InvalidInputError, match=f"the share says 4096 bytes at offset {offset}, but its "
                           "exporter made it of 4096 bytes at offset 0: the share was altered"):
            gs.open(gs.Share._make(*forged), exclude=["same-process"])


def test_ucx_messages_about_a_bad_address_go_to_stderr_not_stdout():
    import subprocess
    import sys

    code = (
        "from gpushare._ucx import _common, _peer, _server\n"
        "raw = bytearray(_common.unpack(_server.server().address, _common.ADDRESS_MAGIC, 'a', 1 << 16)[1])\n"
        "pos = 1 + 8\n"  # a v1 address: header, worker uuid; then each device
        "while not raw[pos] & 0x80:\n"
        "    dev = raw[pos + 1]; pos += 2 + bool(dev & 0x40) + bool(dev & 0x20) + (dev & 0x1f) + 2 + 16\n"
        "    n = raw[pos] & 0x3f\n"  # one transport per device; a tcp one's port: 1, where nothing listens
        "    raw[pos + 1:pos + 1 + n] = (1).to_bytes(2, 'big') if n == 2 else raw[pos + 1:pos + 1 + n]; pos += 1 + n\n"
        "try:\n"
        "    _peer.client().connect(_common.pack(_common.ADDRESS_MAGIC, 0, bytes(raw)), timeout=3)\n"
        "except Exception as e:\n"
        "    print('refused', type(e).__name__)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.stdout == "refused UCXConnectionError\n"  # a program's stdout carries nothing of UCX's
    assert "[UCX ERROR]" in r.stderr


# Worker addresses and remote keys fed to UCX: tests/test_fuzz_ucx.py.
