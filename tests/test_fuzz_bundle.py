"""Forged bundle manifests: refused when the share is built, or by its exporter.

A bundle's share carries its manifest (gpushare/_manifest.py: compressed JSON
of allocations, dtypes, per-tensor columns and the tree).  From another
process it is untrusted: every forged manifest is refused with
InvalidInputError however it arrives (:meth:`Share.from_bytes`, a pickle,
:func:`gpushare._manifest.decode` itself), never another exception and never
a huge allocation; one that the checks accept describes only tensors that lie
inside their allocations (checked here with Python ints).  A forged manifest
that is well formed is refused by the exporter, which knows the digest of
the one it made, before it grants anything: the importer maps nothing and
holds no lease, and the genuine share still opens.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import pickle
import tracemalloc
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpushare as gs
from gpushare import _exporter, _manifest, _share
from gpushare._exporter.registry import get_exporter
from gpushare._share import Share
from gpushare._types import path_names

from _procs import Child

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MAX = 1 << 56  # the most bytes a size, offset, dim or stride may say


def _tree():
    """Tensors of three allocations (gpushare memory, a NumPy array under a
    strided column, a small NumPy array), nested two containers deep."""
    pool = gs.empty(256, "int32")
    pool[:] = np.arange(256, dtype=np.int32)
    grid = np.arange(48.0).reshape(8, 6)
    return {"w": pool[:64].reshape(8, 8), "b": pool[64:96], "col": grid[:, 2],
            "pair": (np.arange(5, dtype=np.int16), pool[96:100]), "nest": [{"x": pool[100:101]}]}


@pytest.fixture(scope="module")
def genuine():
    share = gs.export(_tree(), lifetime="revoked")
    doc = json.loads(zlib.decompress(share._fields_[-1]))
    # what the cases below assume of it: leaf 0 is w (contiguous), leaf 2 col (strided), in parts 0 and 1
    assert doc["part"][:3] == [0, 0, 1] and doc["strided"] == [2] and doc["ndim"][:3] == [2, 1, 1]
    yield share, doc
    share.revoke()


def _blob(doc: Any) -> bytes:
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode("ascii"))


class _Forged:
    """Pickles as a share of ``fields`` does (the same bytes): what a peer
    that altered a share's fields sends."""

    def __init__(self, fields: tuple) -> None:
        self.fields = fields

    def __reduce__(self) -> tuple:
        return (_share._rebuild_share, self.fields)


def _fields(share: Share, **changes: Any) -> tuple:
    return tuple(dict(zip(Share._NAMES, share._fields_, strict=True), **changes).values())


def _via_pickle(share: Share, **changes: Any) -> Share:
    return pickle.loads(pickle.dumps(_Forged(_fields(share, **changes))))


def _via_bytes(share: Share, **changes: Any) -> Share:
    wire = json.loads(share.to_bytes())
    for name, value in changes.items():
        if name == "manifest":
            value = base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value
        wire[name] = list(value) if isinstance(value, tuple) else value
    return Share.from_bytes(json.dumps(wire).encode("ascii"))


def test_the_forgeries_are_built_as_a_peer_sends_them(genuine):
    """The pickle and bytes above are those of a real share when nothing is
    changed, so that a refusal below is the manifest's doing."""
    share, doc = genuine
    assert pickle.dumps(_Forged(share._fields_)) == pickle.dumps(share)
    assert _via_pickle(share) == share and _via_bytes(share) == share
    again = _via_bytes(share, manifest=_blob(doc))  # re-encoded: a share as valid as the genuine one
    assert type(again) is gs.BundleShare and again.count == 6 and again._bundle.tree == share._bundle.tree


def _refused_everywhere(share: Share, blob: Any, match: str) -> None:
    for build in (_manifest.decode, lambda b: _via_pickle(share, manifest=b),
                  lambda b: _via_bytes(share, manifest=b)):
        with pytest.raises(gs.InvalidInputError, match=match):
            build(blob)


# ------------------------------------------------------------------ the manifest's JSON, altered


def _reshape(d: dict, i: int, shape: list) -> None:
    at = sum(d["ndim"][:i])
    d["dims"][at:at + d["ndim"][i]] = shape
    d["ndim"][i] = len(shape)


def _retype(d: dict, i: int, entry: list) -> None:
    d["dtypes"].append(entry)
    d["dtype"][i] = len(d["dtypes"]) - 1


