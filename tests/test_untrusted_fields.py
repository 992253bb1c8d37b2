"""Fields from another process that once slipped through the checks."""

from __future__ import annotations

import numpy as np
import pytest

import gpushare as gs
from gpushare._descriptors import PosixFdBufferDescriptor
from gpushare._share import Share


@pytest.fixture(scope="module")
def fields():
    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    yield dict(zip(Share._NAMES, share._fields_, strict=True))
    share.revoke()


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("share_id", "0" * 32 + "\n", "share id must be 32 lowercase hex digits"),  # $ took a trailing newline
        ("typestr", "|u1\n", "not an array-interface type string"),
        ("typestr", "|u\u0661", "not an array-interface type string"),  # an Arabic-Indic one: \\d took it
        ("lifetime", "imports=1\n", "not a known policy"),
        ("lifetime", "imports=\u0661", "not a known policy"),
        ("version", 1.0, "share format version"),
        ("version", True, "share format version"),
        ("offers", (["host-fd"],), "share offers unknown path"),  # unhashable: a TypeError once
    ],
)
def test_share_fields_that_once_passed_are_refused(fields, name, value, match):
    bad = dict(fields, **{name: value})
    with pytest.raises(gs.InvalidInputError, match=match):
        Share._make(*bad.values())


def test_a_surrogate_in_a_broker_address_is_refused():
    good = ("\0gpushare-1-abc", 3, bytes(range(32)), 1234, "boot:host", "host", (4096,), 4096, None)
    with pytest.raises(gs.InvalidInputError, match="lone surrogate"):
        PosixFdBufferDescriptor._from_fields(1, "\0gs-\ud800", *good[1:])


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"device": 3}, r"the share says CUDA memory \(device 3\), but its exporter serves host memory"),
        ({"nbytes": 32, "shape": (32,)}, "the share says 32 bytes, but its exporter made it of 64"),
        ({"readonly": True}, "the share says 64 bytes, read-only, but its exporter made it of 64 bytes:"),
    ],
)
def test_a_share_altered_in_its_own_process_opens_nothing(fields, changes, match):
    altered = Share._make(*dict(fields, **changes).values())
    with pytest.raises(gs.InvalidInputError, match=match):
        gs.open(altered)  # same-process: the exporter's own record says what the memory is


@pytest.mark.parametrize("path", ["host-fd", "cma", "ucx-rma"])
@pytest.mark.parametrize(
    ("export_readonly", "changes", "match"),
    [
        (False, {"device": 0}, r"the share says CUDA memory \(device 0\), but its exporter serves host memory"),
        (False, {"nbytes": 2048, "shape": (2048,)}, "the share says 2048 bytes, but its exporter made it of 4096"),
        (False, {"nbytes": 8192, "shape": (8192,)}, "the share says 8192 bytes, but its exporter made it of 4096"),
        (False, {"offset": 1024, "nbytes": 2048, "shape": (2048,)},
         "the share says 2048 bytes at offset 1024, but its exporter made it of 4096 bytes at offset 0"),
        (False, {"readonly": True}, "the share says 4096 bytes, read-only, but its exporter made it of 4096 bytes:"),
        (True, {"readonly": False}, "the share says 4096 bytes, but its exporter made it of 4096 bytes, read-only"),
    ],
)
def test_an_altered_share_is_refused_by_its_exporter_on_every_path(path, export_readonly, changes, match):
    """Over the control channel (as from another process) the exporter compares what the share says
    with its own record and refuses: no view on any path, and no other path is tried."""
    # memfd memory is offered on host-fd (and ucx-rma), a plain NumPy array on cma (and ucx-rma)
    arr = gs.zeros((4096,), np.uint8) if path == "host-fd" else np.zeros(4096, np.uint8)
    arr[:] = 7
    share = gs.export(arr, lifetime="revoked", readonly=export_readonly)
    try:
        assert path in share.offers
        fields = dict(zip(Share._NAMES, share._fields_, strict=True))
        altered = Share._make(*dict(fields, **changes).values())
        with pytest.raises(gs.InvalidInputError, match=match) as info:
            gs.open(altered, prefer=[path], exclude=["same-process"])
        assert "failed" not in str(info.value)  # refused at once, not after trying paths
        with gs.open(share, prefer=[path], exclude=["same-process"]) as view:  # the honest share still opens
            out = bytearray(4096)
            view.get(out)
            assert view.path == path and out == b"\x07" * 4096
    finally:
        share.revoke()
