"""gpushare.export of a dict, list or tuple of buffers: one share, a bundle.

The tensors are grouped by the allocation they lie in (a gpushare.allocate
buffer, a NumPy base array, a CUDA allocation such as a segment of torch's
caching allocator or a chunk of CuPy's pool, a torch storage; else each its
own memory), and
each allocation is offered once, on the paths that can serve it, as an
export of its own that only the bundle's leases reach.  Each tensor is an
offset, dtype, shape and strides into its allocation (:mod:`gpushare._manifest`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from . import _arrays, _buffers, _manifest, _paths
from ._cuda import _driver
from ._errors import GpuShareError, InvalidInputError
from ._exporter.lifetimes import Export, track_auto
from ._exporter.registry import get_exporter, new_ids
from ._exporter.sessions import MAX_BACKLOG_FDS
from ._offering import device_ordinal, memory_of
from ._paths.base import Memory
from ._paths.broker import release_registrations
from ._process import node_key
from ._ranges import Ranges
from ._share import Share
from ._types import collection_paused, path_names

__all__ = ["export_tree", "is_tree"]

log = logging.getLogger("gpushare.api")


def is_tree(obj: Any) -> bool:
    """Whether :func:`gpushare.export` makes a bundle of ``obj``."""
    return isinstance(obj, (dict, list, tuple))


class _Tensor:
    __slots__ = ("obj", "span", "strides", "address", "nbytes", "memory_type", "device", "readonly", "pending")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.span, self.strides = _arrays.span_of(obj)
        local = _buffers.resolve(self.span, writable=False, stream=_driver.LEGACY_STREAM)
        try:
            self.address, self.nbytes = local.address, local.nbytes
            self.memory_type, self.readonly = local.memory_type, local.readonly
            device = local.device
            #: the stream its producer's pending work is on (CUDA memory)
            self.pending = _buffers.pending_stream(self.span, local)
        finally:
            local.release()
        self.device = device_ordinal(self.address, device) if self.memory_type == "cuda" else "host"

    @classmethod
    def host_array(cls, obj: Any, address: int, nbytes: int, readonly: bool) -> _Tensor:
        """A C-contiguous NumPy array, its facts already read."""
        t = cls.__new__(cls)
        t.obj = t.span = obj
        t.strides = None
        t.address, t.nbytes, t.readonly = address, nbytes, readonly
        t.memory_type = t.device = "host"
        t.pending = None
        return t


class _Allocation:
    """One part: the object the paths serve, and its span."""

    __slots__ = ("obj", "address", "nbytes", "memory_type", "device", "readonly", "key", "hull")

    def __init__(self, obj: Any, address: int, nbytes: int, memory_type: str, device: Any, readonly: bool,
                 by_span: bool = False, hull: bool = False) -> None:
        self.obj, self.address, self.nbytes = obj, address, nbytes
        self.memory_type, self.device, self.readonly = memory_type, device, readonly
        # tensors with the same key lie in one allocation: the same object, or (a torch
        # storage, a CUDA allocation, a tensor's own memory) the same bytes
        self.key = (memory_type, device, address, nbytes) if by_span else (id(obj),)
        #: a CUDA allocation of another allocator (CuPy's pool, cudaMalloc): once every
        #: tensor is placed, it shrinks to their span, and ``obj`` is made over that
        self.hull = hull


def _flatten(node: Any, leaves: list[Any], depth: int) -> tuple[Any, list]:
    """``node`` as the manifest's tree nodes (leaves numbered as they are
    appended to ``leaves``), and the same as the manifest writes it."""
    if depth > _manifest.MAX_DEPTH:
        raise InvalidInputError(f"a bundle's tree nests deeper than {_manifest.MAX_DEPTH} (or holds itself)")
    if isinstance(node, dict):
        items: list[Any] = []
        doc: list[Any] = ["d"]
        for key, value in node.items():
            if type(key) is not str and not isinstance(key, str):
                raise InvalidInputError(f"a bundle's dict keys are str; {key!r:.40} is a {type(key).__name__}")
            if isinstance(value, (dict, list, tuple)):
                sub, sub_doc = _flatten(value, leaves, depth + 1)
            else:
                sub = sub_doc = len(leaves)
                leaves.append(value)
            items.append((key, sub))
            doc.append(key)
            doc.append(sub_doc)
        return ("d", items), doc
    kind = "l" if isinstance(node, list) else "t"
    items = []
    doc = [kind]
    for value in node:
        if isinstance(value, (dict, list, tuple)):
            sub, sub_doc = _flatten(value, leaves, depth + 1)
        else:
            sub = sub_doc = len(leaves)
            leaves.append(value)
        items.append(sub)
        doc.append(sub_doc)
    return (kind, items), doc


def _key_path(tree: Any, leaf: int | None) -> str | None:
    """The keys that lead to leaf number ``leaf`` of ``tree`` (as
    :func:`_flatten` numbers them), written as Python indexes it:
    ``["layers"][3]["w"]``."""
    if leaf is None:
        return None
    count = 0
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in reversed(list(node.items())))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
        elif count == leaf:
            return where
        else:
            count += 1
    return None


class _Found:
    """The gpushare.allocate buffers and CUDA blocks found so far, by address (a tree of N
    tensors each in a buffer of its own costs O(N log N) to sort out, not O(N^2)), and the
    latest of them."""

    __slots__ = ("_ranges", "latest")

    def __init__(self) -> None:
        self._ranges = Ranges(lambda alloc: True)
        self.latest: _Allocation | None = None

    def add(self, alloc: _Allocation) -> None:
        self._ranges.add(alloc.address, alloc.address + alloc.nbytes, alloc.memory_type, lambda: alloc)
        self.latest = alloc

    def holding(self, t: _Tensor) -> _Allocation | None:
        for ref in self._ranges.candidates(t.address, t.nbytes, t.memory_type):
            return ref()
        return None


def _allocation_of(t: _Tensor, found: _Found) -> _Allocation:
    """The allocation ``t`` lies in: the one its offers name.  ``found``:
    gpushare.allocate buffers and CUDA blocks found so far."""
    alloc = found.holding(t)
    if alloc is not None:
        return alloc
    memory, _ = memory_of(t.span, t.memory_type, (t.address, t.nbytes), t.readonly, False)
    obj = memory.obj
    if obj is not t.span:  # a gpushare.allocate buffer (or a gpushare.empty array's)
        local = _buffers.resolve(obj, writable=False)
        try:
            alloc = _Allocation(obj, local.address, local.nbytes, t.memory_type, t.device, local.readonly)
        finally:
            local.release()
        found.add(alloc)
        return alloc
    np = sys.modules.get("numpy")
    if np is not None and isinstance(t.obj, np.ndarray):
        root = t.obj
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.flags.c_contiguous and root.nbytes:
            start = root.__array_interface__["data"][0]
            if start <= t.address and t.address + t.nbytes <= start + root.nbytes:
                return _Allocation(root, start, root.nbytes, "host", "host", not root.flags.writeable)
    if t.memory_type == "cuda" and isinstance(t.device, int):
        # Memory of CuPy's pool, torch's caching allocator (a segment holds many
        # storages), cudaMalloc or an exportable pool: the tensors in one allocation
        # are one part (CUDA IPC exports the whole allocation anyway).
        found_range = _paths.base_allocation(t.address, t.device)
        if found_range is not None:
            alloc = _Allocation(None, *found_range, "cuda", t.device, t.readonly, by_span=True, hull=True)
            found.add(alloc)
            return alloc
    storage = getattr(t.obj, "untyped_storage", None)
    torch = sys.modules.get("torch")
    if storage is not None and torch is not None and type(t.obj).__module__.startswith("torch"):
        store = storage()
        whole = t.obj.new_empty(0, dtype=torch.uint8).set_(store, 0, (store.nbytes(),))
        start = int(store.data_ptr())
        if store.nbytes() and start <= t.address and t.address + t.nbytes <= start + store.nbytes():
            return _Allocation(whole, start, store.nbytes(), t.memory_type, t.device, False, by_span=True)
    return _Allocation(t.span, t.address, t.nbytes, t.memory_type, t.device, t.readonly, by_span=True)


def _shrink_hulls(objs: list[Any], columns: _manifest.Columns, allocations: list[_Allocation]) -> None:
    """Each CUDA allocation of another allocator becomes the span of its
    tensors (what ucx-rma exposes), their offsets counted from its start;
    the part is a _Span over it that holds the tensors."""
    hulls = {i: alloc for i, alloc in enumerate(allocations) if alloc.hull}
    if not hulls:
        return
    lo = {i: alloc.nbytes for i, alloc in hulls.items()}
    hi = dict.fromkeys(hulls, 0)
    members: dict[int, list[Any]] = {i: [] for i in hulls}
    for obj, part, offset, span in zip(objs, columns.part, columns.offset, columns.spans, strict=True):
        if span and part in hulls:
            lo[part], hi[part] = min(lo[part], offset), max(hi[part], offset + span)
            members[part].append(obj)
    for k, (part, offset, span) in enumerate(zip(columns.part, columns.offset, columns.spans, strict=True)):
        if span and part in hulls:
            columns.offset[k] = offset - lo[part]
    for i, alloc in hulls.items():
        alloc.address += lo[i]
        alloc.nbytes = hi[i] - lo[i]
        alloc.obj = _Span(alloc.address, alloc.nbytes, tuple(members[i]))


class _Span:
    """The span of a CUDA allocation's tensors, as the paths serve it: CUDA
    memory described by ``__cuda_array_interface__`` (nothing pending: the
    export waited for its producers), holding the tensors (no cuda.core)."""

    __slots__ = ("__cuda_array_interface__", "members")

    def __init__(self, address: int, nbytes: int, members: tuple[Any, ...]) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None, "stream": None}
        self.members = members


def _columns(objs: list[Any], pending: set[tuple[int, int]]) -> tuple[_manifest.Columns, list[_Allocation]]:
    """The manifest's columns of the tensors ``objs``, and the allocations
    they lie in (the parts, in the order the columns number them); the
    streams CUDA tensors' producers left work pending on go into ``pending``.

    A C-contiguous NumPy array (the common case, thousands of them in a
    state dict) has its facts read straight off it, and a tensor in the same
    gpushare.allocate buffer as the one before it costs no search.
    """
    np = sys.modules.get("numpy")
    ndarray = np.ndarray if np is not None else None
    torch_dtypes: dict[Any, int] = {}  # a torch dtype -> its index
    address_of = _buffers.host_address_reader()
    columns = _manifest.Columns()
    col_part, col_offset, col_span = columns.part, columns.offset, columns.spans
    col_dtype, col_ndim, col_dims = columns.dtype, columns.ndim, columns.dims.extend
    plain_dtypes: dict[Any, int] = {}  # a NumPy dtype that travels as it is -> its index; -1 for the others
    found = _Found()
    allocations: list[_Allocation] = []
    by_key: dict[Any, int] = {}
    last: _Allocation | None = None  # the gpushare.allocate buffer of the tensor before
    last_index = 0
    leaf = 0
    try:
        for leaf, obj in enumerate(objs):
            t: _Tensor | None = None
            if type(obj) is ndarray and obj.flags.c_contiguous:
                address, nbytes, ro, memory_type = address_of(obj), obj.nbytes, not obj.flags.writeable, "host"
                dt = obj.dtype
                dtype = plain_dtypes.get(dt)
                if dtype is None:
                    plain = dt.kind in "biufc" and dt.fields is None
                    dtype = plain_dtypes[dt] = columns.dtype_index(dt.str) if plain else -1
                shape = obj.shape
                if dtype < 0:
                    shape, typestr, name, dlpack = _arrays.describe(obj, nbytes)
                    dtype = columns.dtype_index(typestr, name, dlpack)
            elif _buffers.plain_torch_cpu(obj):
                address, nbytes, ro, memory_type = obj.data_ptr(), obj.nbytes, False, "host"
                shape = tuple(obj.shape)
                dtype = torch_dtypes.get(obj.dtype, -1)
                if dtype < 0:
                    shape, typestr, name, dlpack = _arrays.describe(obj, nbytes)
                    dtype = columns.dtype_index(typestr, name, dlpack)
                    if shape == tuple(obj.shape):  # a dtype that travels as items (else as bytes: not kept)
                        torch_dtypes[obj.dtype] = dtype
            else:
                t = _Tensor(obj)
                address, nbytes, ro, memory_type = t.address, t.nbytes, t.readonly, t.memory_type
                if t.pending is not None and isinstance(t.device, int):
                    pending.add((t.device, t.pending))
                shape, typestr, name, dlpack = _arrays.describe(obj, nbytes, strided=t.strides is not None)
                dtype = columns.dtype_index(typestr, name, dlpack)
            if not nbytes:
                columns.add(0, 0, 0, shape, dtype)
                continue
            if (last is not None and last.address <= address and address + nbytes <= last.address + last.nbytes
                    and last.memory_type == memory_type):
                index = last_index
            else:
                if t is None:
                    t = _Tensor.host_array(obj, address, nbytes, ro)
                alloc = _allocation_of(t, found)
                index = by_key.get(alloc.key)
                if index is None:
                    index = by_key[alloc.key] = len(allocations)
                    allocations.append(alloc)
                last, last_index = (alloc, index) if alloc is found.latest else (None, 0)
            if ro:
                allocations[index].readonly = True
            if t is not None and t.strides is not None:
                columns.add(index, address - allocations[index].address, nbytes, shape, dtype, t.strides)
                continue
            col_part.append(index)
            col_offset.append(address - allocations[index].address)
            col_span.append(nbytes)
            col_dtype.append(dtype)
            col_ndim.append(len(shape))
            col_dims(shape)
    except GpuShareError as exc:
        exc.leaf = leaf  # type: ignore[attr-defined]  # export_tree names it by its keys
        raise
    _shrink_hulls(objs, columns, allocations)
    return columns, allocations


def _part_exports(allocations: list[_Allocation], share_id: str, token: bytes, policy: Any, readonly: bool,
                  wanted: list[str] | None) -> Iterator[Export]:
    """Each allocation as an export of its own, offered on the paths that can
    serve it (made one at a time: those made before a failure are the
    caller's to release)."""
    for alloc in allocations:
        ro = readonly or alloc.readonly
        offers, descs, regs = _paths.offers(Memory(alloc.obj, alloc.memory_type, ro, False), wanted)
        yield Export(share_id=share_id, token=token, nbytes=alloc.nbytes, device=alloc.device,
                     memory_type=alloc.memory_type, offers=tuple(offers), descriptors=descs, policy=policy,
                     readonly=ro, registrations=regs, obj=alloc.obj)


def _check_fds(parts: list[Export]) -> None:
    """Refuse, at export, a bundle that no open could carry: the file
    descriptors its allocations' best paths send with one grant."""
    need = sum(max(_paths.by_name(name).grant_fds(part) for name in part.offers) for part in parts)
    if need > MAX_BACKLOG_FDS:
        sending = [name for name in dict.fromkeys(n for p in parts for n in p.offers)
                   if any(_paths.by_name(name).grant_fds(p) for p in parts if name in p.offers)]
        raise InvalidInputError(
            f"this bundle cannot be opened: its allocations need {need} file descriptors in one grant "
            f"({', '.join(sending)}), and one grant carries at most {MAX_BACKLOG_FDS} "
            "(gpushare._exporter.sessions.MAX_BACKLOG_FDS, docs/limits.md); lay the tensors out in fewer buffers "
            "(gs.share_memory(tree) or gs.Arena) or export with paths= leaving "
            f"{' and '.join(sending)} out")


def export_tree(tree: Any, policy: Any, lifetime_name: str, wanted: list[str] | None, readonly: bool) -> Share:
    """:func:`gpushare.export` of ``tree``: a bundle's share."""
    if policy == "none":
        raise InvalidInputError("lifetime='none' holds the exported object only weakly, and a bundle's tree "
                                "(a dict, list or tuple) cannot be; use lifetime='auto', 'closed', N or 'revoked'")
    objs: list[Any] = []
    shape_of, tree_doc = _flatten(tree, objs, 0)
    if not objs:
        raise InvalidInputError("cannot export an empty bundle: the tree holds no buffer")
    if len(objs) > _manifest.MAX_TENSORS:
        raise InvalidInputError(f"a bundle holds at most {_manifest.MAX_TENSORS} tensors; this tree has {len(objs)}")
    pending: set[tuple[int, int]] = set()
    try:
        with collection_paused(len(objs)):
            columns, allocations = _columns(objs, pending)
    except GpuShareError as exc:
        where = _key_path(tree, getattr(exc, "leaf", None))
        if where is None:
            raise
        try:
            named = type(exc)(f"{exc} (the tree's item {where})")
        except TypeError:  # an error of another signature: as it is
            raise exc from None
        raise named from None
    if not allocations:
        raise InvalidInputError("cannot export an empty bundle: every tensor in it is empty")
    if pending:
        _driver.wait_for_producers(pending)  # no importer sees a producer's work half done
    share_id, token = new_ids()
    parts: list[Export] = []
    try:
        with collection_paused(len(allocations)):
            parts.extend(_part_exports(allocations, share_id, token, policy, readonly, wanted))
        _check_fds(parts)
        cliques = _paths.cliques([(p.offers, p.device) for p in parts])
        described = [_manifest.Part(p.device, p.nbytes, p.offers, p.readonly, clique)
                     for p, clique in zip(parts, cliques, strict=True)]
        manifest, made = columns.encode(described, shape_of, tree_doc)
        total = sum(p.nbytes for p in parts)
        union = tuple(name for name in path_names() if any(name in p.offers for p in parts))
        all_readonly = all(p.readonly for p in parts)
        record = Export(share_id=share_id, token=token, nbytes=total, device=parts[0].device,
                        memory_type=parts[0].memory_type, offers=union, descriptors={}, policy=policy,
                        readonly=all_readonly, parts=parts, digest=made.digest)
        record.obj = tree
        share = Share._make_bundle(Share._fields_of(
            share_id=share_id, token=token, exporter_pid=os.getpid(), node=node_key(),
            control=get_exporter().addresses, nbytes=total, device=parts[0].device, shape=(total,), typestr="|u1",
            offers=union, lifetime=lifetime_name, fabric=described[0].fabric, readonly=all_readonly,
            manifest=manifest), made)
    except BaseException:
        for part in parts:
            release_registrations(part.registrations)
        raise
    get_exporter().add(record)
    log.info("exported bundle %s: %d tensors in %d allocations, %d bytes, offered on %s, lifetime %s%s",
             share_id[:8], len(objs), len(parts), total, ", ".join(union), lifetime_name,
             ", read-only" if all_readonly else "")
    if policy == "auto":
        track_auto(tree, share, record)
    return share
