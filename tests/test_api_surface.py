"""What a user meets around the API: field access, spellings, the bytes form of
a share, logging, and messages that say what to do."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpushare as gs
from gpushare._share import MAX_SHARE_BYTES, SHARE_FORMAT, Share

from _procs import Child
import _share_peer

# ---------------------------------------------------------------- fields


def test_share_fields_are_properties_listed_by_dir():
    share = gs.export(np.arange(6, dtype=np.float32).reshape(2, 3))
    try:
        names = set(dir(share))
        for field in ("share_id", "nbytes", "device", "shape", "typestr", "offers", "lifetime",
                      "exporter_pid", "node", "control", "fabric", "readonly", "version", "token"):
            assert field in names, field
            assert isinstance(getattr(Share, field), property), field
        assert (share.nbytes, share.device, share.shape, share.typestr) == (24, "host", (2, 3), "<f4")
        assert share.exporter_pid == os.getpid() and share.readonly is False
        with pytest.raises(AttributeError):
            share.nbytes = 1
        with pytest.raises(AttributeError):
            share.no_such_field  # noqa: B018
    finally:
        share.revoke()


@pytest.mark.parametrize("exc", [gs.UCXConnectionError("UCS_ERR_CONNECTION_RESET", "the peer went away"),
                                 gs.CUDAError("CUDA_ERROR_INVALID_VALUE", "cuMemMap"),
                                 gs.ClosedError("revoked")])
def test_errors_cross_processes_intact(exc):
    import pickle

    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert getattr(back, "status", None) == getattr(exc, "status", None)


def test_cpu_is_a_synonym_of_host():
    with gs.allocate(8192, device="cpu") as buf:
        assert isinstance(buf, gs.HostBuffer) and buf.device == "host"
        share = gs.export(buf)
        assert share.device == "host" and "host-fd" in share.offers
        share.revoke()
    with pytest.raises(gs.InvalidInputError, match="expected 'host' \\(or 'cpu'\\) or a device ordinal"):
        gs.allocate(4096, device="gpu")
    from gpushare import ucx

    with ucx.Agent() as agent:
        assert agent.create_memory_handle(4096, memory_type="cpu").memory_type == "host"
        with pytest.raises(gs.InvalidInputError, match="'host' \\(or 'cpu'\\) or 'cuda', not 'gpu'"):
            agent.create_memory_handle(4096, memory_type="gpu")


def test_handle_types_are_spelled_like_paths_and_old_spellings_warn():
    with gs.allocate(4096, device="host") as buf:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            desc = gs.export_buffer(buf, handle_type="posix-fd")  # no warning
        assert desc.handle_type == "posix-fd"
        with pytest.warns(DeprecationWarning, match="handle_type='posix_fd' is deprecated; spell it 'posix-fd'"):
            old = gs.export_buffer(buf, handle_type="posix_fd")
        assert old == desc
        with pytest.raises(gs.InvalidInputError, match="expected one of posix-fd, fabric, cuda-ipc"):
            gs.export_buffer(buf, handle_type="posix")
    assert gs.capabilities()["host"]["handle_types"] == ["posix-fd"]


# ---------------------------------------------------------------- bytes form


def _share(**changes):
    fields = dict(version=SHARE_FORMAT, share_id="ab" * 16, token=bytes(range(32)), exporter_pid=1234,
                  node="boot:host:netns=1", control=(("127.0.0.1", 4000), ("::1", 4001)), nbytes=24,
                  device="host", shape=(2, 3), typestr="<f4", offers=("same-process", "host-fd", "ucx-rma"),
                  lifetime="closed", fabric=None, readonly=False)
    fields.update(changes)
    return Share._make(*fields.values())


def test_to_bytes_round_trips_and_is_plain_json():
    share = gs.export(np.zeros(16, np.uint8), lifetime=3, readonly=True)
    try:
        data = share.to_bytes()
        assert isinstance(data, bytes) and data.isascii() and len(data) < 1024
        assert b'"format":"gpushare.share"' in data
        again = Share.from_bytes(data)
        assert again == share and again.lifetime == "imports=3" and again.readonly
        assert Share.from_bytes(bytearray(data)) == share
        assert Share.from_bytes(memoryview(data)) == share
        with gs.open(Share.from_bytes(data)) as view:  # the bytes form opens like the share
            assert view.path == "same-process"
    finally:
        share.revoke()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not ASCII JSON"),
        (b"\xff\xfe", "not ASCII JSON"),
        (b"[1, 2]", "do not start a 'gpushare.share' object"),
        (b'{"format": "gpushare.share"}', "wrong fields"),
        (b"{" + b" " * MAX_SHARE_BYTES + b"}", f"at most {MAX_SHARE_BYTES}"),
        (b"[" * 5000, "not ASCII JSON"),
        (b'{"a": 1, "a": 2}', "not ASCII JSON"),  # duplicate keys
        (b'{"nbytes": NaN}', "not ASCII JSON"),
        (b'{"nbytes": 1.5}', "not ASCII JSON"),
    ],
)
def test_from_bytes_refuses_what_is_not_a_share(data, match):
    with pytest.raises(gs.InvalidInputError, match=match):
        Share.from_bytes(data)


def test_from_bytes_refuses_a_pickle_and_non_bytes():
    import pickle

    with pytest.raises(gs.InvalidInputError):
        Share.from_bytes(pickle.dumps(_share()))
    with pytest.raises(gs.InvalidInputError, match="expects bytes, not str"):
        Share.from_bytes(_share().to_bytes().decode())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("token", "00" * 31, "64 lowercase hex digits"),
        ("token", "zz" * 32, "64 lowercase hex digits"),
        ("nbytes", 25, "nbytes says 25"),
        ("offers", ["host-fd", "host-fd"], "distinct"),
        ("offers", [["x"]], "unknown path"),
        ("control", [["example.com", 1]], "not an IP address"),
        ("version", 2, "this gpushare reads 1"),
        ("readonly", 1, "readonly must be a bool"),
    ],
)
def test_from_bytes_validates_every_field(field, value, match):
    import json

    obj = json.loads(_share().to_bytes())
    obj[field] = value
    with pytest.raises(gs.InvalidInputError, match=match):
        Share.from_bytes(json.dumps(obj).encode())


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_give_a_share_or_invalid_input(data):
    try:
        share = Share.from_bytes(data)
    except gs.InvalidInputError:
        return
    # Whatever parses is a whole share: it writes itself out and reads back the same.
    assert Share.from_bytes(share.to_bytes()) == share


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(Share._NAMES + ("format", "extra")), max_size=4), st.lists(_json, min_size=4,
                                                                                          max_size=4))
def test_mutated_shares_give_a_share_or_invalid_input(names, values):
    import json

    obj = json.loads(_share().to_bytes())
    for name, value in zip(names, values, strict=False):
        obj[name] = value
    try:
        share = Share.from_bytes(json.dumps(obj).encode())
    except gs.InvalidInputError:
        return
    assert Share.from_bytes(share.to_bytes()) == share


_addresses = st.sampled_from(["127.0.0.1", "10.1.2.3", "::1", "fe80::1%eth0", "198.18.0.7"])


@settings(max_examples=300, deadline=None)
@given(
    share_id=st.text("0123456789abcdef", min_size=32, max_size=32),
    token=st.binary(min_size=32, max_size=32),
    pid=st.integers(1, 2**31 - 1),
    node=st.text(max_size=256),
    control=st.lists(st.tuples(_addresses, st.integers(1, 65535)), min_size=1, max_size=16),
    shape=st.lists(st.integers(0, 64), max_size=4),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    device=st.one_of(st.just("host"), st.integers(0, 1 << 16)),
    offers=st.lists(st.sampled_from(gs._types.path_names()), min_size=1, max_size=6, unique=True),
    lifetime=st.one_of(st.sampled_from(["closed", "revoked", "none"]),
                       st.integers(1, 999_999_999).map(lambda n: f"imports={n}")),
    fabric=st.one_of(st.none(), st.text(max_size=256)),
    readonly=st.booleans(),
)
def test_round_trips_are_exact(share_id, token, pid, node, control, shape, itemsize, device, offers, lifetime,
                               fabric, readonly):
    count = 1
    for d in shape:
        count *= d
    nbytes = count * itemsize
    if nbytes < 1:
        shape, nbytes = (itemsize,), itemsize
        shape = (1,)
    share = Share._make(SHARE_FORMAT, share_id, token, pid, node, tuple(control), nbytes, device, tuple(shape),
                        f"<u{itemsize}" if itemsize > 1 else "|u1", tuple(offers), lifetime, fabric, readonly)
    data = share.to_bytes()
    assert len(data) <= MAX_SHARE_BYTES
    again = Share.from_bytes(data)
    assert again == share
    assert again._fields_ == share._fields_
    assert again.to_bytes() == data


# ---------------------------------------------------------------- logging


def test_logging_tells_path_lease_and_revocation(caplog):
    caplog.set_level(logging.DEBUG, logger="gpushare")
    buf = gs.allocate(4096, device="host")
    share = gs.export(buf, lifetime="revoked")
    with gs.open(share, exclude="same-process") as view:
        assert view.path == "host-fd"
    deadline = time.monotonic() + 10
    while "lease of" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)  # the exporter's thread sees the lease end
    share.revoke()
    buf.close()
    text = "\n".join(f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records)
    sid = share.share_id[:8]
    assert f"gpushare.api INFO exported share {sid}: 4096 bytes of host memory" in text
    assert "not same-process: excluded by the caller" in text
    assert f"gpushare.api INFO opened share {sid} over host-fd: same node" in text
    assert f"gpushare.export INFO share {sid}: lease opened over host-fd" in text
    assert f"gpushare.export INFO share {sid}: lease of pid {os.getpid()} on this node ended" in text
    assert f"gpushare.export INFO share {sid} revoked" in text
    assert all(r.name.startswith("gpushare.") for r in caplog.records)


def test_logging_tells_fallbacks(caplog):
    caplog.set_level(logging.INFO, logger="gpushare")
    exporter = Child(_share_peer.setup)
    try:
        share = exporter.call("export", "host", 4096, {"lifetime": "revoked"})
        exporter.call("stop_broker")  # host-fd cannot be served: falls back to ucx-rma
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gs.SlowPathWarning)
            with gs.open(share) as view:
                assert view.path == "ucx-rma"
    finally:
        exporter.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"share {share.share_id[:8]}: host-fd failed:" in text and "trying the next path" in text


def test_the_library_prints_nothing_and_ucx_logs_to_stderr():
    # An unknown UCX_ variable makes UCX warn while it creates its context:
    # the warning must reach stderr, never stdout (which belongs to the application).
    code = textwrap.dedent(
        """
        import gpushare as gs, numpy as np
        from gpushare import ucx
        with ucx.Agent():
            pass
        share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
        with gs.open(share, prefer="ucx-rma", exclude="same-process") as view:
            view.get(bytearray(64))
        share.revoke()
        """
    )
    env = dict(os.environ, UCX_GPUSHARE_NO_SUCH_SETTING="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert "[UCX WARN]" in r.stderr and "UCX_GPUSHARE_NO_SUCH_SETTING" in r.stderr


# ---------------------------------------------------------------- messages


def test_an_exporter_that_does_not_answer_is_said_to_run():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts connections, never answers: this very process "exported"
    share = _share(exporter_pid=os.getpid(), node=gs._process.node_key(), control=(listener.getsockname(),))
    try:
        with pytest.raises(gs.ExporterUnreachableError,
                           match=rf"the exporter \(pid {os.getpid()}\) is running on this node but did not answer"):
            gs.open(share, timeout=1)
    finally:
        listener.close()


def test_an_exporter_on_another_node_is_not_guessed_about():
    share = _share(node="another-node", control=(("127.0.0.1", 1),))
    with pytest.raises(gs.ExporterUnreachableError,
                       match=r"cannot reach the exporter \(pid 1234 on another node\).*127\.0\.0\.1:1"):
        gs.open(share, timeout=2)


def test_a_non_contiguous_array_is_refused_with_the_fix():
    with pytest.raises(gs.InvalidInputError, match=r"not C-contiguous.*numpy\.ascontiguousarray\(a\)"):
        gs.export(np.arange(10)[::2])

    class Strided:
        __array_interface__ = {"shape": (5,), "typestr": "<i8", "strides": (16,), "version": 3,
                               "data": (np.zeros(10, np.int64).ctypes.data, False)}

    with pytest.raises(gs.InvalidInputError, match=r"not C-contiguous; pass a C-contiguous copy"):
        gs.export(Strided())


def test_a_broken_ucx_connection_says_the_exporter_went_away():
    exporter = Child(_share_peer.setup)
    share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
    view = gs.open(share, prefer="ucx-rma")
    try:
        assert view.path == "ucx-rma"
        assert exporter.close(timeout=30) == 0
        with pytest.raises(gs.UCXConnectionError,
                           match=rf"the exporter \(pid {share.exporter_pid}\) has exited; this view cannot be used"):
            view.get(bytearray(16), timeout=30)
    finally:
        view.close()


def test_a_revoked_ucx_share_says_the_exporter_closed_it():
    share = gs.export(np.zeros(4096, np.uint8), lifetime="revoked")
    view = gs.open(share, exclude="same-process,cma")
    try:
        assert view.path == "ucx-rma"
        view.get(bytearray(16))
        share.revoke()
        with pytest.raises(gs.ClosedError, match="closed by its exporter: the share was revoked"):
            view.get(bytearray(16), timeout=10)  # refused at once: the exporter checks every request
    finally:
        view.close()


def test_open_and_import_take_cpu_for_host_memory_and_refuse_it_for_cuda_memory():
    buf = gs.allocate(4096, device="cpu")
    share = gs.export(buf, lifetime="revoked")
    with gs.open(share, device="cpu") as view:
        assert view.device == "host"
    with pytest.raises(gs.InvalidInputError, match="given for a share of host memory"):
        gs.open(share, device=0)
    mapped = gs.import_buffer(gs.export_buffer(buf), device="cpu")
    mapped.close()
    fabric = gs.VirtualMemoryFabricBufferDescriptor.from_handles([bytes(64)], [2 << 20])
    with pytest.raises(gs.InvalidInputError, match="descriptor of CUDA memory"):
        gs.import_buffer(fabric, device="cpu")
    share.revoke()
    buf.close()


# ---------------------------------------------------------------- wrong types


def _wrong_type_calls(share, view):
    """(what is called, the call, words the message must hold) for each public
    entry point given an argument of the wrong type."""
    return [
        ("open(str)", lambda: gs.open("x"), r"^open expects a gpushare\.Share, not str$"),
        ("open(bytes)", lambda: gs.open(share.to_bytes()),
         r"^open expects a gpushare\.Share, not bytes; .*gpushare\.Share\.from_bytes\(data\).*BundleShare\.from_bytes"),
        ("open(bytearray)", lambda: gs.open(bytearray(share.to_bytes())), r"^open expects .* not bytearray; .*from_bytes"),
        ("open(memoryview)", lambda: gs.open(memoryview(share.to_bytes())), r"^open expects .* not memoryview; .*from_bytes"),
        ("open(dict)", lambda: gs.open({"share": share}), r"^open expects a gpushare\.Share, not dict$"),
        ("open_async(bytes)", lambda: gs.open_async(share.to_bytes()), r"^open_async expects a gpushare\.Share, not bytes; "),
        ("export(object())", lambda: gs.export(object()), r"^object is not a buffer: expected the buffer protocol"),
        ("export(None)", lambda: gs.export(None), r"^NoneType is not a buffer"),
        ("export(str)", lambda: gs.export("abc"), r"^str is not a buffer"),
        ("export(readonly=1)", lambda: gs.export(np.zeros(2), readonly=1), r"^readonly must be a bool or None, not int"),
        ("export(lifetime=object())", lambda: gs.export(np.zeros(2), lifetime=object()),
         r"^lifetime must be .* not object$"),
        ("export(lifetime=True)", lambda: gs.export(np.zeros(2), lifetime=True), r"^lifetime must be .* not bool$"),
        ("Share.from_bytes(str)", lambda: Share.from_bytes("x"), r"^Share\.from_bytes expects bytes, not str$"),
        ("ChannelHandle.from_bytes(int)", lambda: gs.ChannelHandle.from_bytes(3),
         r"^ChannelHandle\.from_bytes expects bytes, not int$"),
        ("subscribe(bytes)", lambda: gs.subscribe(b"x"),
         r"^subscribe expects a gpushare\.ChannelHandle, not bytes; .*ChannelHandle\.from_bytes"),
        ("import_buffer(str)", lambda: gs.import_buffer("x"),
         r"^import_buffer expects a descriptor from gpushare\.export_buffer, not str$"),
        ("import_buffer(readonly=1)", lambda: gs.import_buffer("x", readonly=1), r"^readonly must be a bool, not int$"),
        ("get_batch(str)", lambda: gs.get_batch("x"), r"^a batch is an iterable of .* tuples, not str$"),
        ("get_batch(5)", lambda: gs.get_batch(5), r"^a batch is an iterable of .* tuples, not int$"),
        ("put_batch([x])", lambda: gs.put_batch(["x"]), r"^batch item 0 is not a \(view, offset, buffer\) tuple"),
        ("view.get(object())", lambda: view.get(object()), r"^object is not a buffer"),
        ("open(prefault=1)", lambda: gs.open(share, prefault=1), r"^prefault must be a bool, not int$"),
    ]


def test_wrong_types_raise_an_error_that_is_a_gpushare_error_and_a_type_error():
    assert issubclass(gs.InvalidTypeError, gs.GpuShareError)
    assert issubclass(gs.InvalidTypeError, TypeError)
    # Written before the class existed: these clauses still catch it.
    assert issubclass(gs.InvalidTypeError, gs.InvalidInputError)
    assert issubclass(gs.InvalidTypeError, ValueError)
    share = gs.export(np.arange(8, dtype=np.uint8), lifetime="revoked")
    view = gs.open(share)
    try:
        failed = []
        for what, call, match in _wrong_type_calls(share, view):
            try:
                call()
            except gs.InvalidTypeError as exc:
                if not re.search(match, str(exc)):
                    failed.append(f"{what}: message {str(exc)!r} does not match {match!r}")
            except Exception as exc:  # noqa: BLE001 (the test reports every entry point at once)
                failed.append(f"{what}: raised {type(exc).__name__}: {exc}")
            else:
                failed.append(f"{what}: raised nothing")
        assert not failed, "\n".join(failed)
        # The right types still work after the wrong ones.
        again = gs.open(Share.from_bytes(share.to_bytes()))
        assert again.get().tobytes() == bytes(range(8))
        again.close()
    finally:
        view.close()
        share.revoke()


def test_a_bundles_bytes_given_to_open_point_to_from_bytes_and_read_back_as_a_bundle_share():
    share = gs.export({"a": np.arange(4, dtype=np.int32), "b": np.ones(3)}, lifetime="revoked")
    try:
        with pytest.raises(TypeError, match=r"^open expects a gpushare\.Share, not bytes; .*Share\.from_bytes"):
            gs.open(share.to_bytes())
        back = gs.BundleShare.from_bytes(share.to_bytes())
        assert isinstance(back, gs.BundleShare) and back == share
        with gs.open(back) as bundle:
            assert bundle["a"].get().tolist() == [0, 1, 2, 3]
    finally:
        share.revoke()
