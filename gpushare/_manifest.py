"""A bundle's manifest: what one share of many tensors says of them.

A bundle (:func:`gpushare.export` of a dict, list or tuple) is one share of
*parts*, each one allocation offered on its own paths, and *leaves*, each a
tensor at an offset of one part with its own dtype, shape and strides, and
the *tree* that names them.  The manifest is that, as compressed JSON of
columns, a few bytes a tensor; the share carries it as bytes.

Read from another process it is untrusted: :func:`decode` checks every
count, index, offset, dtype, shape and stride (with NumPy, a whole column at
a time) and that each leaf lies inside its part, before anything is mapped.
"""

from __future__ import annotations

import functools

import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._errors import InvalidInputError
from ._types import path_names, strict_json

__all__ = ["Manifest", "Part", "Leaf", "Columns", "encode", "decode", "MAX_TENSORS", "MAX_PARTS", "MAX_MANIFEST_BYTES"]

MANIFEST_FORMAT = 1
#: The most tensors one bundle holds.
MAX_TENSORS = 1 << 20
#: The most allocations (parts) one bundle holds.
MAX_PARTS = 1 << 16
#: The most bytes a manifest is, compressed and decompressed.
MAX_MANIFEST_BYTES = 16 << 20
MAX_DECODED_BYTES = 64 << 20
#: The deepest a tree nests.
MAX_DEPTH = 64
_MAX_DIMS = 32
_MAX_NBYTES = 1 << 56
_MAX_KEY = 1024
_TYPESTR = re.compile(r"[<>|=][biufcV][0-9]{1,4}\Z", re.ASCII)
_DTYPE_NAME = re.compile(r"^[A-Za-z0-9_\[\]<>|=,. ]{1,64}\Z")
_KINDS = {"d": dict, "l": list, "t": tuple}


@dataclass(frozen=True)
class Part:
    """One allocation of a bundle: where it lives, its size, its paths."""

    device: int | str  # "host" or a CUDA ordinal
    nbytes: int
    offers: tuple[str, ...]
    readonly: bool
    fabric: str | None


class Leaf(NamedTuple):
    """One tensor: its part, its offset there, what its elements are."""

    part: int
    offset: int
    nbytes: int  # the bytes it spans in its part
    shape: tuple[int, ...]
    typestr: str
    dtype_name: str | None
    dlpack_dtype: tuple[int, int, int] | None
    strides: tuple[int, ...] | None


