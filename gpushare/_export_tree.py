"""gpushare.export of a dict, list or tuple of buffers: one share, a bundle.

The tensors are grouped by the allocation they lie in (a gpushare.allocate
buffer, a NumPy base array, a torch storage; else each its own memory), and
each allocation is offered once, on the paths that can serve it, as an
export of its own that only the bundle's leases reach.  Each tensor is an
offset, dtype, shape and strides into its allocation (:mod:`gpushare._manifest`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from . import _arrays, _buffers, _manifest, _paths
from ._cuda.fabric import cliques as fabric_cliques
from ._errors import InvalidInputError
from ._exporter import Export, get_exporter, new_ids, track_auto
from ._offering import device_ordinal, memory_of
from ._paths.broker import release_registrations
from ._share import PATHS, SHARE_FORMAT, Share, node_key

__all__ = ["export_tree", "is_tree"]

log = logging.getLogger("gpushare.api")


def is_tree(obj: Any) -> bool:
    """Whether :func:`gpushare.export` makes a bundle of ``obj``."""
    return isinstance(obj, (dict, list, tuple))


class _Tensor:
    __slots__ = ("obj", "span", "strides", "address", "nbytes", "memory_type", "device", "readonly")

    def __init__(self, obj: Any, np: Any) -> None:
        self.obj = obj
        if np is not None and type(obj) is np.ndarray and obj.flags.c_contiguous:
            # the common case, read straight off the array (the export holds it)
            self.span, self.strides = obj, None
            self.address, self.nbytes = obj.__array_interface__["data"][0], obj.nbytes
            self.memory_type, self.readonly, self.device = "host", not obj.flags.writeable, "host"
            return
        self.span, self.strides = _arrays.span_of(obj)
        local = _buffers.resolve(self.span, writable=False)
        try:
            self.address, self.nbytes = local.address, local.nbytes
            self.memory_type, self.readonly = local.memory_type, local.readonly
            device = local.device
        finally:
            local.release()
        self.device = device_ordinal(self.address, device) if self.memory_type == "cuda" else "host"


class _Allocation:
    """One part: the object the paths serve, and its span."""

    __slots__ = ("obj", "address", "nbytes", "memory_type", "device", "readonly", "key")

    def __init__(self, obj: Any, address: int, nbytes: int, memory_type: str, device: Any, readonly: bool,
                 by_span: bool = False) -> None:
        self.obj, self.address, self.nbytes = obj, address, nbytes
        self.memory_type, self.device, self.readonly = memory_type, device, readonly
        # tensors with the same key lie in one allocation: the same object, or (a torch
        # storage, a tensor's own memory) the same bytes
        self.key = (memory_type, device, address, nbytes) if by_span else (id(obj),)


def _flatten(node: Any, leaves: list[Any], depth: int) -> Any:
    if depth > _manifest.MAX_DEPTH:
        raise InvalidInputError(f"a bundle's tree nests deeper than {_manifest.MAX_DEPTH} (or holds itself)")
    if isinstance(node, dict):
        items = []
        for key, value in node.items():
            if not isinstance(key, str):
                raise InvalidInputError(f"a bundle's dict keys are str; {key!r:.40} is a {type(key).__name__}")
            items.append((key, _flatten(value, leaves, depth + 1)))
        return ("d", items)
    if isinstance(node, (list, tuple)):
        return ("l" if isinstance(node, list) else "t", [_flatten(v, leaves, depth + 1) for v in node])
    leaves.append(node)
    return len(leaves) - 1


def _allocation_of(t: _Tensor, found: list[_Allocation]) -> _Allocation:
    """The allocation ``t`` lies in: the one its offers name.  ``found``:
    gpushare.allocate buffers found so far, most recent first (the next
    tensor most likely lies in one of them)."""
    for alloc in found:
        if (alloc.memory_type == t.memory_type and alloc.address <= t.address
                and t.address + t.nbytes <= alloc.address + alloc.nbytes):
            return alloc
    memory, _ = memory_of(t.span, t.memory_type, (t.address, t.nbytes), t.readonly, False)
    obj = memory.obj
    if obj is not t.span:  # a gpushare.allocate buffer (or a gpushare.empty array's)
        local = _buffers.resolve(obj, writable=False)
        try:
            alloc = _Allocation(obj, local.address, local.nbytes, t.memory_type, t.device, local.readonly)
        finally:
            local.release()
        found.insert(0, alloc)
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
    storage = getattr(t.obj, "untyped_storage", None)
    torch = sys.modules.get("torch")
    if storage is not None and torch is not None and type(t.obj).__module__.startswith("torch"):
        store = storage()
        whole = t.obj.new_empty(0, dtype=torch.uint8).set_(store, 0, (store.nbytes(),))
        start = int(store.data_ptr())
        if store.nbytes() and start <= t.address and t.address + t.nbytes <= start + store.nbytes():
            return _Allocation(whole, start, store.nbytes(), t.memory_type, t.device, False, by_span=True)
    return _Allocation(t.span, t.address, t.nbytes, t.memory_type, t.device, t.readonly, by_span=True)


def _described(t: _Tensor, np: Any) -> tuple:
    """What the manifest says of ``t``'s elements (as :func:`gpushare._arrays.describe`)."""
    obj = t.obj
    if t.strides is None and np is not None and type(obj) is np.ndarray and obj.dtype.kind in "biufc" and (
            obj.dtype.fields is None):
        return obj.shape, obj.dtype.str, None, None
    return _arrays.describe(obj, t.nbytes, strided=t.strides is not None)