def _set(column: str, i: Any, value: Any):
    def change(d: dict) -> None:
        target = d[column]
        for key in i[:-1] if isinstance(i, tuple) else ():
            target = target[key]
        target[i[-1] if isinstance(i, tuple) else i] = value
    return change


def _nest(depth: int):
    def change(d: dict) -> None:
        for _ in range(depth):
            d["tree"] = ["l", d["tree"]]
    return change


class _Whole:
    """The document a case puts in place of the manifest's."""

    def __init__(self, doc: Any) -> None:
        self.doc = doc


_PAST = "past the .* bytes of its allocation"
_OUTSIDE = "holds a value outside"
_INTS = "must hold ints only"
_HUGE = "more bytes than any memory holds"

DOC_CASES = [
    # offsets
    pytest.param(_set("offset", 0, 1024), _PAST, id="offset-at-the-end"),
    pytest.param(_set("offset", 0, 1024 - 255), _PAST, id="tensor-overhangs-by-one-byte"),
    pytest.param(_set("offset", 0, -1), _OUTSIDE, id="negative-offset"),
    pytest.param(_set("offset", 0, True), _INTS, id="bool-offset"),
    pytest.param(_set("offset", 0, 1 << 64), _OUTSIDE, id="huge-offset"),
    pytest.param(_set("offset", 0, "0"), _INTS, id="str-offset"),
    # allocations
    pytest.param(_set("parts", (0, 1), 255), _PAST, id="allocation-shrunk-under-its-tensor"),
    pytest.param(_set("parts", (0, 1), 0), "size 0 is not a positive int", id="empty-allocation"),
    pytest.param(_set("parts", (0, 1), -1024), "is not a positive int", id="negative-allocation"),
    pytest.param(_set("parts", (0, 1), True), "is not a positive int", id="bool-allocation-size"),
    pytest.param(_set("parts", (0, 1), MAX + 1), "is not a positive int", id="huge-allocation"),
    pytest.param(_set("parts", (0, 0), -2), "is not -1 .host. or an ordinal", id="device-minus-two"),
    pytest.param(_set("parts", (0, 0), 1 << 16), "is not -1 .host. or an ordinal", id="device-past-ordinals"),
    pytest.param(_set("parts", (0, 0), False), "is not -1 .host. or an ordinal", id="bool-device"),
    pytest.param(_set("parts", (0, 0), "host"), "is not -1 .host. or an ordinal", id="str-device"),
    pytest.param(_set("parts", (0, 2), 0), "name no known path", id="offers-nothing"),
    pytest.param(_set("parts", (0, 2), 1 << len(path_names())), "name no known path", id="offers-unknown-path"),
    pytest.param(_set("parts", (0, 2), True), "name no known path", id="bool-offers"),
    pytest.param(_set("parts", (0, 3), 2), "readonly must be 0 or 1", id="readonly-two"),
    pytest.param(_set("parts", (0, 3), True), "readonly must be 0 or 1", id="bool-readonly"),
    pytest.param(_set("parts", (0, 4), ""), "fabric must be a short string", id="empty-fabric"),
    pytest.param(_set("parts", (0, 4), "x" * 257), "fabric must be a short string", id="long-fabric"),
    pytest.param(_set("parts", 0, [-1, 1024, 81, 0]), "is not a .device, nbytes", id="allocation-of-four-fields"),
    pytest.param(lambda d: d.update(parts=[]), "lists 1 to 65536 allocations", id="no-allocations"),
    pytest.param(_set("part", 0, 3), _OUTSIDE, id="part-index-past-the-allocations"),
    pytest.param(_set("part", 0, -1), _OUTSIDE, id="negative-part-index"),
    pytest.param(_set("part", 0, True), _INTS, id="bool-part-index"),
    # dtypes
    *(pytest.param(_set("dtypes", (0, 0), t), "is not an array-interface type string", id=f"typestr-{t!r}")
      for t in ("i4", "<i", "<x4", "<i0", "<i12345", "|u1\n", "<i\u0664", "<I4", 4, None)),
    pytest.param(_set("dtypes", (0, 1), "int 32!"), "is not a dtype name", id="bad-dtype-name"),
    pytest.param(_set("dtypes", (0, 1), "x" * 65), "is not a dtype name", id="long-dtype-name"),
    pytest.param(_set("dtypes", 0, ["<i4", None]), r"is not a \[typestr, name, dlpack\] list", id="dtype-of-two"),
    pytest.param(lambda d: d.update(dtypes=[]), "lists 1 to 4096 dtypes", id="no-dtypes"),
    *(pytest.param(lambda d, e=e: _retype(d, 0, e), "DLPack dtype .* does not fit", id=f"dlpack-{e[0]}-{e[2]}")
      for e in (["<i4", None, [0, 32, 1]], ["|V4", None, [4, 16, 1]], ["|V4", None, [256, 16, 2]],
                ["|V4", None, [4, 0, 1]], ["|V4", None, [4, 32, 0]], ["|V4", None, [4, 16, True]],
                ["|V4", None, [4, 32]], ["|V4", None, "bfloat16"])),
    pytest.param(_set("dtype", 0, 3), _OUTSIDE, id="dtype-index-past-the-dtypes"),
    pytest.param(_set("dtype", 0, True), _INTS, id="bool-dtype-index"),
    # shapes
    pytest.param(lambda d: _reshape(d, 0, [1 << 32, 1 << 32]), _HUGE, id="elements-overflow"),
    pytest.param(lambda d: _reshape(d, 0, [1 << 40] * 32), _HUGE, id="elements-overflow-a-float"),
    pytest.param(lambda d: (_reshape(d, 0, [1 << 55]), _retype(d, 0, ["|V512", None, None])), _HUGE,
                 id="bytes-wrap-to-zero"),
    pytest.param(lambda d: (_reshape(d, 0, [1 << 50]), _retype(d, 0, ["|V9999", None, None])), _HUGE,
                 id="bytes-wrap-negative"),
    pytest.param(lambda d: _reshape(d, 0, [32, 9]), _PAST, id="shape-past-the-allocation"),
    pytest.param(lambda d: _reshape(d, 0, [8, -8]), _OUTSIDE, id="negative-dim"),
    pytest.param(lambda d: _reshape(d, 0, [8, True]), _INTS, id="bool-dim"),
    pytest.param(lambda d: _reshape(d, 0, [1] * 33), _OUTSIDE, id="33-dims"),
    pytest.param(_set("ndim", 0, -1), _OUTSIDE, id="negative-ndim"),
    # strides (leaf 2: float64, 8 elements every 48 bytes, at offset 16 of 384)
    pytest.param(_set("strides", 0, 12), r"stride \(12,\) is not a whole number of 8-byte items", id="stride-of-12"),
    pytest.param(_set("strides", 0, 56), _PAST, id="strided-span-past-the-end"),
    pytest.param(lambda d: (_reshape(d, 2, [1 << 40]), d.update(strides=[1 << 50])), "spans more bytes than any",
                 id="strided-span-overflows"),
    pytest.param(_set("strides", 0, -48), _OUTSIDE, id="negative-stride"),
    pytest.param(_set("strides", 0, True), _INTS, id="bool-stride"),
    pytest.param(lambda d: d.update(strides=[48, 48]), "strides column must list 1 ints", id="a-stride-too-many"),
    pytest.param(lambda d: d.update(strided=[6]), _OUTSIDE, id="strided-leaf-past-the-count"),
    pytest.param(lambda d: d.update(strided=[2, 2], strides=[48, 48]), "listed once each, in order",
                 id="strided-leaf-twice"),
    pytest.param(lambda d: d.update(strided=[2, 0], strides=[48, 4, 4]), "listed once each, in order",
                 id="strided-leaves-out-of-order"),
    # columns that disagree
    pytest.param(lambda d: d["offset"].pop(), "offset column must list 6 ints", id="offset-column-short"),
    pytest.param(lambda d: d["dtype"].append(0), "dtype column must list 6 ints", id="dtype-column-long"),
    pytest.param(lambda d: d["ndim"].pop(), "ndim column must list 6 ints", id="ndim-column-short"),
    pytest.param(lambda d: d["dims"].append(1), "dims column must list 7 ints", id="dims-column-long"),
    pytest.param(_set("ndim", 1, 2), "dims column must list 8 ints", id="ndim-says-one-dim-more"),
    pytest.param(lambda d: d.update(part=[0] * ((1 << 20) + 1)), "at most 1048576", id="past-the-most-tensors"),
    pytest.param(lambda d: d.update(offset={"0": 0}), "offset column must list", id="column-an-object"),
    # the tree
    pytest.param(_set("tree", 2, 5), "names tensor 5 twice", id="leaf-twice"),
    pytest.param(_set("tree", 2, 6), "names tensor 6 twice or past the 6", id="leaf-past-the-count"),
    pytest.param(_set("tree", 2, -1), "names tensor -1", id="negative-leaf"),
    pytest.param(_set("tree", 2, True), "neither a tensor nor", id="bool-leaf"),
    pytest.param(lambda d: d.update(tree=d["tree"][:3] + d["tree"][5:]), "leaves out tensor 1", id="leaf-missing"),
    pytest.param(_nest(62), "nests deeper than 64", id="tree-65-deep"),
    pytest.param(_set("tree", 3, "w"), "not a unique str .* 'w'", id="duplicate-dict-key"),
    pytest.param(_set("tree", 3, 7), "not a unique str", id="int-dict-key"),
    pytest.param(_set("tree", 3, "k" * 1025), "not a unique str", id="long-dict-key"),
    pytest.param(lambda d: d["tree"].pop(), "has a key without a value", id="key-without-value"),
    *(pytest.param(_set("tree", (8, 0), kind), "neither a tensor nor", id=f"node-kind-{kind!r}")
      for kind in ("x", ["t"], {"t": 1}, None, 0)),
    pytest.param(_set("tree", 8, []), "neither a tensor nor", id="empty-node"),
    pytest.param(_set("tree", 8, {"t": [3, 4]}), "neither a tensor nor", id="node-an-object"),
    pytest.param(lambda d: d.update(tree=0), "not one tensor", id="tree-a-lone-tensor"),
    # the document
    pytest.param(lambda d: d.update(extra=1), "has the wrong fields", id="extra-field"),
    pytest.param(lambda d: d.pop("strides"), "has the wrong fields", id="missing-field"),
    pytest.param(lambda d: d.update(v=2), "format 2", id="format-2"),
    pytest.param(lambda d: d.update(v=True), "format True", id="bool-format"),
    pytest.param(lambda d: _Whole([d]), "has the wrong fields", id="a-list"),
]