class Manifest:
    """A validated manifest: its parts, its leaves (made on demand), its tree."""

    __slots__ = ("parts", "tree", "digest", "arrays", "spans", "dims_at", "_columns", "_dtypes", "_dims_at",
                 "_strides", "_spans", "count", "_runs", "_names")

    def __init__(self, parts: tuple[Part, ...], tree: Any, digest: bytes, columns: tuple[np.ndarray, ...],
                 dtypes: list[tuple[str, str | None, tuple[int, int, int] | None]], dims_at: np.ndarray,
                 strides: dict[int, tuple[int, ...]], spans: np.ndarray) -> None:
        self.parts = parts
        self.tree = tree
        self.digest = digest
        #: the columns (part, offset, dtype, ndim, dims) as int64 arrays, for work on many leaves at once
        self.arrays = columns
        self.spans = spans
        self.dims_at = dims_at
        # Python lists: a leaf is read an element at a time
        self._columns = tuple(c.tolist() for c in columns)
        self._dtypes = dtypes
        self._dims_at = dims_at.tolist()
        self._strides = strides
        self._spans = spans.tolist()
        self.count = len(self._spans)
        self._runs: dict[int, Any] = {}  # id of a node of the tree -> run_of(node)
        self._names: dict[int, dict[Any, Any]] = {}  # id of a dict node of the tree -> named(node)

    def run_of(self, node: Any) -> tuple[list[str] | None, int] | None:
        """For a node of the tree (a dict, list or tuple) whose items are all
        tensors, numbered one after another: (its keys, or None for a list
        or tuple; the first tensor's number).  None for any other node."""
        key = id(node)
        found = self._runs.get(key, 0)
        if found == 0:
            found = self._runs[key] = _run(node)
        return found

    def named(self, node: Any) -> dict[Any, Any]:
        """A dict node's items by key, the first of a key that comes twice (made once per
        node: looking each key of a state dict up costs O(1), not a pass over its keys)."""
        key = id(node)
        found = self._names.get(key)
        if found is None:
            found = {}
            for name, child in node[1]:
                found.setdefault(name, child)
            self._names[key] = found
        return found

    def strided(self) -> dict[int, tuple[int, ...]]:
        """The strided leaves' strides, by leaf."""
        return self._strides

    def leaf(self, i: int) -> Leaf:
        part, offset, dtype, ndim, dims = self._columns
        at = self._dims_at[i]
        typestr, name, dl = self._dtypes[dtype[i]]
        return Leaf(part[i], offset[i], self._spans[i], tuple(dims[at:at + ndim[i]]), typestr, name, dl,
                    self._strides.get(i))

    def rows(self, indices: list[int]) -> list[tuple]:
        """:meth:`leaf` of each of ``indices`` as a plain tuple (the same
        fields, in order), read in one pass: for views made by the thousand."""
        part, offset, dtype, ndim, dims = self._columns
        dims_at, spans, dtypes, strides = self._dims_at, self._spans, self._dtypes, self._strides
        out = []
        for i in indices:
            at = dims_at[i]
            out.append((part[i], offset[i], spans[i], tuple(dims[at:at + ndim[i]]), *dtypes[dtype[i]],
                        strides.get(i) if strides else None))
        return out

    def shape(self, i: int) -> tuple[int, ...]:
        """Leaf ``i``'s shape."""
        at = self._dims_at[i]
        return tuple(self._columns[4][at:at + self._columns[3][i]])

    def dtype_index(self, i: int) -> int:
        """Leaf ``i``'s dtype, as an index into :meth:`dtypes`."""
        return self._columns[2][i]

    def span_list(self) -> list[int]:
        """The bytes each leaf spans in its part, by leaf (a list, for reading many one at a time)."""
        return self._spans

    def alike(self, leaves: np.ndarray) -> np.ndarray:
        """For each two leaves one after the other in ``leaves``: whether
        they are of one dtype and one shape of 1 to 4 dimensions, neither
        strided (``len(leaves) - 1`` bools)."""
        n = len(leaves)
        if n < 2:
            return np.zeros(0, dtype=bool)
        _, _, dtype_col, ndim_col, dims_col = self.arrays
        ndim, dtype = ndim_col[leaves], dtype_col[leaves]
        same = (dtype[1:] == dtype[:-1]) & (ndim[1:] == ndim[:-1]) & (ndim[1:] > 0) & (ndim[1:] <= 4)
        if self._strides:
            plain = ~np.isin(leaves, np.fromiter(self._strides, dtype=np.int64))
            same &= plain[1:] & plain[:-1]
        if not len(dims_col):  # every leaf 0-d
            return np.zeros(n - 1, dtype=bool)
        first, last_dim = self.dims_at[leaves], len(dims_col) - 1
        for j in range(4):  # each of (at most 4) dimensions equal
            d = np.where(ndim > j, dims_col[np.minimum(first + j, last_dim)], -1)
            same &= d[1:] == d[:-1]
        return same

    def dtypes(self) -> list[tuple[str, str | None, tuple[int, int, int] | None]]:
        """The dtype table: (typestr, name, DLPack dtype) by index."""
        return self._dtypes

    def leaves_of(self, part: int) -> list[int]:
        """The leaves that lie in ``part``."""
        return np.flatnonzero(self.arrays[0] == part).tolist()


def _run(node: Any) -> tuple[list[str] | None, int] | None:
    kind, items = node
    if not items:
        return None
    keys, values = ([k for k, _ in items], [v for _, v in items]) if kind == "d" else (None, items)
    first = values[0]
    if type(first) is not int or values != list(range(first, first + len(values))):
        return None
    return keys, first


# ---------------------------------------------------------------- encoding


def encode(parts: list[Part], leaves: list[Leaf], tree: Any) -> bytes:
    """The manifest of ``parts`` and ``leaves`` named by ``tree``, compressed
    (see :func:`encode_made`)."""
    return encode_made(parts, leaves, tree)[0]


