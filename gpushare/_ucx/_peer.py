"""The importer's side of the region server: :class:`Client` (one per
process) and its :class:`Peer` per exporter, which read and write regions
with ``(region_id, key)`` capabilities."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .. import _buffers, _types
from .._errors import (
    ClosedError,
    GpuShareError,
    InvalidInputError,
    OutOfBoundsError,
    UCXConnectionError,
    WaitTimeoutError,
    translate,
)
from .._process import wait_alive
from ._common import ADDRESS_MAGIC, MAX_ADDRESS, MEMORY_TYPE_CODES, U64, Connection, Request, unpack
from . import _device
from ._address import check_worker_address
from ._loader import native
from ._node import _NODE, _check_key, _check_region_id, _Node, _OK

__all__ = ["Client", "Peer", "client"]


# -- importer side ---------------------------------------------------------------


class Peer(Connection):
    """The connection from this process to one exporter's :class:`Server`.

    Made by :meth:`Client.connect`, one per exporter address.  Requests carry
    a capability ``(region_id, key)``; the exporter refuses any it did not
    grant.  The local buffer of a request stays referenced until it completes.
    """

    __slots__ = ("_node",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Peer objects are made by Client.connect")

    @classmethod
    def _make(cls, node: _Node, npeer: Any) -> Peer:
        self = object.__new__(cls)
        self._init(npeer)
        self._node = node
        return self

    def _check_open(self) -> Any:
        self._node.check()
        if self._closed:
            raise ClosedError("peer is closed")
        return self._native

    def _item(self, op: str, region_id: Any, key: Any, offset: Any, buffer: Any,
              nbytes: Any, locals_: list, stream: int | None = None) -> tuple:
        _check_region_id(region_id)
        key = _check_key(key)
        _types.in_range(offset, "offset")
        local = None
        if _buffers.plain_host_nbytes(buffer) is not None:
            # NumPy arrays and Python's byte buffers: pinned natively, the
            # general path below when that fails (it says why).
            try:
                local = native().PinnedBuffer(buffer, op == "get")
            except (BufferError, TypeError, ValueError):
                pass
            else:
                locals_.append(local)
                memory_type = MEMORY_TYPE_CODES["host"]
        if local is None:
            local = _device.resolve(buffer, writable=(op == "get"), stream=stream)
            if local is not buffer:
                locals_.append(local)
            memory_type = MEMORY_TYPE_CODES[local.memory_type]
        if nbytes is None:
            nbytes = local.nbytes
        else:
            _types.in_range(nbytes, "nbytes")
            if nbytes > local.nbytes:
                raise InvalidInputError(f"buffer holds {local.nbytes} bytes; the {op} needs {nbytes}")
        if nbytes < 1:
            raise InvalidInputError(f"a {op} moves at least one byte")
        if offset + nbytes > U64:
            raise OutOfBoundsError("offset + nbytes runs past 2**64")
        if memory_type != MEMORY_TYPE_CODES["host"]:
            # UCX copies CUDA memory on streams of its own: after the work
            # queued before the transfer (see _device).
            _device.order_before(local, stream)
        return (region_id, key, offset, local.address, nbytes, memory_type)

    def _native_post(self, op: str, items: list[tuple], kind: str, gather: bool = False) -> Any:
        n = self._check_open()
        if len(items) == 1 and kind == op:
            return (n.get if op == "get" else n.put)(*items[0])
        return n.post(1 if op == "get" else 2, items, kind, gather)

    def _post(self, op: str, items: list[tuple], locals_: list, kind: str, gather: bool = False) -> Request:
        nreq = self._native_post(op, items, kind, gather)
        return self._track(Request._from_native(nreq, locals_ or None, self))

    def _one(self, op: str, region_id: Any, key: Any, offset: Any, buffer: Any, nbytes: Any,
             wait: float | None = -1.0, alive: Any = None, stream: Any = None) -> Request | None:
        """Post one get or put.  With ``wait`` (seconds, None = forever) wait
        for it here and return None: the synchronous calls skip the Request.
        ``alive``: while waiting, its ``check_alive()`` is asked every second
        whether the exporter still answers (its error ends the wait).
        ``stream``: for CUDA memory, the stream whose queued work comes first."""
        locals_: list = []
        try:
            item = self._item(op, region_id, key, offset, buffer, nbytes, locals_, _device.consumer_stream(stream))
            if wait == -1.0:
                return self._post(op, [item], locals_, op)
            nreq = self._native_post(op, [item], op)
        except BaseException:
            for lb in locals_:
                lb.release()
            raise
        try:
            if alive is None:
                done = nreq.wait(-1.0 if wait is None else wait)
            else:
                done = wait_alive(lambda t: nreq.wait(-1.0 if t is None else t), alive, wait)
        except BaseException:
            self._track(Request._from_native(nreq, locals_ or None, self))  # its buffer stays referenced
            raise
        if done:
            if not nreq.ok():
                status = nreq.status()
                if status[0] not in _OK:
                    raise translate(status[0], f"{op} failed: {status[1]}")
            return None
        # Still in flight: its buffer stays referenced until it completes.
        self._track(Request._from_native(nreq, locals_ or None, self))
        raise WaitTimeoutError(f"{op} did not complete within {wait} s")

    def _batch(self, op: str, items: Iterable, gather: bool = False, stream: Any = None) -> Request:
        locals_: list = []
        try:
            handle = _device.consumer_stream(stream)
            prepared = []
            for entry in items:
                if not isinstance(entry, tuple) or len(entry) != 4:
                    raise InvalidInputError(f"batch items are (region_id, key, offset, buffer) tuples, not {entry!r:.80}")
                prepared.append(self._item(op, *entry, None, locals_, handle))
            return self._post(op, prepared, locals_, f"{op}_batch", gather)
        except BaseException:
            for lb in locals_:
                lb.release()
            raise

    def get_async(self, region_id: int, key: bytes, offset: int, dst: Any, *, nbytes: int | None = None,
                  stream: Any = None) -> Request:
        """Read ``nbytes`` (all of ``dst`` by default) at ``offset`` of the region into ``dst``.

        Returns at once; the data is in ``dst`` when the :class:`Request`
        completes.  A refusal completes it with :class:`AccessDeniedError`
        (no such region, key not granted or revoked),
        :class:`OutOfBoundsError` or :class:`ClosedError`; nothing is
        written to ``dst`` then.

        For CUDA memory, the get first waits (in this thread) for the work
        queued on ``stream`` (a cuda.core ``Stream``, a CuPy or torch stream,
        or a raw handle) and on the stream ``dst`` names
        (``__cuda_array_interface__``), or on the legacy default stream when
        neither is named; a DLPack producer orders its work before it.  UCX
        copies on streams of its own; the request completes once its copy
        has landed in device memory, so work queued afterwards sees the bytes.

        Raises
        ------
        InvalidInputError
            For a malformed capability, offset or buffer (nothing is sent).
        ClosedError
            If the peer is closed.
        """
        return self._one("get", region_id, key, offset, dst, nbytes, stream=stream)

    def put_async(self, region_id: int, key: bytes, offset: int, src: Any, *, nbytes: int | None = None,
                  stream: Any = None) -> Request:
        """Write ``src`` at ``offset`` of the region.

        The request completes once the exporter has the bytes in the
        region's memory (no flush needed).  Refusals as in :meth:`get_async`,
        and :class:`AccessDeniedError` for a read-only region.  A put from
        CUDA memory first waits for the work queued before it, as a get does.
        """
        return self._one("put", region_id, key, offset, src, nbytes, stream=stream)

    def get(self, region_id: int, key: bytes, offset: int, dst: Any, timeout: float | None = None, *,
            nbytes: int | None = None, alive: Any = None, stream: Any = None) -> None:
        """:meth:`get_async` and wait (``timeout`` seconds; ``None`` waits until UCX
        completes or fails it).  Raises what the request failed with, or
        :class:`WaitTimeoutError` (the transfer stays in flight).  ``alive``
        (for the sharing API: the view's lease): asked every second of the
        wait whether the exporter still answers."""
        self._one("get", region_id, key, offset, dst, nbytes, _types.timeout(timeout), alive, stream)

    def put(self, region_id: int, key: bytes, offset: int, src: Any, timeout: float | None = None, *,
            nbytes: int | None = None, alive: Any = None, stream: Any = None) -> None:
        """:meth:`put_async` and wait, as :meth:`get`."""
        self._one("put", region_id, key, offset, src, nbytes, _types.timeout(timeout), alive, stream)

    def get_batch(self, items: Iterable[tuple[int, bytes, int, Any]], *, stream: Any = None) -> Request:
        """Post one get per ``(region_id, key, offset, dst)``; one request completes when all have.

        Each get reads ``len(dst)`` bytes.  The request fails with the first
        failure among them (the others still complete).  CUDA destinations
        are ordered as for :meth:`get_async`.
        """
        return self._batch("get", items, stream=stream)

    def put_batch(self, items: Iterable[tuple[int, bytes, int, Any]], *, host_regions: bool = False,
                  stream: Any = None) -> Request:
        """Post one put per ``(region_id, key, offset, src)``; one request for all, as :meth:`get_batch`.

        ``host_regions=True`` says that every region named is host memory:
        then consecutive puts of up to 256 KiB from host buffers travel
        together, up to 1 MiB of data per message, and the exporter copies
        each into its region.  The exporter refuses such an item for a
        region of other memory (:class:`InvalidInputError` for the batch).
        """
        if not isinstance(host_regions, bool):
            raise InvalidInputError("host_regions must be a bool")
        return self._batch("put", items, host_regions, stream)

    def forget_region(self, region_id: int) -> None:
        """Forget what this connection learnt of region ``region_id`` (that
        it is host memory, from the exporter's replies), once no view of
        this process uses the region any more: region ids are never reused,
        so what is learnt of regions gone would pile up.  A later reply
        about the region teaches it again; harmless on a closed peer."""
        _check_region_id(region_id)
        if not self._closed and os.getpid() == self._node.pid and not self._node.native.closed:
            self._native.forget_region(region_id)

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect (idempotent); requests in flight fail.  The next
        :meth:`Client.connect` to this address makes a new peer."""
        t = _types.timeout(timeout)
        if self._closed:
            return
        if os.getpid() == self._node.pid and not self._node.native.closed:
            self._shutdown(5.0 if t is None else t)
        self._closed = True

    def _shutdown(self, timeout: float) -> None:
        with self._node.lock:
            for addr, p in list(self._node.peers.items()):
                if p is self:
                    del self._node.peers[addr]
        super()._shutdown(timeout)

    def __repr__(self) -> str:
        return f"<gpushare._ucx.Peer {'closed' if self._closed else 'open'}>"


class Client:
    """This process's importer side; get it with :func:`client`."""

    __slots__ = ("_node",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("use gpushare._ucx._peer.client() for this process's Client")

    @classmethod
    def _make(cls, node: _Node) -> Client:
        self = object.__new__(cls)
        self._node = node
        return self

    def connect(self, address: bytes, timeout: float = 10.0) -> Peer:
        """The :class:`Peer` for an exporter's :attr:`Server.address`, connected.

        One connection per exporter: a second call with the same address
        returns the same peer while it is alive.

        Raises
        ------
        InvalidInputError
            If ``address`` is not a gpushare worker address.
        UCXConnectionError
            If the exporter does not answer within ``timeout`` seconds.
        """
        node = self._node
        n = node.check()
        t = _types.timeout(timeout)
        _, raw = unpack(address, ADDRESS_MAGIC, "worker address", MAX_ADDRESS)
        check_worker_address(raw, n.address())  # UCX reads it with no bounds
        with node.lock:
            cached = node.peers.get(raw)
        if cached is not None and cached.alive:
            return cached
        if cached is not None:
            cached.close(timeout=1.0)
        npeer = n.connect(raw)
        peer = Peer._make(node, npeer)
        # Wire the connection up before handing it out.
        try:
            Request._from_native(npeer.flush(None), None, peer).wait(t)
        except WaitTimeoutError:
            peer._shutdown(1.0)
            raise UCXConnectionError("UCS_ERR_TIMED_OUT", f"exporter did not answer within {timeout} s") from None
        except GpuShareError as exc:
            peer._shutdown(1.0)
            status = getattr(exc, "status", "UCS_ERR_UNREACHABLE")
            raise UCXConnectionError(status, f"cannot connect to exporter: {exc}") from None
        with node.lock:
            other = node.peers.get(raw)
            if other is not None and other.alive:
                keep = other
            else:
                node.peers[raw] = keep = peer
        if keep is not peer:
            peer._shutdown(1.0)
        return keep

    def __repr__(self) -> str:
        return f"<gpushare._ucx.Client pid={self._node.pid}>"


def client() -> Client:
    """This process's :class:`Client`, made on first use (in a forked child, anew, or
    :class:`UnsupportedError` where the parent had started UCX)."""
    return Client._make(_NODE.get())