@pytest.mark.parametrize(("change", "match"), DOC_CASES)
def test_a_forged_manifest_is_refused_however_it_arrives(genuine, change, match):
    share, doc = genuine
    d = copy.deepcopy(doc)
    replaced = change(d)
    _refused_everywhere(share, _blob(replaced.doc if isinstance(replaced, _Whole) else d), match)


@pytest.mark.parametrize("change", [
    pytest.param(_set("offset", 0, 1024 - 256), id="last-tensor-ends-at-its-allocations-end"),
    pytest.param(_nest(61), id="tree-64-deep"),
    pytest.param(lambda d: _retype(d, 0, ["|V4", "bfloat16x2", [4, 16, 2]]), id="dlpack-dtype-that-fits"),
    pytest.param(lambda d: (_reshape(d, 0, [0, MAX]), d["offset"].__setitem__(0, 1024)), id="empty-tensor-at-the-end"),
    pytest.param(lambda d: _reshape(d, 0, [MAX] * 20 + [0]), id="empty-tensor-whose-other-dims-overflow"),
    pytest.param(lambda d: (_reshape(d, 2, [1]), d.update(strides=[MAX])), id="one-element-with-the-largest-stride"),
    pytest.param(lambda d: (_reshape(d, 2, [5]), d.update(strides=[0])), id="stride-0"),
])
def test_the_same_fields_at_the_limits_are_accepted(genuine, change):
    """Each refusal above is of its own fault: at the edge it is accepted."""
    share, doc = genuine
    d = copy.deepcopy(doc)
    change(d)
    for built in (_via_pickle(share, manifest=_blob(d)), _via_bytes(share, manifest=_blob(d))):
        assert type(built) is gs.BundleShare
        _check_fits(built._bundle)