def encode_made(parts: list[Part], leaves: list[Leaf], tree: Any) -> tuple[bytes, Manifest]:
    """The manifest of ``parts`` and ``leaves`` named by ``tree`` (a nest of
    ``("d", [(key, node)...])``, ``("l", [...])``, ``("t", [...])`` and leaf
    indices), compressed; and as a :class:`Manifest` (this process made it:
    it is not decoded again)."""
    columns = Columns()
    for leaf in leaves:
        columns.add(leaf.part, leaf.offset, leaf.nbytes, leaf.shape,
                    columns.dtype_index(leaf.typestr, leaf.dtype_name, leaf.dlpack_dtype), leaf.strides)
    return columns.encode(parts, tree)


class Columns:
    """A manifest's columns, filled a tensor at a time (the export of a
    bundle appends to the lists itself); :meth:`encode` makes the manifest."""

    __slots__ = ("part", "offset", "dtype", "ndim", "dims", "spans", "strided", "strides", "_dtypes")

    def __init__(self) -> None:
        self.part: list[int] = []
        self.offset: list[int] = []
        self.dtype: list[int] = []  # indices into the dtype table
        self.ndim: list[int] = []
        self.dims: list[int] = []  # every leaf's shape, one after another
        self.spans: list[int] = []  # the bytes each leaf spans in its part
        self.strided: list[int] = []  # the leaves with strides, in order
        self.strides: list[int] = []  # their strides, one after another
        self._dtypes: dict[tuple, int] = {}

    def dtype_index(self, typestr: str, name: str | None = None, dlpack: tuple[int, int, int] | None = None) -> int:
        """The index of that dtype in the manifest's table (added on first use)."""
        return self._dtypes.setdefault((typestr, name, dlpack), len(self._dtypes))

    def add(self, part: int, offset: int, nbytes: int, shape: tuple[int, ...], dtype: int,
            strides: tuple[int, ...] | None = None) -> None:
        """One more leaf: ``nbytes`` spanned at ``offset`` of ``part``."""
        if strides is not None:
            self.strided.append(len(self.part))
            self.strides.extend(strides)
        self.part.append(part)
        self.offset.append(offset)
        self.spans.append(nbytes)
        self.dtype.append(dtype)
        self.ndim.append(len(shape))
        self.dims.extend(shape)

    def encode(self, parts: list[Part], tree: Any, tree_doc: Any = None) -> tuple[bytes, Manifest]:
        """The manifest of these leaves in ``parts``, named by ``tree``
        (``tree_doc``: the tree as it is written, where the caller has it),
        compressed; and as a :class:`Manifest`."""
        doc = {
            "v": MANIFEST_FORMAT,
            "parts": [[-1 if p.device == "host" else p.device, p.nbytes, _mask(p.offers), int(p.readonly), p.fabric]
                      for p in parts],
            "dtypes": [[t, n, list(d) if d is not None else None] for t, n, d in self._dtypes],
            "part": self.part, "offset": self.offset, "dtype": self.dtype, "ndim": self.ndim, "dims": self.dims,
            "strided": self.strided, "strides": self.strides,
            "tree": _tree_doc(tree) if tree_doc is None else tree_doc,
        }
        raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        if len(raw) > MAX_DECODED_BYTES:
            raise InvalidInputError(f"the bundle's manifest is {len(raw)} bytes; at most {MAX_DECODED_BYTES} "
                                    "(fewer tensors, or shorter names)")
        data = zlib.compress(raw, 1)
        count = len(self.part)
        ndim = np.array(self.ndim, dtype=np.int64)
        dims_at = np.zeros(count, dtype=np.int64)
        if count:
            np.cumsum(ndim[:-1], out=dims_at[1:])
        strides: dict[int, tuple[int, ...]] = {}
        at = 0
        for i in self.strided:
            n = self.ndim[i]
            strides[i] = tuple(self.strides[at:at + n])
            at += n
        made = Manifest(tuple(parts), tree, digest(data),
                        (np.array(self.part, dtype=np.int64), np.array(self.offset, dtype=np.int64),
                         np.array(self.dtype, dtype=np.int64), ndim, np.array(self.dims, dtype=np.int64)),
                        list(self._dtypes), dims_at, strides, np.array(self.spans, dtype=np.int64))
        return data, made


@functools.lru_cache(maxsize=256)
def _mask(offers: tuple[str, ...]) -> int:
    names = path_names()
    return sum(1 << names.index(p) for p in offers)


