"""A hostile exporter answers bundle opens: a real exporter process
(tests/_hostile_bundle_peer.py) that alters each reply it sends over its
control socket, from the payload's items and the fds riding with it to the
frame itself.  Every open ends in the bundle (the alteration was one the
importer cannot tell from a genuine reply, and its values are the memory's)
or a GpuShareError, within the open's timeout; afterwards this process holds
no fd, no memfd mapping, no lease and no connection it did not hold before,
and the exporter holds no lease: it was given back, or its connection
dropped.  (tests/test_fuzz_bundle_replies.py feeds altered replies straight
to the importer's parsing.)"""

from __future__ import annotations

import gc
import os
import re
import time

import _hostile_bundle_peer
import pytest
from _bundle_peer import memfd_mappings
from _procs import Child, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpushare as gs
from gpushare import _importer
from gpushare._importer import get_importer
from gpushare._service import get_service

TIMEOUT = 3.0  # each open's


@pytest.fixture(scope="module")
def hostile():
    """The hostile exporter, and this process's importer closing idle connections at once."""
    saved = _importer.IDLE_LINGER
    _importer.IDLE_LINGER = 0.05  # the connection of a failed open is gone before the next example
    try:
        child = Child(_hostile_bundle_peer.setup)
        yield child
        child.close()
        # the module leaves no connection, lease or timer of its own to the tests after it
        service = get_service()
        assert wait_for(lambda: get_importer().stats() == {"connections": 0, "leases": 0}
                        and service.stats()["timers"] == 0, 10), (get_importer().stats(), service.stats())
        gc.collect()
    finally:
        _importer.IDLE_LINGER = saved


def _fds() -> set[tuple[str, str]]:
    """This process's open fds, each with what it is (a number reused by
    another file shows as a new one)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # closed meanwhile (the listing's own fd among them)
    return out


def _quiet(child: Child) -> bool:
    """No connection of this process's importer, and no lease at the exporter."""
    stats = get_importer().stats()
    exporter = child.call("status")
    return stats == {"connections": 0, "leases": 0} and exporter["leases"] == 0 and not any(
        exporter["opens"].values())


def _attempt(child: Child, forgery: dict, share: str = "bundle", **how) -> dict:
    """Open ``share`` while the exporter applies ``forgery``: what came of it,
    with what was left behind checked."""
    assert wait_for(lambda: _quiet(child), 10), (get_importer().stats(), child.call("status"))
    gc.collect()  # what earlier tests left to the collector goes now, not during the open
    fds_before, maps_before = _fds(), memfd_mappings()
    child.call("forge", forgery)
    shares = child.hello["shares"]
    t0 = time.monotonic()
    try:
        bundle = gs.open(shares[share], exclude=["ucx-rma", *how.pop("exclude", [])], timeout=TIMEOUT, **how)
    except gs.GpuShareError as exc:
        outcome = {"error": exc}
    else:  # the alteration went unnoticed: the bundle holds what the memory holds, or fails as a GpuShareError
        with bundle:
            try:
                got = {k: bytes(memoryview(v).cast("B")) for k, v in bundle.get().items()}
            except gs.GpuShareError as exc:
                outcome = {"opened": bundle.paths, "get_error": exc}
            else:
                outcome = {"opened": bundle.paths, "values": got}
    elapsed = time.monotonic() - t0
    outcome["served"] = child.call("status")["served"]  # grants the forgery altered
    child.call("forge", {})
    assert elapsed < TIMEOUT + 2, (forgery, elapsed)
    assert wait_for(lambda: _quiet(child), 10), (forgery, get_importer().stats(), child.call("status"))
    # nothing is left open or mapped (other objects of this process may close theirs meanwhile)
    assert _fds() <= fds_before, (forgery, _fds() - fds_before)
    assert memfd_mappings() <= maps_before, forgery
    return outcome


GENUINE = {"a": b"\x01" * 8192, "b": b"\x02" * 4096, "c": b"\x03" * 4096}


def test_the_genuine_replies_open_and_leave_nothing(hostile):
    got = _attempt(hostile, {})
    assert got["opened"] == ("host-fd", "host-fd") and got["values"] == {k: GENUINE[k] for k in "ab"}
    got = _attempt(hostile, {}, "mixed")
    assert got["opened"] == ("host-fd", "host-fd", "cma") and got["values"] == GENUINE
    # the hook itself sends what it was given: an alteration that changes nothing opens as before
    got = _attempt(hostile, {"edits": [[["fds", 0], 1]], "fds": ["real:0", "real:1"]})
    assert got["values"] == {k: GENUINE[k] for k in "ab"}
    assert got["served"] == 1


