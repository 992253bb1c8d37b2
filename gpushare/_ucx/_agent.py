"""UCX remote memory access: Agent, Endpoint and Request (MemoryHandle and RemoteKey in ``_registered``).

Policy lives here; ``_native`` only adapts libucxx.  See ``docs/ucx.md``.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import _buffers, _types
from .._ranges import Ranges
from .._errors import (
    ClosedError,
    GpuShareError,
    InvalidInputError,
    UCXConnectionError,
    WaitTimeoutError,
)
from . import _device
from ._address import PeerAddress, check_worker_address
from . import _plan
from ._batch import check_range
from ._common import (
    ADDRESS_MAGIC,
    KEY_MAGIC,
    MAX_ADDRESS,
    MAX_KEY,
    MEMORY_TYPE_CODES,
    MEMORY_TYPE_NAMES,
    PROGRESS_MODES,
    U64,
    Connection,
    Request,
    cuda_ipc_config,
    default_transports,
    mt_config,
    pack,
    report_callback_error,
    rma_config,
    unpack,
    user_callback,
    wake_timeout_ms,
)
from ._loader import check_memtype_config, keep_forever, native, without_registration_cache
from ._local import LocalPeer
from ._registered import MemoryHandle, RemoteKey, _alloc_ordinal, _free_allocated, zero_unused
from ._rkey import check_remote_key

__all__ = ["Agent", "Endpoint"]


def _shutdown_agent(pid: int, nagent: Any, endpoints: weakref.WeakSet, handles: weakref.WeakSet,
                    quarantine: list, lock: threading.Lock) -> None:
    """Close an agent's native state; also runs at interpreter exit.

    Holds the native objects, never the Agent itself.  In a forked child the
    parent's UCX state has none of its threads: it is left alone (leaked).
    """
    if os.getpid() != pid:
        return
    with lock:
        eps, mhs = list(endpoints), list(handles)
    for ep in eps:
        ep._shutdown(2.0)
    for mh in mhs:
        mh.close()
    try:
        nagent.close()
    except Exception:  # noqa: BLE001 - never fail in a finalizer
        report_callback_error("agent close")
        return  # leak the quarantined memory rather than free it under a live worker
    with lock:
        parked, quarantine[:] = list(quarantine), []
    for mm, local, nmh, ordinal in parked:
        if nmh is not None:
            _free_allocated(nmh, ordinal)
        if local is not None:
            local.release()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # the caller still holds views: the memory goes with the last of them


class Endpoint(Connection):
    """A connection to one peer agent; made by :meth:`Agent.connect`."""

    __slots__ = ("_agent", "_peer")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Endpoint objects are made by Agent.connect")

    @classmethod
    def _make(cls, agent: Agent, nep: Any, peer: PeerAddress) -> Endpoint:
        self = object.__new__(cls)
        self._init(nep)
        self._agent = agent
        self._peer = peer  # the peer's checked address: what its keys are read against
        return self

    def _check_open(self) -> Any:
        if self._closed:
            raise ClosedError("endpoint is closed")
        self._agent._check_usable()
        return self._native

    def unpack_remote_key(self, blob: bytes) -> RemoteKey:
        """Turn a peer's serialized key into a key usable on this endpoint.

        The blob is untrusted: its envelope, length, checksum and layout, and
        the packed UCX key inside it (see ``gpushare._ucx._rkey``), are
        checked before UCX parses it.

        Raises
        ------
        InvalidInputError
            If the blob is truncated, corrupted, foreign or from another
            version, or its packed key is not one gpushare accepts (keys
            of shared-memory or cuda_ipc transports are accepted only on an
            endpoint connected with ``local_peer``, and only naming that
            peer's own memory).
        UnsupportedError
            If this agent's own transports make keys gpushare would refuse
            from a peer (``UCX_TLS``).
        """
        n = self._check_open()
        mtype, payload = unpack(blob, KEY_MAGIC, "remote key", MAX_KEY)
        if mtype not in MEMORY_TYPE_NAMES:
            raise InvalidInputError(f"remote key names unknown memory type {mtype}")
        problem = native().remote_key_problem(payload)
        if problem:
            raise InvalidInputError(f"remote key is malformed: {problem}")
        base, size = native().serialized_remote_key_range(payload)
        if size == 0 or base + size > U64:
            raise InvalidInputError(f"remote key covers an impossible range: base 0x{base:x}, size {size}")
        check_remote_key(payload, mtype, self._agent, self._peer, (base, size))  # UCX reads it with no bounds
        nkey = n.unpack_remote_key(payload)
        return RemoteKey._make(native_key=nkey, blob=None, base=base, size=size,
                               memory_type=MEMORY_TYPE_NAMES[mtype], endpoint=self)

    def _submit(self, op: str, buffer: Any, remote_address: int, rkey: RemoteKey,
                callback: Callable | None, callback_data: Any, nbytes: int | None, stream: Any) -> Request:
        n = self._check_open()
        self._check_key(rkey)
        if type(remote_address) is not int or not 0 <= remote_address < 1 << 64:
            _types.in_range(remote_address, "remote_address")  # raises
        if callback is not None and not callable(callback):
            raise InvalidInputError("callback must be callable or None")
        consumer = None if stream is None else _device.consumer_stream(stream)
        local = _device.resolve(buffer, writable=(op == "get"), stream=consumer)
        try:
            if nbytes is None:
                nbytes = local.nbytes
            else:
                _types.in_range(nbytes, "nbytes")
                if nbytes > local.nbytes:
                    raise InvalidInputError(
                        f"buffer holds {local.nbytes} bytes; the {op} needs {nbytes}"
                    )
            check_range(op, remote_address, nbytes, rkey._base, rkey._base + rkey._size)
            holder: list[Request] = []
            on_done = None if callback is None else user_callback(callback, callback_data, holder, op)

            method = n.mem_put if op == "put" else n.mem_get
            # UCX copies CUDA memory on streams of its own: after the work
            # queued before the transfer (see _device).
            _device.order_before(local, consumer)
            memh = self._agent._registration(local.address, nbytes, local.memory_type)
            if local.memory_type == "host":
                nreq = method(local.address, nbytes, remote_address, rkey._native, 0, memh, None)
            else:
                with _device.on_memory_device(local):
                    nreq = method(local.address, nbytes, remote_address, rkey._native,
                                  MEMORY_TYPE_CODES[local.memory_type], memh, None)
        except BaseException:
            local.release()
            raise
        return self._request(nreq, local, on_done, holder)

    def _check_key(self, rkey: RemoteKey) -> None:
        if not isinstance(rkey, RemoteKey) or rkey._endpoint is not self:
            raise InvalidInputError("rkey must be a RemoteKey unpacked on this endpoint (Endpoint.unpack_remote_key)")
        rkey._check_open()

    def _request(self, nreq: Any, held: Any, on_done: Callable[[], None] | None, holder: list) -> Request:
        """The Request of native request ``nreq``, holding ``held`` (its local buffers) until done."""
        req = Request._from_native(nreq, held, self)
        if on_done is not None:
            holder.append(req)
            nreq.add_callback(on_done)
        return self._track(req)

    def mem_put(self, buffer: Any, remote_address: int, rkey: RemoteKey,
                callback: Callable[[GpuShareError | None, Any], Any] | None = None,
                callback_data: Any = None, *, nbytes: int | None = None, stream: Any = None) -> Request:
        """Write ``buffer`` to ``[remote_address, remote_address + nbytes)`` in the peer.

        Completion is local: the buffer may be reused once the request is
        done, but the data is guaranteed to be in the peer's memory only
        after a later :meth:`flush` completes.

        Parameters
        ----------
        buffer
            Source: host (buffer protocol) or CUDA memory.
        remote_address : int
            Target address inside the key's region.
        rkey : RemoteKey
            A key unpacked on this endpoint.
        callback : callable, optional
            ``callback(error, callback_data)`` on completion, ``error`` being
            ``None`` on success.  Runs in the progress thread, or at once in
            this thread if the put completes immediately.
        callback_data
            Passed to ``callback``.
        nbytes : int, optional
            Bytes to write; all of ``buffer`` by default.
        stream : optional
            For CUDA memory: the stream whose queued work the transfer must
            follow (a cuda.core ``Stream``, a CuPy or torch stream, or a raw
            handle).  The transfer waits, in this thread, for the work queued
            there and on the stream ``buffer`` names
            (``__cuda_array_interface__``), or on the legacy default stream
            when neither is named; a DLPack producer orders its work before
            it.  UCX copies on streams of its own.

        Raises
        ------
        OutOfBoundsError
            If the range falls outside the key's region (nothing is sent).
        InvalidInputError
            For a bad buffer, a key from another endpoint, or ``nbytes``
            larger than the buffer.
        ClosedError
            If the endpoint or agent is closed.
        """
        return self._submit("put", buffer, remote_address, rkey, callback, callback_data, nbytes, stream)

    def mem_get(self, buffer: Any, remote_address: int, rkey: RemoteKey,
                callback: Callable[[GpuShareError | None, Any], Any] | None = None,
                callback_data: Any = None, *, nbytes: int | None = None, stream: Any = None) -> Request:
        """Read ``[remote_address, remote_address + nbytes)`` from the peer into ``buffer``.

        The data is in ``buffer`` when the request completes (for CUDA
        memory: in device memory, so work queued afterwards on any stream
        sees it).  Arguments and errors as in :meth:`mem_put`; ``buffer``
        must be writable.
        """
        return self._submit("get", buffer, remote_address, rkey, callback, callback_data, nbytes, stream)

    def mem_put_batch(self, items: Iterable[tuple[Any, int]], rkey: RemoteKey,
                      callback: Callable[[GpuShareError | None, Any], Any] | None = None,
                      callback_data: Any = None, *, stream: Any = None, flush: bool = False) -> Request:
        """Write each ``(buffer, remote_address)`` of ``items`` to the peer, as one request.

        One call posts every put (one request of UCX's each), without the
        GIL: what many small puts cost in Python is paid once.  The request
        is done when every put is, and fails with the first put's failure.
        Completion is local, as for :meth:`mem_put`: the data is in the
        peer's memory after a later :meth:`flush`, or when the request
        completes with ``flush=True`` (a flush posted behind the puts, in
        the same call).

        Parameters
        ----------
        items : iterable of (buffer, int)
            Up to 65,536 (:data:`MAX_BATCH_ITEMS`) pairs of a source
            buffer, as :meth:`mem_put` takes one, and its target address
            inside the key's region.  All host memory, or all CUDA memory on
            one device.
        rkey, callback, callback_data, stream
            As for :meth:`mem_put` (``stream`` orders the work before every
            put of the batch).
        flush : bool
            Complete at the peer (default: local completion); an empty
            batch with it completes once every put posted on the endpoint
            before it has.

        Raises
        ------
        OutOfBoundsError
            If any range falls outside the key's region (nothing is sent).
        InvalidInputError
            For an item that is no pair, a bad buffer, mixed memory types or
            devices, more than :data:`MAX_BATCH_ITEMS` items, or a
            ``flush`` that is no bool (nothing is sent).
        ClosedError
            If the endpoint or agent is closed.
        """
        return _plan.post_once(self, "put", items, rkey, callback, callback_data, stream, flush)

    def mem_get_batch(self, items: Iterable[tuple[Any, int]], rkey: RemoteKey,
                      callback: Callable[[GpuShareError | None, Any], Any] | None = None,
                      callback_data: Any = None, *, stream: Any = None) -> Request:
        """Read into each ``(buffer, remote_address)`` of ``items`` from the peer, as one request.

        The data is in every buffer when the request completes.  Arguments
        and errors as in :meth:`mem_put_batch`; the buffers must be
        writable.
        """
        return _plan.post_once(self, "get", items, rkey, callback, callback_data, stream)

    def prepare_put_batch(self, items: Iterable[tuple[Any, int]], rkey: RemoteKey) -> _plan.BatchPlan:
        """The puts of ``items`` to the peer, resolved and checked now, posted by each
        :meth:`BatchPlan.post <gpushare.ucx.BatchPlan.post>` as one request.

        Items and errors as in :meth:`mem_put_batch`, raised here (nothing is sent).  The plan
        keeps the buffers referenced until it is closed; each post sends their contents then.
        """
        return _plan.prepare(self, "put", items, rkey, None)

    def prepare_get_batch(self, items: Iterable[tuple[Any, int]], rkey: RemoteKey) -> _plan.BatchPlan:
        """The gets of ``items`` from the peer, as :meth:`prepare_put_batch`; the buffers must be
        writable."""
        return _plan.prepare(self, "get", items, rkey, None)

    def flush(self, callback: Callable[[GpuShareError | None, Any], Any] | None = None,
              callback_data: Any = None) -> Request:
        """Complete every earlier put and get on this endpoint at the peer."""
        n = self._check_open()
        if callback is not None and not callable(callback):
            raise InvalidInputError("callback must be callable or None")
        nreq = n.flush(None)
        req = Request._from_native(nreq, None, self)
        if callback is not None:
            nreq.add_callback(user_callback(callback, callback_data, [req], "flush"))
        return req

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what is in flight and disconnect (idempotent).

        Requests still in flight fail with :class:`UCXCanceledError` (or a
        connection error).  Waits at most ``timeout`` seconds.
        """
        t = _types.timeout(timeout)
        if self._closed:
            return
        if self._agent._usable():
            self._shutdown(5.0 if t is None else t)
        self._closed = True

    def __repr__(self) -> str:
        return f"<gpushare.ucx.Endpoint {'closed' if self._closed else 'open'}>"


#: Agents of this process; in a forked child their native objects are kept,
#: never destroyed (see :func:`keep_forever`).
_live_agents: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for agent in list(_live_agents):
        if agent._pid == os.getpid():
            continue
        keep_forever(agent._native)
        for obj in list(agent._endpoints) + list(agent._handles):
            keep_forever(obj._native)


os.register_at_fork(after_in_child=_after_fork_in_child)


class Agent:
    """One UCX context and worker, progressed as the region server's is.

    The worker has one progress thread of gpushare's progress engine (named
    ``gpushare-ucx``), and a thread waiting on a request progresses the
    worker itself meanwhile, so that its answer needs no hand-over between
    threads; callbacks run in the progress thread, outside UCX's progress.

    Parameters
    ----------
    progress : {"blocking", "polling"}
        How the progress thread drives UCX when nobody waits.  ``"blocking"``
        (default) polls briefly after activity, then sleeps in the kernel
        until there is work: no idle CPU use.  ``"polling"`` spins: lowest
        latency, one busy core per agent.
    error_handling : bool
        Detect peer failure (default).  Requests toward a dead peer fail with
        :class:`UCXConnectionError` instead of hanging.  UCX's cross-memory
        attach transport (``cma``) cannot be used with it; pass ``False`` to
        allow it on one node, at the price of no failure detection.
    transports : str, optional
        UCX transport list (``UCX_TLS``), for example ``"tcp"`` or
        ``"sm,self"``.  When omitted (and ``UCX_TLS`` is not set): with
        error handling, TCP (and ``cuda_copy`` on a machine with an NVIDIA
        driver), since error handling rules out the shared-memory
        transports and opening them only costs time, memory and file
        descriptors; without it, UCX chooses.
    config : mapping, optional
        Further UCX settings, by name without the ``UCX_`` prefix.  ``UCX_*``
        environment variables apply as usual.  Agents run with rendezvous
        off (``RNDV_THRESH=inf``: TCP puts are zero-copy with error
        handling), wire-up on the active-message lane
        (``WIREUP_VIA_AM_LANE=y``) and, where no transport is shared
        memory, UCX's adaptive progress off (``ADAPTIVE_PROGRESS=n``: a
        peer's puts reach the worker without UCX's async thread) unless
        ``config`` or the environment says otherwise (docs/ucx.md).  ``MEMTYPE_CACHE`` is one
        setting of the whole process in UCX, which gpushare sets to ``n``
        when it loads UCX (``UCX_MEMTYPE_CACHE`` in the environment wins):
        a value other than the process's is refused with
        :class:`InvalidInputError`.

    Notes
    -----
    Peers connect to each other with :attr:`address`.  Both sides must keep
    their agent open while the other accesses its memory: on TCP and shared
    memory the exporter's progress thread carries out remote puts and gets.
    """

    def __init__(self, *, progress: str = "blocking", error_handling: bool = True,
                 transports: str | None = None, config: Mapping[str, str] | None = None) -> None:
        if progress not in PROGRESS_MODES:
            raise InvalidInputError(f"progress must be one of {PROGRESS_MODES}, not {progress!r}")
        if not isinstance(error_handling, bool):
            raise InvalidInputError("error_handling must be a bool")
        cfg: dict[str, str] = {}
        for key, value in (config or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidInputError("config keys and values must be str")
            cfg[key.removeprefix("UCX_")] = value
        if transports is not None:
            if not isinstance(transports, str) or not transports:
                raise InvalidInputError("transports must be a non-empty str such as 'tcp'")
            cfg["TLS"] = transports
        elif "TLS" not in cfg and error_handling and "UCX_TLS" not in os.environ:
            cfg["TLS"] = default_transports()
        tls = cfg.get("TLS", os.environ.get("UCX_TLS"))
        for key, value in (mt_config() | cuda_ipc_config() | rma_config(tls)).items():
            cfg.setdefault(key, value)
        check_memtype_config(cfg)  # one setting per process: see _loader.choose_memtype_cache
        self._progress = progress
        self._error_handling = error_handling
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._quarantine: list = []
        #: Closed handles of gpushare's host memory whose pages turn to zeros
        #: once this process's transfers no longer use them (_registered._park).
        self._zero_later: list = []
        self._endpoints: weakref.WeakSet[Endpoint] = weakref.WeakSet()
        self._handles: weakref.WeakSet[MemoryHandle] = weakref.WeakSet()
        # The handle a transfer found its local range in last (see _registration).
        self._last_registration: Callable[[], MemoryHandle | None] = lambda: None
        #: The handles' ranges, sorted (see _register).
        self._ranges = Ranges(lambda mh: not mh.closed)
        self._native = native().Agent(cfg, progress == "polling", error_handling,
                                      wake_timeout_ms(tls),
                                      without_registration_cache(cfg))
        self._address = None
        self._finalizer = weakref.finalize(
            self, _shutdown_agent, self._pid, self._native, self._endpoints, self._handles,
            self._quarantine, self._lock,
        )
        _live_agents.add(self)

    # -- state ---------------------------------------------------------------

    def _usable(self) -> bool:
        return self._finalizer.alive and os.getpid() == self._pid

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise ClosedError(
                f"this agent belongs to process {self._pid}; UCX state does not survive fork. "
                "Create a new gpushare.ucx.Agent in the child"
            )
        if not self._finalizer.alive:
            raise ClosedError("agent is closed")

    @property
    def progress_mode(self) -> str:
        return self._progress

    @property
    def error_handling(self) -> bool:
        return self._error_handling

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def address(self) -> bytes:
        """Bytes a peer passes to :meth:`connect` to reach this agent."""
        self._check_usable()
        if self._address is None:
            raw = self._native.address()
            self._address = pack(ADDRESS_MAGIC, 0, raw)
        return self._address

    def info(self) -> str:
        """UCX's description of this worker."""
        self._check_usable()
        return self._native.info()

    # -- operations ----------------------------------------------------------

    def connect(self, peer_address: bytes, *, timeout: float = 10.0, local_peer: LocalPeer | None = None) -> Endpoint:
        """Connect to a peer agent; the endpoint is usable when this returns.

        Parameters
        ----------
        peer_address : bytes
            The peer agent's :attr:`address`.
        timeout : float
            Seconds to wait for the connection.
        local_peer : LocalPeer, optional
            The peer as the kernel proved it (:meth:`LocalPeer.from_socket` on
            a Unix socket to it): admits the peer's one-node transports
            (shared memory, CMA, cuda_ipc) in its address and keys, checked to
            name that process's own memory.  Without it they are refused.

        Raises
        ------
        InvalidInputError
            If ``peer_address`` is not a gpushare agent address, or names what
            it may not (see docs/security.md).
        UCXConnectionError
            If the peer cannot be reached within ``timeout`` seconds.
        """
        self._check_usable()
        t = _types.timeout(timeout)
        _, raw = unpack(peer_address, ADDRESS_MAGIC, "agent address", MAX_ADDRESS)
        if local_peer is not None and not isinstance(local_peer, LocalPeer):
            raise InvalidInputError(f"local_peer must be a gpushare.ucx.LocalPeer, not {type(local_peer).__name__}")
        peer = check_worker_address(raw, self._native.address(), local_peer)  # UCX reads it with no bounds
        nep = self._native.connect(raw)
        ep = Endpoint._make(self, nep, peer)
        # Wire the connection up before handing it out: unpacking a remote key
        # on an endpoint that is not connected yet is unsafe in UCX.
        try:
            ep.flush().wait(t)
        except WaitTimeoutError:
            ep.close(timeout=1.0)
            raise UCXConnectionError("UCS_ERR_TIMED_OUT", f"peer did not answer within {timeout} s") from None
        except GpuShareError as exc:
            ep.close(timeout=1.0)
            status = getattr(exc, "status", "UCS_ERR_UNREACHABLE")
            raise UCXConnectionError(status, f"cannot connect to peer: {exc}") from None
        with self._lock:
            self._endpoints.add(ep)
        return ep

    def _zero_unused(self) -> None:
        """Turn to zeros the memory of closed handles no transfer uses any more (each transfer
        does this first; see MemoryHandle.close)."""
        if self._zero_later:
            zero_unused(self._lock, self._zero_later)

    def _registration(self, address: int, nbytes: int, memory_type: str) -> Any:
        """The native memory handle of this agent's that registers the local
        range, or None (the transfer then registers it for itself).  The
        handle found last is asked first (a caller usually moves data from
        one registered buffer)."""
        self._zero_unused()
        last = self._last_registration()
        if last is not None:
            nmh = last._covering(address, nbytes, memory_type)
            if nmh is not None:
                return nmh
        # The handles' ranges, read without the lock (see gpushare._ranges).
        for ref in self._ranges.candidates(address, nbytes, memory_type):
            mh = ref()
            if mh is not None and (nmh := mh._covering(address, nbytes, memory_type)) is not None:
                self._last_registration = ref
                return nmh
        return None

    def _register(self, mh: MemoryHandle) -> None:
        """Count ``mh`` among the agent's handles, and add its range to those a transfer looks
        its local buffer up in (sorted: :class:`gpushare._ranges.Ranges`, which prunes the entries of
        handles closed or dropped as it grows)."""
        with self._lock:
            self._handles.add(mh)
            self._ranges.add(*mh._range, mh._memory_type, weakref.ref(mh))

    def create_memory_handle(self, size: int, buffer: Any = None, memory_type: str | None = None) -> MemoryHandle:
        """Register memory for remote access; mirrors ``ucxx::createMemoryHandle``.

        Parameters
        ----------
        size : int
            Bytes to register (at least 1).  With a ``buffer``, at most its size.
        buffer : optional
            Memory to register: host (buffer protocol) or CUDA
            (``__cuda_array_interface__``, DLPack, cuda.core ``Buffer``).
            ``None`` allocates: host memory rounded up to whole pages, or CUDA
            memory through UCX (on the calling thread's current device, else
            device 0; no context needs to be current);
            :attr:`MemoryHandle.size` says how much.
        memory_type : {"host", "cpu", "cuda"}, optional
            Inferred from ``buffer`` when omitted (``"host"`` without one); a
            value that contradicts the buffer is an error.  ``"cpu"`` is a
            synonym of ``"host"``.
        """
        self._check_usable()
        _types.in_range(size, "size", 1, 1 << 48)
        if memory_type == "cpu":
            memory_type = "host"
        if memory_type is not None and memory_type not in MEMORY_TYPE_CODES:
            raise InvalidInputError(f"memory_type must be 'host' (or 'cpu') or 'cuda', not {memory_type!r}")
        n = native()
        mm = None
        local = None
        ordinal: int | None = None
        if buffer is None:
            mtype = memory_type or "host"
            if mtype == "host":
                length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
                mm = mmap.mmap(-1, length)
                pin = n.PinnedBuffer(mm, True)
                local = _buffers.LocalBuffer(pin.address, length, "host", False, mm, pin)
                address, reg_size = pin.address, length
            else:
                address, reg_size = 0, size
                ordinal = _alloc_ordinal()
        else:
            local = _buffers.resolve(buffer, writable=False)
            mtype = local.memory_type
            if memory_type is not None and memory_type != mtype:
                local.release()
                raise InvalidInputError(f"memory_type={memory_type!r} but the buffer is {mtype} memory")
            if size > local.nbytes:
                local.release()
                raise InvalidInputError(f"size is {size} but the buffer holds only {local.nbytes} bytes")
            address, reg_size = local.address, size
        try:
            if mtype == "cuda" and local is not None:
                ordinal = _device.ordinal_of(local)
            # UCX allocates CUDA memory, and registers it, under the device's
            # primary context (see _device); the caller's stays current.
            with _device.on_memory_device(None, ordinal if mtype == "cuda" else None):
                nmh = self._native.create_memory_handle(reg_size, address, MEMORY_TYPE_CODES[mtype])
        except BaseException:
            if local is not None:
                local.release()
            if mm is not None:
                mm.close()
            raise
        mh = MemoryHandle._make(self, nmh, local, mm, mtype, ordinal if mtype == "cuda" else None)
        self._register(mh)
        return mh

    def close(self) -> None:
        """Disconnect every endpoint, unregister every handle, stop progress (idempotent).

        Requests in flight fail.  Memory kept reserved after
        :meth:`MemoryHandle.close` is released here, once the worker can no
        longer receive remote operations.  In a process forked from the one
        that made the agent this only marks it closed.
        """
        self._finalizer()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self._progress
        return f"<gpushare.ucx.Agent {state} error_handling={self._error_handling}>"