def _tree_doc(node: Any) -> Any:
    if isinstance(node, int):
        return node
    kind, items = node
    if kind == "d":
        out: list[Any] = ["d"]
        for key, sub in items:
            out.append(key)
            out.append(_tree_doc(sub))
        return out
    return [kind, *(_tree_doc(sub) for sub in items)]


# ---------------------------------------------------------------- decoding


def digest(data: bytes) -> bytes:
    """What the importer tells the exporter of the manifest it holds."""
    return hashlib.sha256(data).digest()


def decode(data: Any) -> Manifest:
    """The manifest in ``data`` (bytes from another process), validated."""
    if not isinstance(data, bytes):
        raise InvalidInputError(f"a bundle's manifest is bytes, not {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidInputError(f"a bundle's manifest is {len(data)} bytes; at most {MAX_MANIFEST_BYTES}")
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(data, MAX_DECODED_BYTES)
    except zlib.error:
        raise InvalidInputError("a bundle's manifest is not zlib data") from None
    if inflate.unconsumed_tail or not inflate.eof or inflate.unused_data:
        raise InvalidInputError(f"a bundle's manifest inflates past {MAX_DECODED_BYTES} bytes, or is cut short "
                                "or followed by other bytes")
    doc = strict_json(raw, MAX_DECODED_BYTES, "Share.from_bytes", "bundle manifest")
    if not isinstance(doc, dict) or set(doc) != {"v", "parts", "dtypes", "part", "offset", "dtype", "ndim",
                                                 "dims", "strided", "strides", "tree"}:
        raise InvalidInputError("a bundle's manifest has the wrong fields")
    if type(doc["v"]) is not int or doc["v"] != MANIFEST_FORMAT:
        raise InvalidInputError(f"bundle manifest format {doc['v']!r:.20}; this gpushare reads {MANIFEST_FORMAT}")
    parts = _parts(doc["parts"])
    dtypes = _dtypes(doc["dtypes"])
    count = _length(doc["part"], "part", MAX_TENSORS)
    part = _column(doc["part"], "part", count, 0, len(parts) - 1)
    offset = _column(doc["offset"], "offset", count, 0, _MAX_NBYTES)
    dtype = _column(doc["dtype"], "dtype", count, 0, len(dtypes) - 1)
    ndim = _column(doc["ndim"], "ndim", count, 0, _MAX_DIMS)
    total_dims = int(ndim.sum())
    dims = _column(doc["dims"], "dims", total_dims, 0, _MAX_NBYTES)
    dims_at = np.zeros(count, dtype=np.int64)
    if count:
        np.cumsum(ndim[:-1], out=dims_at[1:])
    itemsize = np.array([int(t[2:]) for t, _, _ in dtypes], dtype=np.int64)[dtype] if count else np.zeros(0, np.int64)
    elements = _elements(dims, ndim, dims_at, count, itemsize)
    spans = elements * itemsize  # contiguous leaves (no product overflows: checked); the strided ones are set below
    strided = doc["strided"]
    n_strided = _length(strided, "strided", count)
    which = _column(strided, "strided", n_strided, 0, count - 1 if count else 0)
    if n_strided and (np.any(np.diff(which) <= 0)):
        raise InvalidInputError("a bundle's strided leaves must be listed once each, in order")
    stride_dims = int(ndim[which].sum()) if n_strided else 0
    flat = _column(doc["strides"], "strides", stride_dims, 0, _MAX_NBYTES)
    strides: dict[int, tuple[int, ...]] = {}
    at = 0
    for i in which.tolist():
        n = int(ndim[i])
        st = tuple(int(s) for s in flat[at:at + n])
        at += n
        size = int(itemsize[i])
        if any(s % size for s in st):
            raise InvalidInputError(f"bundle tensor {i}: stride {st} is not a whole number of {size}-byte items")
        shape = dims[int(dims_at[i]):int(dims_at[i]) + n].tolist()
        span = 0 if int(elements[i]) == 0 else size + sum((d - 1) * s for d, s in zip(shape, st, strict=True))
        if span > _MAX_NBYTES:  # before it meets an int64
            raise InvalidInputError(f"bundle tensor {i}: shape {tuple(shape)} with strides {st} spans more bytes "
                                    "than any memory holds")
        spans[i] = span
        strides[i] = st
    if count:
        part_sizes = np.array([p.nbytes for p in parts], dtype=np.int64)
        past = offset + spans > part_sizes[part]
        if np.any(past):
            i = int(np.flatnonzero(past)[0])
            raise InvalidInputError(f"bundle tensor {i} spans {int(spans[i])} bytes at offset {int(offset[i])}, "
                                    f"past the {int(part_sizes[part[i]])} bytes of its allocation")
    seen = bytearray(count)
    if type(doc["tree"]) is int:
        raise InvalidInputError("a bundle's tree is a dict, list or tuple, not one tensor")
    tree = _tree(doc["tree"], seen, 0)
    if seen.count(0):
        raise InvalidInputError(f"the bundle's tree leaves out tensor {seen.index(0)}")
    return Manifest(parts, tree, digest(data), (part, offset, dtype, ndim, dims), dtypes, dims_at, strides, spans)


def _length(value: Any, what: str, most: int) -> int:
    if not isinstance(value, list):
        raise InvalidInputError(f"a bundle's {what} column is not a list")
    if len(value) > most:
        raise InvalidInputError(f"a bundle's {what} column has {len(value)} entries; at most {most}")
    return len(value)


def _column(value: Any, what: str, count: int, lo: int, hi: int) -> np.ndarray:
    """A column of ``count`` ints in [lo, hi], as int64."""
    if not isinstance(value, list) or len(value) != count:
        raise InvalidInputError(f"a bundle's {what} column must list {count} ints")
    if not set(map(type, value)) <= {int}:
        raise InvalidInputError(f"a bundle's {what} column must hold ints only")
    if not count:
        return np.zeros(0, dtype=np.int64)
    if min(value) < lo or max(value) > hi:
        raise InvalidInputError(f"a bundle's {what} column holds a value outside {lo} to {hi}")
    return np.array(value, dtype=np.int64)


def _elements(dims: np.ndarray, ndim: np.ndarray, dims_at: np.ndarray, count: int,
              itemsize: np.ndarray) -> np.ndarray:
    """Elements of each leaf, the product of its dims (refused where they,
    or their bytes, could not fit in memory, before any product overflows)."""
    if not count:
        return np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(count), ndim)
    rough = np.ones(count, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # inf where it overflows (nan: inf times a 0 dim)
        np.multiply.at(rough, owner, dims.astype(np.float64))
        big = rough * itemsize > float(_MAX_NBYTES)
    if np.any(big):
        i = int(np.flatnonzero(big)[0])
        raise InvalidInputError(f"bundle tensor {i}'s shape has more bytes than any memory holds")
    exact = np.ones(count, dtype=np.int64)
    np.multiply.at(exact, owner, dims)
    return exact


def _parts(value: Any) -> tuple[Part, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_PARTS:
        raise InvalidInputError(f"a bundle lists 1 to {MAX_PARTS} allocations")
    out = []
    names = path_names()
    for i, entry in enumerate(value):
        if not isinstance(entry, list) or len(entry) != 5:
            raise InvalidInputError(f"bundle allocation {i} is not a [device, nbytes, offers, readonly, fabric] list")
        device, nbytes, mask, readonly, fabric = entry
        if type(device) is not int or not -1 <= device < 1 << 16:
            raise InvalidInputError(f"bundle allocation {i}: device {device!r:.20} is not -1 (host) or an ordinal")
        if type(nbytes) is not int or not 1 <= nbytes <= _MAX_NBYTES:
            raise InvalidInputError(f"bundle allocation {i}: size {nbytes!r:.30} is not a positive int")
        if type(mask) is not int or not 1 <= mask < 1 << len(names):
            raise InvalidInputError(f"bundle allocation {i}: offers {mask!r:.20} name no known path")
        if readonly not in (0, 1) or type(readonly) is not int:
            raise InvalidInputError(f"bundle allocation {i}: readonly must be 0 or 1")
        if fabric is not None and (not isinstance(fabric, str) or not 0 < len(fabric) <= 256):
            raise InvalidInputError(f"bundle allocation {i}: fabric must be a short string or null")
        offers = tuple(p for b, p in enumerate(names) if mask >> b & 1)
        out.append(Part("host" if device == -1 else device, nbytes, offers, bool(readonly), fabric))
    return tuple(out)


def _dtypes(value: Any) -> list[tuple[str, str | None, tuple[int, int, int] | None]]:
    if not isinstance(value, list) or not 1 <= len(value) <= 4096:
        raise InvalidInputError("a bundle lists 1 to 4096 dtypes")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, list) or len(entry) != 3:
            raise InvalidInputError(f"bundle dtype {i} is not a [typestr, name, dlpack] list")
        typestr, name, dl = entry
        if not isinstance(typestr, str) or not _TYPESTR.match(typestr) or int(typestr[2:]) < 1:
            raise InvalidInputError(f"bundle dtype {i}: {typestr!r:.20} is not an array-interface type string")
        if name is not None and (not isinstance(name, str) or not _DTYPE_NAME.match(name)):
            raise InvalidInputError(f"bundle dtype {i}: {name!r:.40} is not a dtype name")
        if dl is not None:
            if (not isinstance(dl, list) or len(dl) != 3 or any(type(v) is not int for v in dl)
                    or not (0 <= dl[0] <= 255 and 1 <= dl[1] <= 255 and 1 <= dl[2] <= 65535)
                    or dl[1] * dl[2] != 8 * int(typestr[2:]) or typestr[1] != "V"):
                raise InvalidInputError(f"bundle dtype {i}: DLPack dtype {dl!r:.40} does not fit {typestr}")
            dl = tuple(dl)
        out.append((typestr, name, dl))
    return out


def _tree(node: Any, seen: bytearray, depth: int) -> Any:
    """The tree as ("d", [(key, node)]), ("l", [...]), ("t", [...]) and leaf
    indices, each leaf named once."""
    if type(node) is int:
        _leaf(node, seen)
        return node
    if depth >= MAX_DEPTH:
        raise InvalidInputError(f"the bundle's tree nests deeper than {MAX_DEPTH}")
    if not isinstance(node, list) or not node or not isinstance(node[0], str) or node[0] not in _KINDS:
        raise InvalidInputError("the bundle's tree holds something that is neither a tensor nor a dict, list or "
                                "tuple")
    kind = node[0]
    count = len(seen)
    if kind != "d":
        out = []
        for sub in node[1:]:
            if type(sub) is int and 0 <= sub < count and not seen[sub]:
                seen[sub] = 1
                out.append(sub)
            else:
                out.append(_tree(sub, seen, depth + 1))
        return (kind, out)
    if len(node) % 2 != 1:
        raise InvalidInputError("a dict in the bundle's tree has a key without a value")
    keys = node[1::2]
    if not set(map(type, keys)) <= {str} or len(set(keys)) != len(keys) or max(map(len, keys), default=0) > _MAX_KEY:
        bad = _bad_key(keys)
        raise InvalidInputError(f"a dict in the bundle's tree has a key that is not a unique str of at most "
                                f"{_MAX_KEY} characters: {bad!r:.40}")
    values = node[2::2]
    if len(values) > 64 and set(map(type, values)) == {int}:
        _leaves(values, seen)  # a dict of tensors: checked at once
        return ("d", list(zip(keys, values, strict=True)))
    items = []
    for key, sub in zip(keys, values, strict=True):
        if type(sub) is int and 0 <= sub < count and not seen[sub]:
            seen[sub] = 1
            items.append((key, sub))
        else:
            items.append((key, _tree(sub, seen, depth + 1)))
    return ("d", items)


def _leaves(indices: list[int], seen: bytearray) -> None:
    """Mark the leaves ``indices`` (ints) named, each once."""
    at = np.array(indices, dtype=np.int64) if 0 <= min(indices) and max(indices) < len(seen) else None
    marks = np.frombuffer(seen, dtype=np.uint8) if at is not None else None
    if at is None or marks is None or marks[at].any() or len(np.unique(at)) != len(at):
        for node in indices:  # which one, for the message
            _leaf(node, seen)
        return
    marks[at] = 1


def _bad_key(keys: list) -> Any:
    """The first of ``keys`` that is not a str of at most _MAX_KEY characters, or repeats one before it."""
    before: set[str] = set()
    for key in keys:
        if type(key) is not str or len(key) > _MAX_KEY or key in before:
            return key
        before.add(key)
    return None


def _leaf(node: int, seen: bytearray) -> None:
    if not 0 <= node < len(seen) or seen[node]:
        raise InvalidInputError(f"the bundle's tree names tensor {node} twice or past the {len(seen)} it has")
    seen[node] = 1