_MALFORMED = (gs.InvalidInputError, "exporter sent a malformed bundle offer")


def _failed(i: int, why: str) -> tuple:
    return (gs.GpuShareError, f"every path failed for allocation {i} of the bundle: host-fd failed: .*{why}")


DESC = ["parts", 0, "descriptor"]  # allocation 0's descriptor: [type, version, address, export id, token, pid,
# node, device, sizes, size, owner uuid]

CASES = {
    # the payload's shape
    "a payload that is a list": ({"edits": [[[], [1, 2]]]}, _MALFORMED),
    "no payload": ({"edits": [[[], None]]}, _MALFORMED),
    "no parts": ({"edits": [[["parts"], "<delete>"]]}, _MALFORMED),
    "no fd counts": ({"edits": [[["fds"], "<delete>"]]}, _MALFORMED),
    "one part short": ({"edits": [[["parts", 1], "<delete>"], [["fds", 1], "<delete>"]]}, _MALFORMED),
    "a part too many": ({"edits": [[["parts", 2], {"<copy>": ["parts", 1]}], [["fds", 2], 0]]}, _MALFORMED),
    "parts that are a dict": ({"edits": [[["parts"], {"0": {}, "1": {}}]]}, _MALFORMED),
    # an allocation's grant malformed is its path failing (as for a share of one buffer): its next path is
    # asked for, and host-fd is the only one here
    "a part that is a list": ({"edits": [[["parts", 0], []]]},
                              _failed(0, "exporter sent a malformed offer for allocation 0")),
    "a part that is a string": ({"edits": [[["parts", 1], "host-fd"]]},
                                _failed(1, "exporter sent a malformed offer for allocation 1")),
    # fd counts
    "fd counts not the fds sent": ({"edits": [[["fds", 1], 2]]}, _MALFORMED),
    "a huge fd count": ({"edits": [[["fds", 0], 1 << 62]]}, _MALFORMED),
    "a negative fd count": ({"edits": [[["fds"], [3, -1]]]}, _MALFORMED),
    "a bool fd count": ({"edits": [[["fds"], [True, True]]]}, _MALFORMED),
    "a str fd count": ({"edits": [[["fds", 0], "1"]]}, _MALFORMED),
    "a float fd count": ({"edits": [[["fds", 0], 1.0]]}, _MALFORMED),
    "both fds to one allocation": ({"edits": [[["fds"], [2, 0]]]},
                                   _failed(0, "sent 2 file descriptors; the descriptor names 1")),
    # the fds themselves
    "too few fds": ({"fds": ["real:0"]}, _MALFORMED),
    "too many fds": ({"fds": ["real:0", "real:1", "devnull"]}, _MALFORMED),
    "no fds": ({"fds": []}, _MALFORMED),
    "a hundred fds": ({"fds": ["devnull"] * 100}, _MALFORMED),
    "fds swapped": ({"fds": ["real:1", "real:0"]}, _failed(0, "file descriptor 0 is 4096 bytes; the descriptor says 8192")),
    "a pipe for a memfd": ({"fds": ["pipe", "real:1"]}, _failed(0, "file descriptor 0 is not a regular file")),
    "a directory for a memfd": ({"fds": ["real:0", "dir"]}, _failed(1, "file descriptor 0 is not a regular file")),
    "a socket for a memfd": ({"fds": ["socket", "real:1"]}, _failed(0, "not a regular file")),
    "/dev/null for a memfd": ({"fds": ["devnull", "real:1"]}, _failed(0, "not a regular file")),
    "a memfd too small": ({"fds": ["memfd:4096:sealed", "real:1"]}, _failed(0, "is 4096 bytes; the descriptor says 8192")),
    "an empty memfd": ({"fds": ["real:0", "memfd:0:sealed"]}, _failed(1, "is 0 bytes; the descriptor says 4096")),
    "a memfd too large": ({"fds": ["real:0", "memfd:1048576:sealed"]}, _failed(1, "is 1048576 bytes")),
    "an unsealed memfd": ({"fds": ["memfd:8192", "real:1"]}, _failed(0, "not sealed against shrinking")),
    "another share's memfd": ({"fds": ["other", "real:1"]}, _failed(0, "is 4096 bytes; the descriptor says 8192")),
    # the descriptors
    "a descriptor that is a str": ({"edits": [[DESC, "posix-fd"]]}, _failed(0, "malformed descriptor")),
    "a descriptor of another type": ({"edits": [[DESC + [0], "ucx-rma"]]}, _failed(0, "")),
    "a huge size": ({"edits": [[DESC + [9], 1 << 70]]}, _failed(0, "")),
    "a size too small for the allocation": ({"edits": [[DESC + [9], 4096], [DESC + [8], [4096]]]},
                                            _failed(0, "descriptor is 4096 bytes; the share says 8192")),
    "huge allocation sizes": ({"edits": [[DESC + [8], [1 << 62]], [DESC + [9], 1 << 62]]}, _failed(0, "")),
    "sizes of no page multiple": ({"edits": [[DESC + [8], [8191]], [DESC + [9], 8191]]}, _failed(0, "")),
    "a CUDA device": ({"edits": [[DESC + [7], 0]]}, _failed(0, "")),
    "a token of the wrong type": ({"edits": [[DESC + [4], 7]]}, _failed(0, "")),
    "another node": ({"edits": [[DESC + [6], "elsewhere"]]}, _failed(0, "")),
    # replies for another share
    "another bundle's grant": ({"other": ["pair", "host-fd,host-fd"]},
                               _failed(0, "descriptor is 4096 bytes; the share says 8192")),
    "a single share's grant": ({"other": ["single", "host-fd"]}, _MALFORMED),
    "grants swapped": ({"edits": [[["parts", 0], {"<copy>": ["parts", 1]}], [["parts", 1], {"<copy>": ["parts", 0]}]]},
                       _failed(0, "descriptor is 4096 bytes; the share says 8192")),
    # the frame
    "another request's id": ({"frame": "id:1"}, (gs.ExporterUnreachableError, "")),
    "an id long past": ({"frame": "id:-1000"}, (gs.ExporterUnreachableError, "")),
    "fds announced and not sent": ({"frame": "announce:1"}, (gs.ExporterUnreachableError, "")),
    "more fds sent than announced": ({"frame": "announce:-1"}, _MALFORMED),
    "a lease that is a str": ({"frame": 'lease:"1"'}, (gs.InvalidInputError, "granted a malformed lease")),
    "a lease that is a bool": ({"frame": "lease:true"}, (gs.InvalidInputError, "granted a malformed lease")),
    "a huge lease": ({"frame": "lease:1180591620717411303424"}, None),
    "a refusal that grants": ({"frame": "set:ok=false"}, (gs.InvalidInputError, "exporter answered")),
    "cut short in its length": ({"frame": "cut:2"}, (gs.ExporterUnreachableError, "")),
    "cut short in its body": ({"frame": "cut:40"}, (gs.ExporterUnreachableError, "")),
    "a frame too long": ({"frame": "bad-length"}, (gs.ExporterUnreachableError, "")),
    "a frame that is not JSON": ({"frame": "not-json"}, (gs.ExporterUnreachableError, "")),
    "the connection closed instead": ({"frame": "close"}, (gs.ExporterUnreachableError, "")),
    "no reply": ({"frame": "silent"}, (gs.ExporterUnreachableError, "no answer from exporter pid [0-9]+ within 3 s")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_altered_reply_is_refused_and_leaves_nothing(hostile, case):
    forgery, expected = CASES[case]
    got = _attempt(hostile, forgery)
    if expected is None:  # nothing the importer can refuse: the bundle, or an error
        assert "error" in got or got.get("values") == {k: GENUINE[k] for k in "ab"}, got
        return
    kind, message = expected
    assert "error" in got, (case, got)
    assert isinstance(got["error"], kind), (case, repr(got["error"]))
    assert re.search(message, str(got["error"])), (case, str(got["error"]))


def test_a_reply_sent_twice_ends_the_connection_and_the_bundle_says_so(hostile):
    got = _attempt(hostile, {"frame": "twice"})
    # the first reply opened the bundle; the second, to no request, ended the connection (and its lease)
    assert "error" in got or got.get("values") == {k: GENUINE[k] for k in "ab"} or isinstance(
        got.get("get_error"), gs.GpuShareError), got


def test_an_allocation_that_falls_back_opens_over_the_next_path(hostile):
    """A forged host-fd grant of an allocation is that path failing: the open
    asks again, the allocation's next path (cma) is forged as well, and the
    whole open fails, every allocation's reasons said."""
    got = _attempt(hostile, {"fds": ["pipe", "real:1"]}, "mixed")
    assert isinstance(got["error"], gs.GpuShareError), got
    assert "host-fd failed: file descriptor 0 is not a regular file" in str(got["error"]), got


MIXED_CASES = {
    "fds with a cma grant": ({"edits": [[["fds", 2], 1]], "fds": ["real:0", "real:1", "devnull"]},
                             "allocation 2 of the bundle: cma failed: exporter sent file descriptors with a cma offer"),
    "a cma grant that says something": ({"edits": [[["parts", 2, "descriptor"], {"<copy>": DESC}]]},
                                        "allocation 2 of the bundle: cma failed: exporter sent a malformed cma offer"),
    "a host-fd grant in place of the cma one": (
        {"edits": [[["parts", 2], {"<copy>": ["parts", 1]}], [["fds", 2], 1]], "fds": ["real:0", "real:1", "real:1"]},
        "allocation 2 of the bundle: cma failed: exporter sent file descriptors with a cma offer"),
}


SPLITS = {  # the grant split over frames (as a grant of many allocations is), then altered
    "more frames announced than allocations": "more=5",
    "no more frames announced": "more=0",
    "a negative number of frames": "more=-1",
    "a bool for the number of frames": "more=true",
    "a str for the number of frames": 'more="1"',
    "the continuation never sent": "short",
    "a continuation too many": "twice",
    "a continuation of another request": "wrong-id",
    "more items than allocations": "extra",
    "a continuation with no items": "empty",
    "lists of unequal lengths": "uneven",
    "a continuation's list that is a dict": "dict",
    "a continuation with another list": "extra-key",
    "a continuation with another field": "extra-field",
    "a first frame without its lists": "no-lists",
}


def test_a_genuine_grant_split_over_frames_opens(hostile):
    got = _attempt(hostile, {"frame": "split:genuine"})
    assert got["opened"] == ("host-fd", "host-fd") and got["values"] == {k: GENUINE[k] for k in "ab"}, got


@pytest.mark.parametrize("case", list(SPLITS))
def test_an_altered_split_grant_is_refused_and_leaves_nothing(hostile, case):
    """The importer joins a split grant only as its first frame announces it,
    within the allocations it asked for: anything else is a GpuShareError
    (the connection goes, and with it the lease), within the timeout."""
    got = _attempt(hostile, {"frame": "split:" + SPLITS[case]})
    if case == "a continuation too many":  # the grant was whole before the stray frame ended the connection
        assert "error" in got or got.get("values") == {k: GENUINE[k] for k in "ab"} or isinstance(
            got.get("get_error"), gs.GpuShareError), got
        return
    assert isinstance(got.get("error"), gs.GpuShareError), (case, got)


@pytest.mark.parametrize("case", list(MIXED_CASES))
def test_an_altered_cma_grant_is_refused_and_leaves_nothing(hostile, case):
    """In a bundle of host-fd and cma allocations; cma is the only path of allocation 2."""
    forgery, message = MIXED_CASES[case]
    got = _attempt(hostile, forgery, "mixed")
    assert isinstance(got.get("error"), gs.GpuShareError), (case, got)
    assert message in str(got["error"]), (case, str(got["error"]))


# ------------------------------------------------------------------ random alterations


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=20) | st.binary(max_size=40)
    | st.sampled_from([0, 1, 4096, 8192, "host", "host-fd", "posix-fd", "<delete>"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

PLACES = [[], ["parts"], ["fds"], ["extra"], *[["fds", i] for i in range(3)],
          *[["parts", i] for i in range(3)], *[["parts", i, "descriptor"] for i in range(2)],
          *[["parts", i, "descriptor", j] for i in range(2) for j in range(11)],
          *[["parts", i, "descriptor", 8, 0] for i in range(2)]]
FD_KINDS = ["real:0", "real:1", "pipe", "dir", "devnull", "socket", "memfd:4096:sealed", "memfd:8192:sealed",
            "memfd:8192", "other"]
FRAMES = [None, None, None, "id:1", "announce:1", "announce:-1", "cut:10", "close", "lease:-1", "set:fds=-1",
          "set:payload=[]", 'set:id="1"', "split:genuine", "split:extra", "split:uneven", "split:more=5"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(PLACES), json_values), max_size=3),
       st.none() | st.lists(st.sampled_from(FD_KINDS), max_size=4), st.sampled_from(FRAMES),
       st.sampled_from(["bundle", "mixed"]))
def test_any_altered_reply_opens_or_raises_and_leaves_nothing(hostile, edits, fds, frame, share):
    forgery: dict = {"edits": [list(e) for e in edits]}
    if fds is not None:
        forgery["fds"] = fds
    if frame is not None:
        forgery["frame"] = frame
    got = _attempt(hostile, forgery, share)
    if "values" in got:  # opened: host-fd may map a forged memfd of the right size, cma reads the memory
        expected = GENUINE if share == "mixed" else {k: GENUINE[k] for k in "ab"}
        assert set(got["values"]) == set(expected)
        assert all(len(got["values"][k]) == len(v) for k, v in expected.items())