RAW_CASES = [
    pytest.param(lambda t: t.replace('"offset":[0,', '"offset":[' + "9" * 5000 + ","), id="5000-digit-int"),
    pytest.param(lambda t: t.replace('"offset":[0,', '"offset":[0.0,'), id="float"),
    pytest.param(lambda t: t.replace('"offset":[0,', '"offset":[NaN,'), id="nan"),
    pytest.param(lambda t: t.replace('"v":1,', '"v":1,"v":1,'), id="duplicate-key"),
    pytest.param(lambda t: t.replace('"w"', '"\u00e9"'), id="not-ascii"),
    pytest.param(lambda t: t.replace('"tree":', '"tree":' + "[" * 100_000)[:-1] + "]" * 100_000 + "}",
                 id="tree-in-100000-brackets"),
    pytest.param(lambda t: t[:-1], id="cut-json"),
]


@pytest.mark.parametrize("change", RAW_CASES)
def test_manifest_text_that_is_not_strict_json_is_refused(genuine, change):
    share, doc = genuine
    text = change(json.dumps(doc, separators=(",", ":")))
    _refused_everywhere(share, zlib.compress(text.encode("utf-8")), "are not ASCII JSON")


def _bomb(mib: int) -> bytes:
    """A complete zlib stream, about a kilobyte a MiB, that inflates to
    ``mib`` MiB of JSON's white space: each MiB compressed once, on its own
    (a full flush forgets what came before), and repeated."""
    chunk = b" " * (1 << 20)
    z = zlib.compressobj(9)
    first = z.compress(chunk) + z.flush(zlib.Z_FULL_FLUSH)  # with the stream's header
    again = z.compress(chunk) + z.flush(zlib.Z_FULL_FLUSH)
    end = z.flush()[:-4]  # the last, empty block, without the checksum of what z saw
    checksum = 1
    for _ in range(mib):
        checksum = zlib.adler32(chunk, checksum)
    return first + again * (mib - 1) + end + checksum.to_bytes(4, "big")


