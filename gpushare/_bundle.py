"""The open bundle: :class:`Bundle`, many tensors of one share.

A bundle holds what its open made for each allocation (a mapping, a
transport, or in the exporting process its own objects) and one lease.
Its items mirror the exported tree: a tensor is a :class:`View` (made on
first use, then kept) over its allocation's mapping or transport at the
tensor's offset; a dict, list or tuple is a bundle node over the same
state.  Copies of many tensors travel as one batch (:mod:`gpushare._batch`).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _batch
from ._types import collection_paused
from ._arrays import empty
from ._buffers import host_address_reader
from ._bundle_tree import build, build_from, build_list, leaf_indices, pair
from ._errors import ClosedError, InvalidInputError, UnsupportedError
from ._manifest import Manifest
from ._paths.base import Opened
from ._share import Share
from ._view import View, with_timeout
from ._view_use import MappingUse

__all__ = ["Bundle", "Shifted"]


class Shifted:
    """A transport of one allocation, seen from one tensor at ``base`` in it:
    offsets are the tensor's, the allocation's transport gets them moved."""

    __slots__ = ("inner", "base", "batch_key", "host_only")

    def __init__(self, inner: Any, base: int) -> None:
        self.inner, self.base = inner, base
        # one batch with the other tensors of the bundle's allocations on that connection
        self.batch_key = ("shifted", inner.batch_key)
        self.host_only = inner.host_only

    def _callbacks(self, span: Any, check: Any) -> tuple[Any, Any]:
        base = self.base

        def moved_span(buf: Any, offset: int, writable: bool, stream: Any = None) -> Any:
            local, off = span(buf, offset - base, writable, stream)
            return local, off + base

        def moved_check(buf: Any, offset: int, writable: bool) -> None:
            check(buf, offset - base, writable)

        return moved_span, moved_check

    def get(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None:
        self.inner.get(offset + self.base, buf, timeout, stream, *self._callbacks(span, check))

    def put(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None:
        self.inner.put(offset + self.base, buf, timeout, stream, *self._callbacks(span, check))

    async def get_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None:
        await self.inner.get_async(offset + self.base, buf, stream, self._callbacks(span, None)[0])

    async def put_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None:
        await self.inner.put_async(offset + self.base, buf, stream, self._callbacks(span, None)[0])

    def batch(self, items: list, direction: str) -> list:
        return self.inner.batch([(t.inner, offset + t.base, buf) for t, offset, buf in items], direction)

    def close(self) -> None:
        pass  # the allocation's transport is the bundle's


class _State:
    """What one open of a bundle holds, shared by its nodes and views."""

    def __init__(self, share: Share, manifest: Manifest, parts: list[Share], paths: list[str], opened: list[Opened],
                 whys: list[str], lease: Any, targets: list[Any] | None) -> None:
        self.share = share
        self.manifest = manifest
        self.parts = parts
        self.paths = paths
        self.opened = opened
        self.whys = whys
        self.lease = lease
        self.targets = targets  # in the exporting process: the tensors themselves
        self.uses = [MappingUse(o.mapping) if o.mapping is not None else None for o in opened]
        self.views: dict[int, View] = {}
        self._bytes: dict[int, Any] = {}
        self._part_views: dict[int, View] = {}
        self.lock = threading.Lock()
        self.closed = False

    def host_bytes(self, part: int) -> Any:
        """Mapped host allocation ``part`` as a NumPy byte array (made once), or None."""
        found = self._bytes.get(part)
        if found is None:
            mapping = self.opened[part].mapping
            if mapping is None or mapping.device != "host":
                return None
            found = self._bytes[part] = np.frombuffer(mapping.memoryview(), dtype=np.uint8)
        return found

    def part_view(self, part: int) -> View:
        """A view of allocation ``part`` as bytes (a copied one: fetched whole)."""
        with self.lock:
            view = self._part_views.get(part)
            if view is None:
                view = self._part_views[part] = View._make(self.parts[part], self.paths[part], self.whys[part],
                                                           Opened(transport=Shifted(self.opened[part].transport, 0)))
            return view

    def view(self, i: int) -> View:
        with self.lock:
            if self.closed:
                raise ClosedError("bundle is closed")
            view = self.views.get(i)
            if view is None:
                view = self.views[i] = self._make(i)
            return view

    def all_views(self) -> list[View]:
        """Every tensor's view, by leaf: those not made yet made at once (for
        the views of a mapped allocation, in one pass)."""
        with self.lock, collection_paused(self.manifest.count):
            if self.closed:
                raise ClosedError("bundle is closed")
            m = self.manifest
            missing = [i for i in range(m.count) if i not in self.views]
            if missing:
                batches: dict[int, tuple[list[int], list[tuple]]] = {}
                for i, (part, offset, nbytes, shape, typestr, name, dl, strides) in zip(missing, m.rows(missing)):
                    if self.targets is not None or self.opened[part].mapping is None:
                        self.views[i] = self._make(i)
                        continue
                    batch = batches.get(part)
                    if batch is None:
                        batch = batches[part] = ([], [])
                    batch[0].append(i)
                    batch[1].append((self.parts[part]._replace(nbytes=nbytes, shape=shape, typestr=typestr,
                                                               offset=offset, dtype_name=name, dlpack_dtype=dl,
                                                               strides=strides, manifest=None),
                                     nbytes, shape, typestr, strides, name))
                for part, (leaves, items) in batches.items():
                    made = View._of_leaves(items, self.paths[part], self.whys[part], self.opened[part].mapping,
                                           self.uses[part])
                    self.views.update(zip(leaves, made))
            views = self.views
            return [views[i] for i in range(m.count)]

    def _make(self, i: int, *, raw: bool = False) -> View:
        leaf = self.manifest.leaf(i)
        part = self.parts[leaf.part]
        path = self.paths[leaf.part]
        if raw:  # its bytes, for a strided tensor copied out as bytes
            leaf_shape, typestr, strides, name, dl = (leaf.nbytes,), "|u1", None, None, None
        else:
            leaf_shape, typestr, strides, name, dl = leaf.shape, leaf.typestr, leaf.strides, leaf.dtype_name, \
                leaf.dlpack_dtype
        share = part._replace(nbytes=leaf.nbytes, shape=leaf_shape, typestr=typestr, offset=leaf.offset,
                              dtype_name=name, dlpack_dtype=dl, strides=strides, manifest=None)
        opened = self.opened[leaf.part]
        if self.targets is not None:
            return View._make(share, path, self.whys[leaf.part], Opened(target=self.targets[i]))
        if opened.transport is not None:
            return View._make(share, path, self.whys[leaf.part], Opened(transport=Shifted(opened.transport,
                                                                                         leaf.offset)))
        return View._make(share, path, self.whys[leaf.part], Opened(mapping=opened.mapping),
                          use=self.uses[leaf.part])

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            views, self.views = list(self.views.values()) + list(self._part_views.values()), {}
            self._part_views = {}
        self._bytes = {}
        for view in views:
            view.close()
        _release(self.lease, self.uses, self.opened)


def _release(lease: Any, uses: list, opened: list[Opened]) -> None:
    if lease is not None:
        lease.close()
    for use in uses:
        if use is not None:
            use.drop()
    for o in opened:
        if o.transport is not None:
            o.transport.close()


class Bundle:
    """An open bundle: many tensors of one share, made by :func:`gpushare.open`
    of a share that :func:`gpushare.export` made of a dict, list or tuple.

    Its items mirror the exported tree: ``bundle["w"]`` (or ``bundle[3]``)
    is a :class:`View` of that tensor, with its own dtype, shape and
    strides, zero-copy where its allocation is mapped (``numpy.asarray``,
    ``torch.from_dlpack``...), or a nested bundle for a dict, list or tuple
    in the tree.  :meth:`tree` gives the whole structure of views;
    :meth:`get` and :meth:`put` copy many tensors as one batch.  A bundle is
    one lease with its exporter; :meth:`close` ends it and closes every view
    made from it (DLPack tensors keep their mapping until released).  A
    context manager, also an asynchronous one.

    Attributes
    ----------
    share : Share
        The bundle's share.
    why : str
        One line per allocation: the path it was opened on, and why.
    paths : tuple of str
        The path of each allocation.
    count : int
        Tensors in the whole bundle.
    """

    __slots__ = ("_state", "_node", "_finalizer", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Bundle objects are made by gpushare.open")

    @classmethod
    def _make(cls, state: _State, node: Any, finalizer: Any = None) -> Bundle:
        self = object.__new__(cls)
        self._state = state
        self._node = node
        self._finalizer = finalizer if finalizer is not None else weakref.finalize(
            self, _release, state.lease, state.uses, state.opened)
        return self

    # -- what it holds -----------------------------------------------------
    @property
    def share(self) -> Share:
        return self._state.share

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._state.paths)

    @property
    def count(self) -> int:
        return self._state.manifest.count

    @property
    def why(self) -> str:
        s = self._state
        lines = []
        for i, (part, why) in enumerate(zip(s.parts, s.whys, strict=True)):
            where = "host memory" if part.device == "host" else f"CUDA memory of device {part.device}"
            lines.append(f"allocation {i} ({part.nbytes} bytes of {where}, "
                         f"{len(s.manifest.leaves_of(i))} tensors): {why}")
        return "\n".join(lines)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def kind(self) -> type:
        """``dict``, ``list`` or ``tuple``: what this node of the tree was exported as."""
        return {"d": dict, "l": list, "t": tuple}[self._node[0]]

    def _check(self) -> None:
        if self._state.closed:
            raise ClosedError("bundle is closed")

    def _item(self, node: Any) -> Any:
        if type(node) is int:
            return self._state.view(node)
        return Bundle._make(self._state, node, self._finalizer)

    def __getitem__(self, key: Any) -> Any:
        self._check()
        kind, items = self._node
        if kind == "d":
            try:
                node = self._state.manifest.named(self._node)[key]
            except (KeyError, TypeError):  # TypeError: an unhashable key, in no dict
                raise KeyError(key) from None
            return self._item(node)
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"a {self.kind.__name__} of the bundle is indexed by int, not {type(key).__name__}")
        return self._item(items[key])

    def __len__(self) -> int:
        return len(self._node[1])

    def __iter__(self) -> Iterator[Any]:
        """Keys of a dict node (as a dict iterates); the items of a list or tuple node."""
        kind, items = self._node
        if kind == "d":
            return iter([name for name, _ in items])
        return iter([self._item(node) for node in items])

    def __contains__(self, key: object) -> bool:
        try:
            return self._node[0] == "d" and key in self._state.manifest.named(self._node)
        except TypeError:  # an unhashable key
            return False

    def keys(self) -> list[str]:
        """The keys of a dict node."""
        if self._node[0] != "d":
            raise TypeError(f"a {self.kind.__name__} of the bundle has no keys")
        return [name for name, _ in self._node[1]]

    def items(self) -> list[tuple[str, Any]]:
        """(key, view or bundle) of a dict node."""
        return [(name, self._item(node)) for name, node in self._node[1]] if self._node[0] == "d" else list(
            enumerate(self))

    def tree(self) -> Any:
        """The same structure as the exported tree (dicts, lists, tuples), of views."""
        self._check()
        views = self._state.all_views()
        return build(self._node, views.__getitem__)

    # -- copies --------------------------------------------------------------
    def get(self, dests: Any = None, *, timeout: float | None = 60.0) -> Any:
        """Copy tensors out, as one batch.

        With no ``dests``: a structure like the tree of fresh arrays (NumPy
        for host memory, :class:`gpushare.CudaArray` for CUDA memory) holding
        the tensors' values, and returns it (the fresh arrays of one host
        allocation are views of one new buffer: tensors that overlapped in
        the exporter overlap here too).  With ``dests``, a structure like
        (part of) the tree whose leaves are buffers: copies each tensor into
        its buffer (``len(buf)`` bytes from the tensor's start) and returns
        ``dests``.  Either way the bytes are there when it returns.
        """
        count = self._state.manifest.count
        with collection_paused(count):
            out, items = self._targets(dests, "get")
            request = _batch.get_batch(items)
            out.prepare()  # while the bytes travel
        request.wait(timeout)
        with collection_paused(count):
            return out.done(dests)

    def put(self, srcs: Any, *, timeout: float | None = 60.0) -> None:
        """Copy ``srcs`` (a structure like part of the tree, of buffers) into
        the tensors, as one batch; read-only bundles refuse it."""
        with collection_paused(self._state.manifest.count):
            _, items = self._targets(srcs, "put")
            request = _batch.put_batch(items)
        request.wait(timeout)

    async def get_async(self, dests: Any = None, *, timeout: float | None = None) -> Any:
        """:meth:`get` for asyncio: awaits the batch's completion."""
        out, items = self._targets(dests, "get")
        request = _batch.get_batch(items)
        out.prepare()
        await with_timeout(_awaited(request), timeout)
        return out.done(dests)

    async def put_async(self, srcs: Any, *, timeout: float | None = None) -> None:
        """:meth:`put` for asyncio."""
        _, items = self._targets(srcs, "put")
        await with_timeout(_awaited(_batch.put_batch(items)), timeout)

    def _targets(self, buffers: Any, direction: str) -> tuple[Any, list[tuple[View, int, Any]]]:
        """(the structure returned, the batch's items)."""
        self._check()
        s = self._state
        items: list[tuple[View, int, Any]] = []
        if buffers is None:
            if direction == "put":
                raise InvalidInputError("put needs the buffers to copy in")
            indices = range(s.manifest.count) if self._node is s.manifest.tree else leaf_indices(self._node)
            return _Fresh(s, self._node, indices, items), items
        if direction == "put":
            pair(self._node, buffers, lambda i, buf: items.append((s.view(i), 0, buf)), "")
            return buffers, items
        pairs: list[tuple[int, Any]] = []
        pair(self._node, buffers, lambda i, buf: pairs.append((i, buf)), "")
        return _Copies(_into(s, pairs, items)), items

    # -- state ---------------------------------------------------------------
    def close(self) -> None:
        """End the bundle's lease and close every view made from it (idempotent)."""
        if self._finalizer.alive:
            self._finalizer.detach()
        self._state.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Bundle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._state
        state = "closed" if s.closed else "via " + ", ".join(sorted(set(s.paths)))
        return (f"<gpushare.Bundle {self.kind.__name__} of {len(self)}, {self.count} tensors in {len(s.parts)} "
                f"allocations {state}>")


class _Fresh:
    """Fresh arrays for the tensors ``indices`` of ``node``, in its
    structure.  Made with their copies (added to ``items``); the arrays of
    the allocations fetched whole, and the structure, are made by
    :meth:`prepare`, while the bytes travel; :meth:`done` hands them out
    once they are in (strided tensors made arrays then)."""

    __slots__ = ("state", "node", "arrays", "groups", "pending", "tree")

    def __init__(self, s: _State, node: Any, indices: Any, items: list) -> None:
        self.state, self.node = s, node
        self.arrays: list[Any] = [None] * s.manifest.count  # by tensor
        self.groups = _stage_spans(s, indices, items)
        self.pending: list[_Staged] = []
        self.tree: Any = None
        rest: Any = indices
        if self.groups:
            covered = np.zeros(s.manifest.count, dtype=bool)
            for _, leaves, _ in self.groups:
                covered[leaves] = True
            wanted = _index_array(indices)
            rest = wanted[~covered[wanted]].tolist()
        for i in rest:
            got = self.arrays[i] = _fresh(s, i, items)
            if type(got) is _Staged:
                self.pending.append(got)

    def prepare(self) -> None:
        if self.tree is None:
            for raw, leaves, at in self.groups:
                _rows(self.state.manifest, raw, leaves, at, self.arrays)
            self.tree = build_list(self.node, self.arrays, self.state.manifest)

    def done(self, _: Any) -> Any:
        self.prepare()
        if not self.pending:
            return self.tree
        return build_from(self.tree, lambda leaf: leaf.result() if type(leaf) is _Staged else leaf)


class _Copies:
    """Copies into NumPy destinations from a staging buffer, made once its bytes are in."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[int, int, int, Any]]) -> None:
        self.pairs = pairs

    def prepare(self) -> None:
        pass

    def done(self, dests: Any) -> Any:
        move = ctypes.memmove
        for dst, src, n, _ in self.pairs:  # each destination checked a writable C-contiguous array of n bytes or more
            move(dst, src, n)
        return dests


class _Staged:
    """A tensor copied out as bytes (its own, or its allocation's), made an
    array once they are in."""

    __slots__ = ("raw", "offset", "shape", "strides", "dtype")

    def __init__(self, raw: Any, offset: int, shape: tuple[int, ...], strides: tuple[int, ...] | None,
                 dtype: Any) -> None:
        self.raw, self.offset, self.shape, self.strides, self.dtype = raw, offset, shape, strides, dtype

    def result(self) -> Any:
        return np.array(np.ndarray(self.shape, dtype=self.dtype, buffer=self.raw, offset=self.offset,
                                   strides=self.strides))


def _fresh(s: _State, i: int, items: list) -> Any:
    """A new array for tensor ``i``, with its copy added to ``items``."""
    leaf = s.manifest.leaf(i)
    part = s.parts[leaf.part]
    if part.device != "host":
        if leaf.strides is not None:
            raise UnsupportedError(f"tensor {i} is a strided CUDA array: copy it with numpy or DLPack")
        dst = empty(leaf.shape, leaf.typestr, device=s.view(i).device)
        if leaf.nbytes:
            items.append((s.view(i), 0, dst))
        return dst
    dtype = np.dtype(leaf.typestr)
    whole = s.host_bytes(leaf.part)
    if whole is not None:  # mapped host memory: copied here and now
        return np.array(np.ndarray(leaf.shape, dtype=dtype, buffer=whole, offset=leaf.offset, strides=leaf.strides))
    if leaf.strides is None:
        dst = np.empty(leaf.shape, dtype=dtype)
        if leaf.nbytes:
            items.append((s.view(i), 0, dst))
        return dst
    raw = np.empty(leaf.nbytes, dtype=np.uint8)
    items.append((s._make(i, raw=True), 0, raw))
    return _Staged(raw, 0, leaf.shape, leaf.strides, dtype)


#: A copied allocation is fetched whole (one transfer, then sliced here) when
#: its tensors cover at least this share of the bytes between their ends.
_WHOLE = 0.5


def _span_groups(s: _State, indices: Any) -> list[tuple[int, int, int, np.ndarray, np.ndarray]]:
    """For the tensors ``indices`` that lie in host allocations, the
    allocations whose span of them is taken at once (two or more tensors
    covering at least ``_WHOLE`` of it): (part, span start, span end, the
    tensors, their offsets from the start), the tensors in ``indices``' order."""
    if s.targets is not None:
        return []
    m = s.manifest
    idx = _index_array(indices)
    host = np.array([p.device == "host" for p in s.parts], dtype=bool)
    part, offset, span = m.arrays[0][idx], m.arrays[1][idx], m.spans[idx]
    keep = host[part] & (span > 0)
    if not keep.all():
        idx, part, offset, span = idx[keep], part[keep], offset[keep], span[keep]
    out = []
    for p in np.unique(part).tolist():
        in_part = part == p
        leaves, at, size = (idx, offset, span) if in_part.all() else (idx[in_part], offset[in_part], span[in_part])
        lo, hi = int(at.min()), int((at + size).max())
        if len(leaves) >= 2 and int(size.sum()) >= _WHOLE * (hi - lo):
            out.append((p, lo, hi, leaves, at - lo))
    return out


def _index_array(indices: Any) -> np.ndarray:
    if type(indices) is range:
        return np.arange(indices.start, indices.stop, dtype=np.int64)
    return np.asarray(indices, dtype=np.int64)


def _span_bytes(s: _State, part: int, lo: int, hi: int, items: list) -> Any:
    """A new byte buffer that holds (or, once ``items`` have run, will hold)
    bytes ``lo`` to ``hi`` of host allocation ``part``; None where the
    allocation is neither mapped nor copied."""
    whole = s.host_bytes(part)
    if whole is not None:
        return whole[lo:hi].copy()
    if s.opened[part].transport is None:
        return None
    raw = np.empty(hi - lo, dtype=np.uint8)
    items.append((s.part_view(part), lo, raw))
    return raw


def _spans(s: _State, indices: list[int], items: list) -> dict[int, tuple[Any, int]]:
    """:func:`_stage_spans` by tensor: tensor -> (its span's buffer, its offset there)."""
    out: dict[int, tuple[Any, int]] = {}
    for raw, leaves, at in _stage_spans(s, indices, items):
        out.update(zip(leaves.tolist(), ((raw, a) for a in at.tolist()), strict=True))
    return out


def _stage_spans(s: _State, indices: Any, items: list) -> list[tuple[Any, np.ndarray, np.ndarray]]:
    """For the tensors ``indices`` that lie in host allocations (mapped or
    copied), each allocation's span of them taken at once: copied here from
    a mapping, or fetched as one transfer (added to ``items``), into one new
    byte buffer.  (That buffer, its tensors, their offsets there), for
    :func:`_rows` to make their arrays."""
    out = []
    for part, lo, hi, leaves, at in _span_groups(s, indices):
        raw = _span_bytes(s, part, lo, hi, items)
        if raw is not None:
            out.append((raw, leaves, at))
    return out


def _rows(m: Manifest, raw: Any, leaves: np.ndarray, at: np.ndarray, arrays: list[Any]) -> None:
    """Arrays over ``raw`` for the tensors ``leaves`` (at offsets ``at``),
    put in ``arrays``.  A run of tensors of one dtype and shape that lie one
    after another becomes one array, and its rows the tensors' arrays (made
    in C, not one at a time)."""
    dtypes = [np.dtype(t) for t, _, _ in m.dtypes()]
    strided = m.strided()
    starts = _runs(m, leaves, at)
    bounds = starts.tolist() + [len(leaves)]
    leaf_list, at_list = leaves.tolist(), at.tolist()
    for k in range(len(bounds) - 1):
        first, end = bounds[k], bounds[k + 1]
        i = leaf_list[first]
        shape = m.shape(i)
        dtype = dtypes[m.dtype_index(i)]
        if end - first == 1:
            arrays[i] = np.ndarray(shape, dtype=dtype, buffer=raw, offset=at_list[first], strides=strided.get(i))
            continue
        rows = np.ndarray((end - first, *shape), dtype=dtype, buffer=raw, offset=at_list[first])
        if leaf_list[end - 1] - i == end - 1 - first and leaf_list[end - 1] > i:  # tensors numbered in order
            arrays[i:i + end - first] = rows
        else:
            for j, row in zip(leaf_list[first:end], rows, strict=True):
                arrays[j] = row


def _runs(m: Manifest, leaves: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Where the runs of ``leaves`` begin: a run is tensors of the same
    dtype and shape (at least one dimension, no strides), each starting
    where the one before it ends (``at``: their offsets)."""
    if len(leaves) < 2:
        return np.zeros(len(leaves), dtype=np.int64)
    joins = m.alike(leaves) & (at[1:] == at[:-1] + m.spans[leaves[:-1]])
    return np.concatenate(([0], np.flatnonzero(~joins) + 1))


def _into(s: _State, pairs: list[tuple[int, Any]], items: list) -> list[tuple[int, int, int, Any]]:
    """The copies of ``pairs`` (tensor, destination) as batch items; plain
    NumPy destinations of host tensors come from :func:`_spans`' buffers
    instead: (destination address, source address, bytes, and the two
    arrays, held while the copy waits) to copy once the batch is in."""
    m = s.manifest
    strided, spans = m.strided(), m.span_list()
    ndarray = np.ndarray
    np_dests = []
    for i, buf in pairs:
        if type(buf) is ndarray:
            flags = buf.flags
            if flags.c_contiguous and flags.writeable and buf.nbytes <= spans[i] and i not in strided:
                np_dests.append((i, buf))
                continue
        items.append((s.view(i), 0, buf))
    found = _spans(s, [i for i, _ in np_dests], items)
    address_of = host_address_reader()
    after = []
    raw_address: dict[int, int] = {}
    for i, buf in np_dests:
        hit = found.get(i)
        if hit is None:
            items.append((s.view(i), 0, buf))
            continue
        raw, at = hit
        base = raw_address.get(id(raw))
        if base is None:
            base = raw_address[id(raw)] = address_of(raw)
        after.append((address_of(buf), base + at, buf.nbytes, (buf, raw)))
    return after


async def _awaited(request: Any) -> None:
    await request
