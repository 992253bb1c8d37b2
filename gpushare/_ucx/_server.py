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
import threading
import weakref
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
from .._process import PerProcess, wait_alive
from ._common import (
    ADDRESS_MAGIC,
    MAX_ADDRESS,
    MEMORY_TYPE_CODES,
    U64,
    Connection,
    Request,
    default_transports,
    mt_config,
    pack,
    unpack,
    wake_timeout_ms,
)
from . import _device
from ._address import check_worker_address
from ._loader import keep_forever, native

__all__ = ["Server", "Region", "Client", "Peer", "server", "client", "node_config", "KEY_BYTES"]

#: Length in bytes of a region key.
KEY_BYTES = 16
_CLOSE_TIMEOUT = 10.0
_OK = ("UCS_OK", "GS_OK")


# -- the process's node: one UCX context, one worker, one progress thread ------


def node_config() -> dict[str, str]:
    """UCX settings of the process's worker.

    The default transports (:func:`default_transports`) unless ``UCX_TLS``
    chooses; either way without ``cuda_ipc``, which maps one physical
    allocation per registered range and takes VMM memory only with fabric
    handles: over it a buffer of several allocations would expose its first
    one only.  Processes on one node share GPU memory over the mapped paths.
    """
    cfg: dict[str, str] = {}
    tls = os.environ.get("UCX_TLS")
    if tls is None:
        cfg["TLS"] = default_transports()
    elif not tls.startswith("^") and "cuda_ipc" in tls.split(","):
        cfg["TLS"] = ",".join(t for t in tls.split(",") if t != "cuda_ipc") or "tcp"
    cfg.update(mt_config())
    cfg.update(tcp_segment_config())
    return cfg


def tcp_segment_config() -> dict[str, str]:
    """Larger TCP segments than UCX's (8 KiB sent, 64 KiB received at a
    time): each segment costs a pass through UCX's TCP progress, which made
    a 1 MiB transfer take about 0.9 ms on loopback; 512 KiB / 1 MiB bring it
    to about 0.35 ms, and 64 KiB transfers to half their time.  The buffers
    come from pools that grow as needed; the processes' RSS grew by about
    1 MiB.  ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE`` in the
    environment win."""
    wanted = {"TCP_TX_SEG_SIZE": "512k", "TCP_RX_SEG_SIZE": "1m"}
    return {k: v for k, v in wanted.items() if "UCX_" + k not in os.environ}


#: Puts of more than this many bytes, up to 1 MiB, travel in parts of it.
PUT_PART = 512 * 1024


def put_part(cfg: dict[str, str]) -> int:
    """The part size of puts for a worker with settings ``cfg``; 0: whole.

    Over TCP with the segments of :func:`tcp_segment_config`, a part of
    512 KiB is one eager message that UCX sends from the caller's buffer
    and the exporter copies straight from its receive segment; a whole
    1 MiB put is copied into segments on both sides and reassembled on the
    exporter, and took about 20% longer on loopback.  Over any other
    transport (InfiniBand's eager messages are a few KiB) or other segment
    sizes, puts travel whole.
    """
    if "UCX_TCP_TX_SEG_SIZE" in os.environ or "UCX_TCP_RX_SEG_SIZE" in os.environ:
        return 0
    tls = cfg.get("TLS", os.environ.get("UCX_TLS", ""))
    names = set(tls.split(",")) - {""}
    if tls.startswith("^") or not names or not names <= {"tcp", "cuda_copy", "self"}:
        return 0
    return PUT_PART


class _Node:
    """This process's UCX worker, shared by its :class:`Server` and :class:`Client`."""

    def __init__(self) -> None:
        cfg = node_config()
        progress = os.environ.get("GPUSHARE_UCX_PROGRESS", "blocking")
        if progress not in ("blocking", "polling"):
            raise InvalidInputError(f"GPUSHARE_UCX_PROGRESS must be 'blocking' or 'polling', not {progress!r}")
        self.native = native().Node(cfg, progress == "polling", True,
                                    wake_timeout_ms(cfg.get("TLS", os.environ.get("UCX_TLS"))), put_part(cfg))
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.held: list[Any] = []  # buffers of regions whose transfers did not drain
        self.peers: dict[bytes, Peer] = {}

    def check(self) -> Any:
        if os.getpid() != self.pid:
            raise ClosedError(f"this UCX server/client belongs to process {self.pid}: UCX state does not survive "
                              "fork; in this process call server() or client() again (or open the share again)")
        if self.native.closed:
            raise ClosedError("the process's UCX node is closed")
        return self.native

    def stop(self) -> None:
        with self.lock:
            peers, self.peers = list(self.peers.values()), {}
        for p in peers:
            p._shutdown(1.0)
        self.native.close()
        with self.lock:
            held, self.held = self.held, []
        for lb in held:
            lb.release()


def _abandon(node: _Node) -> None:
    # No lock: a thread of the parent may have held it when the process forked.
    keep_forever(node.native)
    for p in list(node.peers.values()):
        keep_forever(p._native)


_NODE: PerProcess[_Node] = PerProcess(_Node, stop=_Node.stop, abandon=_abandon)


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


def _check_key(key: Any) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"a region key must be bytes, not {type(key).__name__}")
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise InvalidInputError(f"a region key is {KEY_BYTES} bytes, not {len(key)}")
    return key


class Server:
    """This process's region server: one UCX worker for every region it serves.

    Get it with :func:`server`.  Importers connect to :attr:`address` and
    present ``(region_id, key)`` capabilities; the server checks each request
    (region, key, range, read-only) before any byte moves.
    """

    __slots__ = ("_node",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("use gpushare._ucx.server() for this process's Server")

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


# -- importer side ---------------------------------------------------------------


def _check_region_id(region_id: Any) -> int:
    return _types.in_range(region_id, "region_id", 1)


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
        raise TypeError("use gpushare._ucx.client() for this process's Client")

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


def warm() -> None:
    """Start making this process's worker in the background, if there is none.

    For an importer about to ask an exporter for a ucx-rma offer: loading
    UCX here then overlaps the exporter's answer (which may load UCX there)
    instead of following it.  An error is not reported here: the
    :func:`client` call that needs the worker makes it again and raises."""
    if _NODE.current() is not None:
        return

    def make() -> None:
        try:
            _NODE.get()
        except BaseException:  # noqa: BLE001 - client() raises it where it matters
            pass

    threading.Thread(target=make, name="gpushare-ucx-load", daemon=True).start()