def test_the_bomb_is_a_whole_zlib_stream():
    assert zlib.decompress(_bomb(3)) == b" " * (3 << 20)


def _refusal_peak(blob: bytes) -> int:
    """The most memory decode took to refuse ``blob`` for inflating past the limit."""
    tracemalloc.start()
    try:
        with pytest.raises(gs.InvalidInputError, match=f"inflates past {_manifest.MAX_DECODED_BYTES} bytes"):
            _manifest.decode(blob)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_zlib_bomb_is_refused_with_no_more_memory_than_the_limit(genuine):
    """Inflating stops at the limit: what it costs is the limit's bytes
    (twice: zlib joins its output blocks), whatever the bomb's size."""
    share, _ = genuine
    bomb = _bomb((_manifest.MAX_DECODED_BYTES >> 20) + 1)
    big = _bomb(1024)  # 1 GiB
    assert len(bomb) < 100_000 and len(big) < 1_100_000
    for blob in (bomb, big):
        peak = _refusal_peak(blob)
        assert peak < 2 * _manifest.MAX_DECODED_BYTES + (4 << 20), peak
    _refused_everywhere(share, bomb, "inflates past")


@pytest.mark.parametrize(("change", "match"), [
    pytest.param(lambda b: b[:-4], "cut short", id="no-checksum"),
    pytest.param(lambda b: b[:len(b) // 2], "cut short", id="half"),
    pytest.param(lambda b: b[:1], "cut short", id="one-byte"),
    pytest.param(lambda b: b"", "cut short", id="empty"),
    pytest.param(lambda b: b + b"\0", "followed by other bytes", id="a-trailing-byte"),
    pytest.param(lambda b: b + b, "followed by other bytes", id="twice"),
    pytest.param(lambda b: zlib.decompress(b), "not zlib data", id="not-compressed"),
    pytest.param(lambda b: bytes([b[0] ^ 1]) + b[1:], "not zlib data", id="bad-header"),
    pytest.param(lambda b: b[:-1] + bytes([b[-1] ^ 1]), "not zlib data", id="bad-checksum"),
    pytest.param(lambda b: bytes(_manifest.MAX_MANIFEST_BYTES + 1), "at most 16777216", id="over-16-mib"),
])
def test_a_damaged_blob_is_refused(genuine, change, match):
    share, doc = genuine
    _refused_everywhere(share, change(_blob(doc)), match)


@pytest.mark.parametrize("value", ["eJw=", bytearray(b"x"), 5, ["eJw="]], ids=["str", "bytearray", "int", "list"])
def test_a_manifest_that_is_not_bytes_is_refused(genuine, value):
    share, _ = genuine
    for build in (_manifest.decode, lambda v: _via_pickle(share, manifest=v)):
        with pytest.raises(gs.InvalidInputError, match="manifest is bytes, not"):
            build(value)


@pytest.mark.parametrize("text", ["not base64!", "eJw", 5, ["eJw="], "\u00e9"])
def test_a_manifest_that_is_not_base64_text_is_refused(genuine, text):
    share, _ = genuine
    with pytest.raises(gs.InvalidInputError, match="manifest must be base64 text"):
        _via_bytes(share, manifest=text)


# ------------------------------------------------------------------ the share's own fields


@pytest.mark.parametrize("changes", [
    pytest.param({"nbytes": 1419, "shape": (1419,)}, id="nbytes-one-more"),
    pytest.param({"nbytes": 1024, "shape": (1024,)}, id="nbytes-of-the-first-allocation"),
    pytest.param({"device": 0}, id="cuda-device"),
    pytest.param({"offers": ("host-fd", "cma", "ucx-rma")}, id="offers-one-fewer"),
    pytest.param({"offers": ("same-process", "host-fd", "cma")}, id="offers-without-ucx-rma"),
    pytest.param({"offers": ("same-process", "cma", "host-fd", "ucx-rma")}, id="offers-out-of-order"),
    pytest.param({"offers": ("same-process", "host-fd", "cma", "ucx-rma", "posix-fd")}, id="offers-one-more"),
    pytest.param({"readonly": True}, id="read-only-over-writable-allocations"),
    pytest.param({"shape": (1, 1418)}, id="shape-2d"),
    pytest.param({"typestr": "|i1"}, id="typestr-i1"),
    pytest.param({"offset": 8}, id="offset"),
    pytest.param({"dtype_name": "bytes"}, id="dtype-name"),
    pytest.param({"strides": (1,)}, id="strides"),
])
def test_share_fields_that_disagree_with_the_manifest_are_refused(genuine, changes):
    share, _ = genuine
    assert (share.nbytes, share.device, share.offers) == (1418, "host", ("same-process", "host-fd", "cma", "ucx-rma"))
    for build in (_via_pickle, _via_bytes):
        with pytest.raises(gs.InvalidInputError, match="share fields do not describe its manifest"):
            build(share, **changes)


# ------------------------------------------------------------------ random forgeries


def _check_fits(m: _manifest.Manifest) -> None:
    """What an accepted manifest says holds, in Python ints: each tensor lies
    inside its allocation, its span is what its shape, strides and item size
    make it, and the tree names each tensor once."""
    assert 1 <= len(m.parts) and all(1 <= p.nbytes <= MAX for p in m.parts)
    for i in range(m.count):
        leaf = m.leaf(i)
        size = int(leaf.typestr[2:])
        n = math.prod(leaf.shape)
        if leaf.strides is None:
            span = n * size
        else:
            assert len(leaf.strides) == len(leaf.shape) and all(s >= 0 and s % size == 0 for s in leaf.strides)
            span = 0 if n == 0 else size + sum((d - 1) * s for d, s in zip(leaf.shape, leaf.strides, strict=True))
        assert leaf.nbytes == span and n * size <= MAX, (i, leaf)
        assert 0 <= leaf.part < len(m.parts) and 0 <= leaf.offset and leaf.offset + span <= m.parts[leaf.part].nbytes
        if leaf.dlpack_dtype is not None:
            assert leaf.dlpack_dtype[1] * leaf.dlpack_dtype[2] == 8 * size and leaf.typestr[1] == "V"
    named: list[int] = []

    def walk(node: Any, depth: int) -> None:
        if isinstance(node, int):
            named.append(node)
            return
        assert depth < _manifest.MAX_DEPTH
        kind, items = node
        assert kind in "dlt"
        if kind == "d":
            keys = [k for k, _ in items]
            assert all(isinstance(k, str) for k in keys) and len(set(keys)) == len(keys)
            items = [v for _, v in items]
        for sub in items:
            walk(sub, depth + 1)

    assert not isinstance(m.tree, int)
    walk(m.tree, 0)
    assert sorted(named) == list(range(m.count))


def _nodes(node: Any, at: tuple = ()) -> list[tuple]:
    """Where each value of the JSON document sits (the root left out)."""
    out = [at] if at else []
    if isinstance(node, list):
        for i, sub in enumerate(node):
            out += _nodes(sub, at + (i,))
    elif isinstance(node, dict):
        for key, sub in node.items():
            out += _nodes(sub, at + (key,))
    return out


_EDGES = st.sampled_from([0, 1, -1, 2, 5, 6, 31, 32, 33, 63, 64, 65, 255, 256, 1023, 1024, 1 << 16, 1 << 20,
                          MAX - 1, MAX, MAX + 1, 1 << 63, 1 << 64, -(1 << 63)])
_WORDS = st.sampled_from(["d", "l", "t", "w", "b", "<i4", "|V2", "|V9999", "<f8", "bfloat16", "host", ""])
_VALUES = st.recursive(
    st.none() | st.booleans() | _EDGES | st.integers(-(1 << 70), 1 << 70) | _WORDS | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_WORDS, inner, max_size=3),
    max_leaves=10,
)


def _outcome(build: Any, blob: bytes) -> Any:
    """What ``build(blob)`` gave: a manifest that fits, or the refusal's text."""
    try:
        made = build(blob)
    except gs.InvalidInputError as exc:
        return str(exc)
    bundle = made if isinstance(made, _manifest.Manifest) else made._bundle
    _check_fits(bundle)
    if not isinstance(made, _manifest.Manifest):
        assert pickle.loads(pickle.dumps(made)) == made and Share.from_bytes(made.to_bytes()) == made
    return bundle


def _judged_alike(share: Share, blob: bytes) -> None:
    """``blob`` as a manifest: refused, or one that fits; and a share of it
    refused in the same words, or for fields that describe other memory."""
    decoded = _outcome(_manifest.decode, blob)
    for build in (lambda b: _via_pickle(share, manifest=b), lambda b: _via_bytes(share, manifest=b)):
        got = _outcome(build, blob)
        if isinstance(decoded, str):  # the share is refused for the manifest's fault, in the same words
            assert got == decoded
        elif isinstance(got, str):  # a manifest that fits, of other memory than the share's fields say
            assert "share fields do not describe its manifest" in got


@FUZZ
@given(st.data(), st.lists(st.tuples(st.sampled_from(["replace", "replace", "replace", "drop", "copy"]), _VALUES),
                           min_size=1, max_size=3))
def test_any_value_of_the_manifest_replaced_is_refused_or_fits(genuine, data, changes):
    share, doc = genuine
    d = copy.deepcopy(doc)
    for how, value in changes:
        at = data.draw(st.sampled_from(_nodes(d)))
        parent = d
        for key in at[:-1]:
            parent = parent[key]
        if how == "replace" or isinstance(parent, dict):
            parent[at[-1]] = value
        elif how == "drop":
            del parent[at[-1]]
        else:
            parent.insert(at[-1], copy.deepcopy(parent[at[-1]]))
    _judged_alike(share, _blob(d))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), min_size=1, max_size=4),
       st.sampled_from([None, "cut", "extend"]), st.binary(max_size=8))