def export_tree(tree: Any, policy: Any, lifetime_name: str, wanted: list[str] | None, readonly: bool) -> Share:
    """:func:`gpushare.export` of ``tree``: a bundle's share."""
    objs: list[Any] = []
    shape_of = _flatten(tree, objs, 0)
    if not objs:
        raise InvalidInputError("cannot export an empty bundle: the tree holds no buffer")
    if len(objs) > _manifest.MAX_TENSORS:
        raise InvalidInputError(f"a bundle holds at most {_manifest.MAX_TENSORS} tensors; this tree has {len(objs)}")
    np = sys.modules.get("numpy")
    tensors = [_Tensor(obj, np) for obj in objs]
    found: list[_Allocation] = []
    allocations: list[_Allocation] = []
    by_key: dict[Any, int] = {}
    where: list[tuple[int, int]] = []
    for t in tensors:
        if t.nbytes == 0:
            where.append((-1, 0))
            continue
        alloc = _allocation_of(t, found)
        index = by_key.get(alloc.key)
        if index is None:
            index = by_key[alloc.key] = len(allocations)
            allocations.append(alloc)
        if t.readonly:
            allocations[index].readonly = True
        where.append((index, t.address - allocations[index].address))
    if not allocations:
        raise InvalidInputError("cannot export an empty bundle: every tensor in it is empty")
    share_id, token = new_ids()
    parts: list[Export] = []
    try:
        for alloc in allocations:
            ro = readonly or alloc.readonly
            offers, descs, regs = _paths.offers(_paths.Memory(alloc.obj, alloc.memory_type, ro, False), wanted)
            parts.append(Export(share_id=share_id, token=token, nbytes=alloc.nbytes, device=alloc.device,
                                memory_type=alloc.memory_type, offers=tuple(offers), descriptors=descs,
                                policy=policy, readonly=ro, registrations=regs, obj=alloc.obj))
        leaves = []
        for t, (index, offset) in zip(tensors, where, strict=True):
            shape, typestr, dtype_name, dlpack = _described(t, np)
            leaves.append(_manifest.Leaf(max(index, 0), offset, t.nbytes, shape, typestr, dtype_name, dlpack,
                                         t.strides))
        cliques = fabric_cliques()[0] if any(_paths.fabric.PATH.name in p.offers for p in parts) else {}
        described = [_manifest.Part(p.device, p.nbytes, p.offers, p.readonly,
                                    cliques.get(p.device) if _paths.fabric.PATH.name in p.offers else None)
                     for p in parts]
        manifest, made = _manifest.encode_made(described, leaves, shape_of)
        total = sum(p.nbytes for p in parts)
        union = tuple(name for name in PATHS if any(name in p.offers for p in parts))
        all_readonly = all(p.readonly for p in parts)
        record = Export(share_id=share_id, token=token, nbytes=total, device=parts[0].device,
                        memory_type=parts[0].memory_type, offers=union, descriptors={}, policy=policy,
                        readonly=all_readonly, parts=parts, digest=made.digest)
        if policy == "none":
            raise InvalidInputError("lifetime='none' holds the exported object only weakly, and a bundle's tree "
                                    "(a dict, list or tuple) cannot be; use lifetime='auto', 'closed', N or "
                                    "'revoked'")
        record.obj = tree
        share = Share._make_bundle((SHARE_FORMAT, share_id, token, os.getpid(), node_key(), get_exporter().addresses,
                                    total, parts[0].device, (total,), "|u1", union, lifetime_name,
                                    described[0].fabric, all_readonly, 0, None, None, None, manifest), made)
    except BaseException:
        for part in parts:
            release_registrations(part.registrations)
        raise
    get_exporter().add(record)
    log.info("exported bundle %s: %d tensors in %d allocations, %d bytes, offered on %s, lifetime %s%s",
             share_id[:8], len(leaves), len(parts), total, ", ".join(union), lifetime_name,
             ", read-only" if all_readonly else "")
    if policy == "auto":
        track_auto(tree, share, record)
    return share
