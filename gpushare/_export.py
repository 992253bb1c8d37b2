"""gpushare.export: offer a buffer's memory to other processes."""

from __future__ import annotations

import logging
import os
from typing import Any, overload

from . import _arrays, _buffers, _paths
from ._cuda import _driver
from ._errors import InvalidInputError, InvalidTypeError
from ._export_tree import export_tree, is_tree
from ._exporter.lifetimes import Export, track_auto, weak_or_none
from ._exporter.registry import get_exporter, new_ids
from ._offering import PathList, device_ordinal, memory_of, parse_lifetime
from ._paths.broker import release_registrations
from ._process import node_key
from ._share import BundleShare, Share
from ._types import Lifetime

__all__ = ["export"]

log = logging.getLogger("gpushare.api")


@overload
def export(obj: dict[str, Any] | list[Any] | tuple[Any, ...], *, lifetime: Lifetime = ...,
           paths: PathList | None = ..., readonly: bool | None = ...) -> BundleShare: ...
@overload
def export(obj: Any, *, lifetime: Lifetime = ..., paths: PathList | None = ...,
           readonly: bool | None = ...) -> Share: ...


def export(obj: Any, *, lifetime: Lifetime = "auto", paths: PathList | None = None,
           readonly: bool | None = None) -> Share:
    """Offer ``obj``'s memory to other processes; return the :class:`Share` to send them.

    Parameters
    ----------
    obj
        A buffer from :func:`gpushare.allocate` (every path), a cuda.core
        ``Buffer``, a CuPy array, a torch tensor, a NumPy array, or anything
        with DLPack, ``__cuda_array_interface__`` or the buffer protocol.
        Memory gpushare did not allocate is offered only where it can be
        served: other CUDA memory on cuda-ipc and ucx-rma, other host memory
        on cma and ucx-rma.  It must be C-contiguous.  Or a dict (str keys),
        list or tuple of them, nested: one share of them all, a *bundle*
        (:func:`gpushare.open` gives a :class:`gpushare.Bundle`), with one
        offer per allocation the tensors lie in (docs/bundles.md).
    lifetime : {"auto", "closed", "revoked", "none"} or int
        How long the exporter keeps ``obj`` alive and openable.  ``"auto"``
        (the default): while this process holds the returned :class:`Share`
        (it keeps ``obj`` alive, like a reference), while any import is
        open, until the first import of a share that was pickled or sent as
        bytes, and after that while ``obj`` itself is still alive here; so a
        share handed to N Pool workers stays openable until the last one has
        opened it.  ``"closed"``: until every importer has closed it
        (counted from the first import).  ``N``: until ``N`` imports have
        been made and closed.  ``"revoked"``: until :meth:`Share.revoke`.
        ``"none"``: the exporter holds only a weak reference, and opens fail
        once ``obj`` is gone.  See docs/lifetimes.md.
    paths : iterable of str, optional
        Offer only these paths (``"ucx-rma"`` and ``"same-process"`` are
        always possible).
    readonly : bool, optional
        Importers may only read (``View.put`` is refused, mapped views are
        read-only).  Read-only memory (``bytes``, a non-writeable array) is
        always shared read-only.  UCX does not enforce this against a
        malicious peer on TCP and shared memory (see docs/security.md).

    Returns
    -------
    Share
        Plain data; pickle it and send it over any transport.
    """
    policy, lifetime_name = parse_lifetime(lifetime)
    wanted = None
    if paths is not None:
        wanted = _paths.path_list(paths, "paths")
    if readonly is not None and not isinstance(readonly, bool):
        raise InvalidTypeError(f"readonly must be a bool or None, not {type(readonly).__name__}")
    if is_tree(obj):
        return export_tree(obj, policy, lifetime_name, wanted, bool(readonly))
    # A strided array is served as the memory it spans, with its strides.
    memory, strides = _arrays.span_of(obj)
    local = _buffers.resolve(memory, writable=False, stream=_driver.LEGACY_STREAM)
    try:
        nbytes, memory_type, device = local.nbytes, local.memory_type, local.device
        readonly = bool(readonly) or local.readonly
        pending = _buffers.pending_stream(memory, local)
    finally:
        local.release()
    if nbytes < 1:
        raise InvalidInputError("cannot export an empty buffer")
    device = device_ordinal(local.address, device) if memory_type == "cuda" else "host"
    if pending is not None and isinstance(device, int):
        _driver.wait_for_producers({(device, pending)})  # no importer sees the producer's work half done
    offered, offset = memory_of(memory, memory_type, (local.address, nbytes), readonly, strides is not None)
    # get/put move bytes, which a strided array's are not: it goes only where it is mapped.
    offers, descs, regs = _paths.offers(offered, wanted)
    try:
        shape, typestr, dtype_name, dlpack_dtype = _arrays.describe(obj, nbytes, strided=strides is not None)
    except InvalidInputError:
        release_registrations(regs)
        raise
    share_id, token = new_ids()
    exporter = get_exporter()
    record = Export(share_id=share_id, token=token, nbytes=nbytes, device=device, memory_type=memory_type,
                    offers=tuple(offers), descriptors=descs, policy=policy, readonly=readonly,
                    offset=offset, registrations=regs)
    try:
        if policy == "none":
            record.obj_ref = weak_or_none(obj, record)
        else:
            record.obj = memory  # for a strided array, its span, which holds the array
    except BaseException:
        release_registrations(regs)
        raise
    exporter.add(record)
    fabric = _paths.cliques([(tuple(offers), device)])[0]
    log.info("exported share %s: %d bytes of %s memory%s, offered on %s, lifetime %s%s", share_id[:8], nbytes,
             "host" if device == "host" else "CUDA", "" if device == "host" else f" on device {device}",
             ", ".join(offers), lifetime_name, ", read-only" if readonly else "")
    share = Share._make(*Share._fields_of(
        share_id=share_id, token=token, exporter_pid=os.getpid(), node=node_key(), control=exporter.addresses,
        nbytes=nbytes, device=device, shape=shape, typestr=typestr, offers=tuple(offers), lifetime=lifetime_name,
        fabric=fabric, readonly=readonly, offset=offset, dtype_name=dtype_name, dlpack_dtype=dlpack_dtype,
        strides=strides))
    if policy == "auto":
        track_auto(obj, share, record)
    return share