def test_any_bytes_of_the_blob_flipped_are_refused_or_fit(genuine, flips, tail, extra):
    share, _ = genuine
    blob = bytearray(share._fields_[-1])
    for at, xor in flips:
        blob[at % len(blob)] ^= xor
    if tail == "cut":
        del blob[len(blob) - 1 - len(extra) % len(blob):]
    elif tail == "extend":
        blob += extra
    _judged_alike(share, bytes(blob))


_DIMS = st.sampled_from([0, 1, 2, 3, 7, 1 << 20, 1 << 28, 1 << 40, MAX - 1, MAX, MAX + 1])
_SIZES = st.sampled_from([1, 2, 3, 8, 256, 512, 9999])


@FUZZ
@given(st.lists(_DIMS, max_size=4), _SIZES, st.one_of(st.none(), st.lists(
    st.sampled_from([0, 1, 3, 8, 512, 9999, 1 << 20, 1 << 50, MAX - 8, MAX]), min_size=4, max_size=4)),
    st.sampled_from([1, 8, 4096, 1 << 40, MAX]), st.sampled_from([0, 1, 8, 4096, 1 << 40, MAX, MAX + 1]),
    st.booleans())
def test_extreme_shapes_and_strides_are_accepted_exactly_when_the_tensor_fits(shape, size, strides, nbytes, offset,
                                                                             multiples):
    """A manifest of one tensor, judged by decode and in Python ints: the
    same answer, whatever the products would do in int64."""
    if strides is not None:
        strides = [s * size if multiples else s for s in strides][:len(shape)]
    blob = _manifest.encode([_manifest.Part("host", nbytes, ("host-fd",), False, None)],
                            [_manifest.Leaf(0, offset, 0, tuple(shape), f"|V{size}", None, None,
                                            None if strides is None else tuple(strides))], ("l", [0]))
    n = math.prod(shape)
    fits = offset <= MAX and all(v <= MAX for v in shape + (strides or [])) and n * size <= MAX
    span = n * size
    if fits and strides is not None:
        span = 0 if n == 0 else size + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
        fits = all(s % size == 0 for s in strides) and span <= MAX
    fits = fits and offset + span <= nbytes
    try:
        m = _manifest.decode(blob)
    except gs.InvalidInputError:
        assert not fits, (shape, size, strides, nbytes, offset)
        return
    assert fits, (shape, size, strides, nbytes, offset)
    assert m.leaf(0).nbytes == span
    _check_fits(m)


