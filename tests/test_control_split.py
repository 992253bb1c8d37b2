"""Control messages split over frames (a bundle's open request and grant,
one item per allocation) and the cma batch requests: what a peer sends is
untrusted, so every malformed or oversized form is refused."""

from __future__ import annotations

import pytest

from gpushare import _control
from gpushare._errors import InvalidInputError
from gpushare._paths import cma


def _frames(data: bytes) -> list[dict]:
    return _control.take_frames(bytearray(data))


def _grant(n: int) -> dict:
    return {"id": 7, "ok": True, "lease": 1,
            "payload": {"parts": [{"key": "k" * 40, "i": i} for i in range(n)], "fds": [i % 2 for i in range(n)]}}


def test_a_message_that_fits_is_one_frame():
    msg = _grant(3)
    frames = _frames(_control.pack_split(msg, msg["payload"], ("parts", "fds")))
    assert len(frames) == 1 and "more" not in frames[0]


def test_a_large_grant_goes_in_frames_each_within_the_limit_and_joins_back():
    msg = _grant(20000)
    data = _control.pack_split(msg, msg["payload"], ("parts", "fds"))
    frames = _frames(data)
    assert len(frames) > 10 and frames[0]["more"] == len(frames) - 1
    assert len(msg["payload"]["parts"]) == 20000  # the caller's message is left as it was
    whole = _control.Assembly(frames[0], frames[0]["payload"], ("parts", "fds"), 20000)
    assert [whole.add(f) for f in frames[1:]] == [False] * (len(frames) - 2) + [True]
    assert [dict(p) for p in whole.lists["parts"]] == msg["payload"]["parts"]
    assert list(whole.lists["fds"]) == msg["payload"]["fds"]


def _split(n: int = 4000) -> list[dict]:
    msg = _grant(n)
    return _frames(_control.pack_split(msg, msg["payload"], ("parts", "fds")))


@pytest.mark.parametrize("bound", [0, 1, 3999])
def test_more_items_or_frames_than_expected_are_refused(bound):
    frames = _split()
    with pytest.raises(InvalidInputError):
        whole = _control.Assembly(frames[0], frames[0]["payload"], ("parts", "fds"), bound)
        for f in frames[1:]:
            whole.add(f)


@pytest.mark.parametrize("more", [0, -1, True, "3", None, 1 << 40])
def test_a_malformed_count_of_frames_is_refused(more):
    first = {**_split()[0], "more": more}
    with pytest.raises(InvalidInputError):
        _control.Assembly(first, first["payload"], ("parts", "fds"), 1 << 16)


@pytest.mark.parametrize("bad", [
    {"id": 8, "cont": {"parts": [{}], "fds": [0]}},                    # another request's id
    {"id": 7, "cont": {"parts": [], "fds": []}},                       # an empty frame
    {"id": 7, "cont": {"parts": [{}], "fds": [0, 0]}},                 # lists of unequal lengths
    {"id": 7, "cont": {"parts": [{}]}},                                # a list missing
    {"id": 7, "cont": {"parts": [{}], "fds": [0], "x": [1]}},          # a list more
    {"id": 7, "cont": [[{}], [0]]},                                    # not a dict
    {"id": 7, "cont": {"parts": [{}], "fds": [0]}, "ok": True},        # another field
    {"id": 7, "cont": {"parts": {"a": 1}, "fds": [0]}},                # not a list
])
def test_a_malformed_continuation_is_refused(bad):
    frames = _split()
    whole = _control.Assembly(frames[0], frames[0]["payload"], ("parts", "fds"), 1 << 16)
    with pytest.raises(InvalidInputError):
        whole.add(bad)


def test_an_item_too_large_for_any_frame_is_refused_when_sent():
    msg = {"id": 1, "parts": ["x" * 70000, "y"]}
    with pytest.raises(InvalidInputError, match="one item of a control message"):
        _control.pack_split(msg, msg, ("parts",))


GOOD = {"op": "cma", "dir": "get", "items": [[0, 8, 4096, 0], [8, 8, 8192, 1]]}


@pytest.mark.parametrize("items", [
    [],                                                       # no copy
    [[0, 8, 4096]],                                           # a bundle's copy without its allocation
    [[0, 8, 4096, 2]],                                        # an allocation the bundle does not have
    [[0, 8, 4096, -1]],
    [[0, 0, 4096, 0]],                                        # nothing to copy
    [[-1, 8, 4096, 0]],
    [[0, 8, 0, 0]],                                           # no address
    [[0, 8, 1 << 64, 0]],
    [[0, 1 << 62, 4096, 0]],
    [[0, 8, 4096, True]],                                     # a bool is not an allocation
    [[0, 8.0, 4096, 0]],
    [[0, 8, 4096, 0, 0]],
    "items",
    [[0, 8, 4096, 0]] * (cma.MAX_ITEMS + 1),                  # more than one request may carry
])
def test_malformed_cma_batches_are_refused_whole(items):
    assert cma._items_of({**GOOD, "items": items}, 2) is None


def test_a_cma_batch_and_a_single_copy_read_alike():
    assert cma._items_of(GOOD, 2) == [(0, 0, 8, 4096), (1, 8, 8, 8192)]
    assert cma._items_of({"op": "cma", "dir": "get", "offset": 8, "n": 4, "addr": 64}, None) == [(None, 8, 4, 64)]
    assert cma._items_of({"op": "cma", "items": [[8, 4, 64]]}, None) == [(None, 8, 4, 64)]
    assert cma._items_of({"op": "cma", "items": [[8, 4, 64, 0]]}, None) is None  # a share of one buffer names none
