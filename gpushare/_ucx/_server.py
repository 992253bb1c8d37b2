"""One UCX worker per process, serving every region, with access checked per request.

The exporter's side is :class:`Server`: memory is added as a :class:`Region`,
and each importer is handed a capability, ``(region_id, key)`` from
:meth:`Region.grant`.  The importer's side is :class:`Client`, whose
:class:`Peer` (one per exporter address) reads and writes regions with those
capabilities.  Every transfer is an active message that the exporter's
progress thread checks against its table of regions and keys (in C++, without
the GIL) before any byte moves; :meth:`Region.revoke` removes one key,
:meth:`Region.close` all of them.  See ``docs/ucx.md`` and ``docs/design.md``.
"""
from __future__ import annotations

import os
import secrets
import weakref
from typing import Any

from .. import _buffers, _types
from .._errors import ClosedError, InvalidInputError, WaitTimeoutError
from ._common import ADDRESS_MAGIC, MEMORY_TYPE_CODES, pack
from . import _device
from ._node import _NODE, KEY_BYTES, _check_key, _CLOSE_TIMEOUT, _Node

__all__ = ["Server", "Region", "server"]


# -- exporter side ---------------------------------------------------------------


class Region:
    """Memory a :class:`Server` serves; made by :meth:`Server.add_region`.

    Importers reach it only with a capability from :meth:`grant`; each
    capability can be revoked alone.  Closing the region revokes them all and
    unregisters the memory.
    """

    __slots__ = ("_node", "_id", "_local", "_readonly", "_finalizer", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Region objects are made by Server.add_region")

    @classmethod
    def _make(cls, node: _Node, region_id: int, local: _buffers.LocalBuffer, readonly: bool) -> Region:
        self = object.__new__(cls)
        self._node = node
        self._id = region_id
        self._local = local
        self._readonly = readonly
        self._finalizer = weakref.finalize(self, _close_region, node, region_id, local, _CLOSE_TIMEOUT)
        return self

    def _check_open(self) -> Any:
        n = self._node.check()
        if not self._finalizer.alive:
            raise ClosedError(f"region {self._id} is closed")
        return n

    @property
    def id(self) -> int:
        """The region's id, part of every capability on it."""
        return self._id

    @property
    def nbytes(self) -> int:
        """Size of the region in bytes."""
        return self._local.nbytes

    @property
    def readonly(self) -> bool:
        """Whether importers may only read."""
        return self._readonly

    @property
    def memory_type(self) -> str:
        """``"host"`` or ``"cuda"``."""
        return self._local.memory_type

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def grant(self) -> tuple[int, bytes]:
        """Make a capability for one importer: ``(region_id, key)``.

        The key is 128 random bits; send both to the importer over a channel
        you trust (the control channel of its lease).  Each call makes a new
        key, which :meth:`revoke` withdraws alone.
        """
        n = self._check_open()
        key = secrets.token_bytes(KEY_BYTES)
        n.grant(self._id, key)
        return self._id, key

    def revoke(self, key: bytes, timeout: float = _CLOSE_TIMEOUT) -> bool:
        """Withdraw one capability; the importer holding it loses access at once.

        Every request with ``key`` checked after the key is withdrawn is
        refused with :class:`AccessDeniedError`; transfers admitted before
        are waited for (at most ``timeout`` seconds) and reported to the
        importer as refused too (a put's bytes may have landed).  When this
        returns, nothing of that importer's touches the region any more.
        Other keys of the region keep working.  Returns whether ``key`` was
        granted (revoking twice is harmless).

        On a closed region (whose keys are all refused already) it only
        lets go of what the server still remembers of the key, and returns
        False: the end of each lease revokes its key, whether or not the
        region closed first, so that a closed region is forgotten once no
        importer holds a key to it.

        Raises
        ------
        WaitTimeoutError
            If transfers admitted before did not finish within ``timeout``
            (the key stays revoked; they are stuck in the network).
        """
        key = _check_key(key)
        t = _types.timeout(timeout)
        if not self._finalizer.alive:
            node = self._node
            if os.getpid() == node.pid and not node.native.closed:
                node.native.revoke(self._id, key, 0.0)
            return False
        n = self._check_open()
        outcome = n.revoke(self._id, key, _CLOSE_TIMEOUT if t is None else t)
        if outcome == 2:
            raise WaitTimeoutError(f"key revoked, but transfers admitted before did not finish within {timeout} s")
        return outcome == 1

    def close(self, timeout: float = _CLOSE_TIMEOUT) -> None:
        """Revoke every key, fail what is in flight, unregister the memory (idempotent).

        Requests arriving afterwards fail with :class:`ClosedError` on the
        importer, as do transfers that were under way: puts, and gets of
        64 KiB or more (their data may have arrived, but the importer is
        told the region closed); a smaller get admitted before the close
        has its data on the way and completes.  This
        waits at most ``timeout`` seconds for those transfers to let go of
        the memory; if one does not (a stuck peer), the memory stays
        registered and referenced until the process's node stops, and is
        never reused under the peer.
        """
        t = _types.timeout(timeout)
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        _close_region(self._node, self._id, self._local, _CLOSE_TIMEOUT if t is None else t)

    @staticmethod
    def close_all(regions: list[Region], timeout: float = _CLOSE_TIMEOUT) -> None:
        """:meth:`close` of each of ``regions`` at once (a bundle's
        allocations), within one ``timeout``: one call into the region server
        for those of one node, where one each cost a thread switch."""
        by_node: dict[int, tuple[_Node, list[tuple[int, _buffers.LocalBuffer]]]] = {}
        for region in regions:
            if region._finalizer.alive:
                region._finalizer.detach()
                by_node.setdefault(id(region._node), (region._node, []))[1].append((region._id, region._local))
        for node, closing in by_node.values():
            _close_regions(node, closing, timeout)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("read-only" if self._readonly else "read-write")
        return f"<gpushare._ucx.Region {self._id} {self._local.memory_type} {self._local.nbytes} B {state}>"


def _close_region(node: _Node, region_id: int, local: _buffers.LocalBuffer, timeout: float) -> None:
    _close_regions(node, [(region_id, local)], timeout)


def _close_regions(node: _Node, closing: list[tuple[int, _buffers.LocalBuffer]], timeout: float) -> None:
    """Close regions of ``node`` (their ids and memory) in one call; memory
    still in use by a transfer stays held until the node stops."""
    if os.getpid() != node.pid or node.native.closed:
        return  # a forked child, or the node already unregistered everything
    drained = node.native.close_regions([region_id for region_id, _ in closing], timeout)
    for (_, local), free in zip(closing, drained, strict=True):
        if free:
            local.release()
        else:
            with node.lock:
                node.held.append(local)


class Server:
    """This process's region server: one UCX worker for every region it serves.

    Get it with :func:`server`.  Importers connect to :attr:`address` and
    present ``(region_id, key)`` capabilities; the server checks each request
    (region, key, range, read-only) before any byte moves.
    """

    __slots__ = ("_node",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("use gpushare._ucx._server.server() for this process's Server")

    @classmethod
    def _make(cls, node: _Node) -> Server:
        self = object.__new__(cls)
        self._node = node
        return self

    @property
    def address(self) -> bytes:
        """Bytes an importer passes to :meth:`Client.connect` (the worker's address)."""
        n = self._node.check()
        return pack(ADDRESS_MAGIC, 0, n.address())

    def add_region(self, obj: Any, readonly: bool = False) -> Region:
        """Serve ``obj``'s memory as a new region.

        Parameters
        ----------
        obj
            Host memory (buffer protocol), CUDA memory
            (``__cuda_array_interface__``, DLPack, cuda.core ``Buffer``), or a
            resolved ``LocalBuffer``.  It stays referenced until the region closes.
        readonly : bool
            Refuse puts.  A read-only buffer may only be added this way.

        Raises
        ------
        InvalidInputError
            For an unusable buffer, an empty one, or a read-only buffer
            without ``readonly=True``.
        """
        n = self._node.check()
        if not isinstance(readonly, bool):
            raise InvalidInputError("readonly must be a bool")
        local = _buffers.resolve(obj, writable=False)
        try:
            if local.nbytes < 1:
                raise InvalidInputError("a region needs at least one byte")
            if local.readonly and not readonly:
                raise InvalidInputError("the buffer is read-only: add it with readonly=True")
            # UCX registers CUDA memory, and later copies into and out of it,
            # under the device's primary context (see _device).
            with _device.on_memory_device(local):
                rid = n.add_region(local.address, local.nbytes, readonly, MEMORY_TYPE_CODES[local.memory_type])
        except BaseException:
            if local is not obj:
                local.release()
            raise
        return Region._make(self._node, rid, local, readonly)

    def stats(self) -> dict[str, int]:
        """Counts: open ``regions``, granted ``keys``, ``refused`` and ``served``
        requests (a batch's items count one each), request ``messages``
        received, and ``kept`` of them: puts whose data UCX copied into a
        buffer of its own before the server copied it into the region (a
        put to a region the importer did not yet know to be host memory,
        or to device memory).

        And what the node's tables hold: ``closed_regions``, closed regions
        remembered while importers hold keys to them (they are told the
        region closed); ``known_host_regions``, regions of exporters this
        process connects to that it knows to be host memory (for the views
        it has open); ``transfers``, its own transfers in flight.  None of
        them grows with the number of opens and closes."""
        n = self._node.check()
        regions, keys, refused, served, messages, kept = n.stats()
        closed_regions, known_host_regions, transfers = n.tables()
        return {"regions": regions, "keys": keys, "refused": refused, "served": served, "messages": messages,
                "kept": kept, "closed_regions": closed_regions, "known_host_regions": known_host_regions,
                "transfers": transfers}

    def info(self) -> str:
        """UCX's description of the worker (transports, devices)."""
        n = self._node.check()
        return n.info()

    def __repr__(self) -> str:
        return f"<gpushare._ucx.Server pid={self._node.pid}>"


def server() -> Server:
    """This process's :class:`Server`, made on first use (in a forked child, anew, or
    :class:`UnsupportedError` where the parent had started UCX)."""
    return Server._make(_NODE.get())