# ------------------------------------------------------------------ forged and valid: the exporter refuses


@pytest.fixture(scope="module")
def peer():
    import _fuzz_bundle_peer

    child = Child(_fuzz_bundle_peer.setup)
    yield child
    child.close()


def _export_three():
    """A bundle of gpushare memory (host-fd) and a NumPy array (cma), and
    what its tensors hold."""
    pool = gs.empty(128, "int32")
    pool[:] = np.arange(128, dtype=np.int32)
    other = np.arange(10, dtype=np.float64)
    tree = {"w": pool[:64].reshape(8, 8), "b": pool[64:], "o": other}
    return tree, {"w": np.arange(64).reshape(8, 8).tolist(), "b": list(range(64, 128)), "o": other.tolist()}


def _remanifest(share: Share, change: Any, **fields: Any) -> Share:
    """``share`` with its manifest re-encoded after ``change`` (same id and
    token): a share as valid as the genuine one, but for other tensors."""
    doc = json.loads(zlib.decompress(share._fields_[-1]))
    blob = change(doc)
    forged = Share._make(*_fields(share, manifest=blob if isinstance(blob, bytes) else _blob(doc), **fields))
    assert type(forged) is gs.BundleShare and forged.share_id == share.share_id and forged.token == share.token
    return forged


def _readonly(doc: dict) -> None:
    for part in doc["parts"]:
        part[3] = 1


VALID_FORGERIES = {
    "offset": lambda d: d["offset"].__setitem__(1, d["offset"][1] - 4),  # "b" starts a tensor earlier
    "dtype": lambda d: _retype(d, 0, ["<f4", None, None]),  # "w" read as float32
    "shape": lambda d: _reshape(d, 0, [4, 16]),
    "key": lambda d: d["tree"].__setitem__(1, "W"),
    "recompressed": lambda d: zlib.compress(zlib.decompress(_blob(d)), 9),  # the same JSON, other bytes
}


def test_a_valid_forged_manifest_is_refused_by_the_exporter_before_anything_is_granted(peer):
    tree, values = _export_three()
    share = gs.export(tree, lifetime=1)  # one import: a forged open that counted would use it up
    try:
        forged = {name: _remanifest(share, change) for name, change in VALID_FORGERIES.items()}
        forged["read-only"] = _remanifest(share, _readonly, readonly=True)
        forged["stripped"] = Share._make(*_fields(share, manifest=None))  # a share of one buffer of its bytes
        assert type(forged["stripped"]) is Share and forged["stripped"].nbytes == share.nbytes
        exporter_leases = get_exporter().stats()["leases"]
        for name, bad in forged.items():
            for kwargs in ({}, {"exclude": ["host-fd", "cma"]}):
                got = peer.call("attempt", bad, kwargs)  # pickled over: rebuilt and validated in the child
                assert not got["opened"], (name, got)
                assert got["type"] == "InvalidInputError", (name, got)
                assert "the share was altered (forged or corrupt)" in got["message"], (name, got)
                assert "failed" not in got["message"], (name, got)  # refused at once: no path was tried
                assert got["after"] == got["before"] and got["before"]["leases"] == 0, (name, got)
                assert get_exporter().stats()["leases"] == exporter_leases, name
            if name != "stripped":
                with pytest.raises(gs.InvalidInputError, match="the share was altered"):
                    gs.open(bad)  # in the exporting process, likewise
        # the exporter was not disturbed: the genuine share opens, once, with its own tensors
        got = peer.call("open_all", share)
        assert got["values"] == values and got["paths"] == ("host-fd", "cma")
        assert got["maps"] == 1 and got["leases"] == 1 and got["leases_after"] == 0
        with pytest.raises(gs.ClosedError, match="lifetime=1 allows 1 import"):
            peer.call("open_all", share)
    finally:
        share.revoke()


def test_without_the_digest_check_the_forged_manifest_would_open(peer, monkeypatch):
    """The forgery above is refused for its digest alone: with the check
    taken out of the exporter, the child maps it and reads other bytes."""
    tree, values = _export_three()
    share = gs.export(tree, lifetime="revoked")
    try:
        forged = _remanifest(share, VALID_FORGERIES["offset"])
        monkeypatch.setattr(_exporter.sessions, "_bundle_request", lambda msg, export: (",".join(msg["parts"]), None))
        got = peer.call("attempt", forged)
        assert got["opened"], got
        assert got["values"]["b"] == [63] + values["b"][:-1]  # "b" read one int32 early
        assert got["after"] == got["before"]  # closed again
    finally:
        monkeypatch.undo()
        share.revoke()
