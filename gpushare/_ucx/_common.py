"""What the Agent (``_agent``) and the region server (``_server``) share:
worker configuration (transports, progress, locking), the envelope of
addresses and keys that cross processes (pack/unpack), the reporting of
callback errors, :class:`Request` and the :class:`Connection` base of their
endpoints.  Arguments are checked with :mod:`gpushare._types`."""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import threading
import types
import zlib
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

from .. import _buffers, _types
from .._errors import GpuShareError, InvalidInputError, WaitTimeoutError, translate
from ._loader import infiniband_present, knows_setting

__all__ = [
    "PROGRESS_MODES",
    "ADDRESS_MAGIC",
    "KEY_MAGIC",
    "MAX_ADDRESS",
    "MAX_KEY",
    "U64",
    "MEMORY_TYPE_CODES",
    "MEMORY_TYPE_NAMES",
    "default_transports",
    "mt_config",
    "rma_config",
    "wake_timeout_ms",
    "pack",
    "unpack",
    "user_callback",
    "report_callback_error",
    "Request",
    "Connection",
]

#: Progress modes an :class:`Agent` accepts.
PROGRESS_MODES = ("blocking", "polling")

ADDRESS_MAGIC = b"GSUA"
KEY_MAGIC = b"GSRK"
_FORMAT_VERSION = 1
# magic(4) | version(u16) | memory type(u16) | payload length(u32) | crc32(u32)
_HEADER = struct.Struct("<4sHHII")
MAX_ADDRESS = 1 << 16  # a UCX worker address is a few hundred bytes
MAX_KEY = 1 << 16  # a packed remote key is tens to hundreds of bytes
U64 = (1 << 64) - 1
MEMORY_TYPE_CODES = {"host": 0, "cuda": 1}
MEMORY_TYPE_NAMES = {0: "host", 1: "cuda", 2: "cuda"}


# Transports whose interfaces wake a worker's event fd for every completion
# and arrival: a blocking progress thread may sleep without a timeout on them.
_WAKING_TRANSPORTS = frozenset({"tcp", "cuda_copy", "cuda_ipc", "ib"})


def _cuda_driver_present() -> bool:
    """Whether this process can load a CUDA driver (without initialising it)."""
    if os.path.exists("/dev/nvidiactl"):
        return True
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_LOCAL)
    except OSError:
        return False
    return True


def default_transports() -> str:
    """``UCX_TLS`` for a worker with error handling: TCP; InfiniBand and
    RoCE (``ib``) where this node has such devices; and ``cuda_copy`` (GPU
    memory staged by the copy engines) where a CUDA driver is present.

    Shared-memory transports and CMA are left out (they cannot wake a
    sleeping worker, and error handling rules CMA out), and so is
    ``cuda_ipc``: it maps one physical allocation per registered range and
    takes VMM memory only with fabric handles, so over it a buffer of several
    allocations would expose its first one only.  Processes on one node
    share GPU memory over the mapped paths instead."""
    tls = ["tcp"]
    if infiniband_present():
        tls.insert(0, "ib")
    if _cuda_driver_present():
        tls.append("cuda_copy")
    return ",".join(tls)


def mt_config() -> dict[str, str]:
    """Settings for a worker that several threads call into.

    UCX guards such a worker with a spinlock by default; with the progress
    thread and callers contending on a busy machine a preempted holder makes
    the other spin for a whole time slice (milliseconds per small request).
    A mutex sleeps instead.  ``UCX_USE_MT_MUTEX`` in the environment wins.
    """
    return {} if "UCX_USE_MT_MUTEX" in os.environ else {"USE_MT_MUTEX": "y"}


def rma_config(tls: str | None = None) -> dict[str, str]:
    """Settings under which an agent's puts are remote memory access, with error handling;
    ``tls``: the agent's transport list (``UCX_TLS``; None: UCX's choice).

    With peer error handling and rendezvous on, UCX 1.21 admits a transport
    as a lane for bulk remote memory access only if its memory domain can
    invalidate remote access, which TCP's cannot: every TCP put was then
    emulated with active messages the peer copies in (openucx/ucx issue
    11929).  An agent sends nothing by rendezvous (its puts and gets are
    remote memory access), so rendezvous is off (``RNDV_THRESH=inf``, as
    NIXL sets it) and TCP puts are zero-copy.  Wire-up then travels on the
    endpoint's active-message lane (``WIREUP_VIA_AM_LANE=y``): where a
    second TCP device added a lane, UCX sent wire-up on that device's
    connection, and the peer's TCP transport dropped a zero-copy put that
    arrived while it paired the connections, resetting the endpoint.

    Where every transport of ``tls`` wakes a sleeping worker (TCP,
    InfiniBand, the CUDA transports, and ``self``: no shared memory),
    adaptive progress is off (``ADAPTIVE_PROGRESS=n``; measured over TCP
    only, on InfiniBand each progress pass then also polls its interfaces).  With it, UCX keeps an interface that has
    received no active message out of the worker's progress, and an agent
    that is only the target of puts (an exporter) never receives one: each
    burst of a peer's puts then reached its worker through UCX's async
    thread, a wake-up and a context switch per burst, with the puts'
    acknowledgements held back meanwhile (64 KiB TCP puts moved 1.2 to 2.6
    GB/s with it and 3.1 to 3.2 without, in alternating runs).  With
    shared-memory transports in the list it stays on: every progress pass
    would also poll the TCP interfaces, which slowed one-node transfers by
    9 to 17 %.  ``UCX_RNDV_THRESH`` / ``UCX_WIREUP_VIA_AM_LANE`` /
    ``UCX_ADAPTIVE_PROGRESS`` in the environment win.
    """
    wanted = {"RNDV_THRESH": "inf", "WIREUP_VIA_AM_LANE": "y"}
    if _without_shared_memory(tls):
        wanted["ADAPTIVE_PROGRESS"] = "n"
    return {k: v for k, v in wanted.items() if "UCX_" + k not in os.environ}


def cuda_ipc_config() -> dict[str, str]:
    """Gets over ``cuda_ipc`` on every machine.  UCX 1.21 turns them off by default on machines
    where it finds no NVLink between GPUs (one H200, PCIe), and a get of CUDA memory then falls to
    TCP: 0.3-0.4 GB/s on the H200, where ``cuda_ipc`` gets copy at device speed.  Set only where
    UCX has the cuda_ipc transport (a CUDA driver); ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` in the
    environment wins."""
    if "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in os.environ or not knows_setting("CUDA_IPC_ENABLE_GET_ZCOPY", "y"):
        return {}
    return {"CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def _without_shared_memory(tls: str | None) -> bool:
    """Whether transport list ``tls`` names transports that all wake a sleeping worker (``self``,
    which delivers in the sender's own thread, aside), so none of shared memory; False for UCX's
    own choice (None, ``all``, a list of exclusions)."""
    if not tls or tls.startswith("^"):
        return False
    names = {t.strip().lower() for t in tls.split(",")} - {"self"}
    return bool(names) and names <= _WAKING_TRANSPORTS


def wake_timeout_ms(tls: str | None) -> int:
    """epoll timeout of a blocking progress thread for transport list ``tls``.

    -1 (sleep until an event) when every transport wakes the worker (``self``, which delivers
    in the sender's own thread, aside: :func:`_without_shared_memory`, the rule adaptive
    progress follows too); 1 ms otherwise: shared-memory transports deliver without waking a
    sleeper.
    """
    return -1 if _without_shared_memory(tls) else 1


def pack(magic: bytes, memory_type: int, payload: bytes) -> bytes:
    return _HEADER.pack(magic, _FORMAT_VERSION, memory_type, len(payload), zlib.crc32(payload)) + payload


def unpack(blob: Any, magic: bytes, what: str, limit: int) -> tuple[int, bytes]:
    """Check an envelope from another process; return (memory type, payload)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"{what} must be bytes, not {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _HEADER.size:
        raise InvalidInputError(f"{what} is {len(blob)} bytes; at least {_HEADER.size} expected")
    got_magic, version, mtype, length, crc = _HEADER.unpack_from(blob)
    if got_magic != magic:
        raise InvalidInputError(f"not a gpushare {what}: starts with {got_magic!r}, expected {magic!r}")
    if version != _FORMAT_VERSION:
        raise InvalidInputError(f"{what} has format version {version}; this gpushare reads version {_FORMAT_VERSION}")
    payload = blob[_HEADER.size :]
    if length > limit or len(payload) != length:
        raise InvalidInputError(f"{what} says {length} payload bytes; {len(payload)} came (limit {limit})")
    if zlib.crc32(payload) != crc:
        raise InvalidInputError(f"{what} is corrupted: checksum mismatch")
    return mtype, payload


def user_callback(callback: Callable, data: Any, holder: list, op: str) -> Callable[[], None]:
    """``callback(error, data)`` for the request that ``holder`` will hold."""

    def run() -> None:
        try:
            callback(holder[0]._error() if holder else None, data)
        except Exception:
            report_callback_error(op)

    return run


def report_callback_error(where: str) -> None:
    """Report the exception being handled through sys.unraisablehook."""
    exc = sys.exc_info()[1]
    sys.unraisablehook(
        types.SimpleNamespace(
            exc_type=type(exc),
            exc_value=exc,
            exc_traceback=exc.__traceback__ if exc is not None else None,
            err_msg=f"Exception ignored in gpushare {where} callback",
            object=None,
        )
    )


class Request:
    """A non-blocking operation (put, get or flush) in flight.

    Made by :meth:`Endpoint.mem_put`, :meth:`Endpoint.mem_get`, their
    batches (:meth:`Endpoint.mem_put_batch`, :meth:`Endpoint.mem_get_batch`,
    :meth:`BatchPlan.post`) and :meth:`Endpoint.flush`; not constructed by
    users.  It can be waited on,
    polled, given callbacks, and awaited from asyncio.  The local buffer stays
    referenced until the request completes.
    """

    __slots__ = ("_native", "_buffer", "_endpoint", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Request objects are made by Endpoint.mem_put/mem_get/mem_put_batch/mem_get_batch/flush "
                        "and BatchPlan.post")

    @classmethod
    def _from_native(cls, nreq: Any, buffer: _buffers.LocalBuffer | None, endpoint: Connection) -> Request:
        self = object.__new__(cls)
        self._native = nreq
        self._buffer = buffer
        self._endpoint = endpoint
        return self

    @property
    def kind(self) -> str:
        """``"put"``, ``"get"`` or ``"flush"``."""
        return self._native.kind

    def done(self) -> bool:
        """Whether the request has completed (successfully or not)."""
        done = self._native.done()
        if done and self._buffer is not None:
            self._buffer = None  # the transfer no longer touches it
        return done

    def _error(self) -> GpuShareError | None:
        status = self._native.status()
        if status is None or status[0] == "UCS_OK":
            return None
        name, message = status
        return translate(name, f"{self.kind} failed: {message}")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the request completes.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; ``None`` waits until UCX completes or fails the
            request (a dead peer fails it).

        Raises
        ------
        WaitTimeoutError
            If ``timeout`` passes first; the request stays in flight.
        UCXError
            If the request failed.
        """
        t = _types.timeout(timeout)
        if not self._native.wait(-1.0 if t is None else t):
            raise WaitTimeoutError(f"{self.kind} did not complete within {timeout} s")
        self._buffer = None
        if self._native.ok():
            return
        err = self._error()
        if err is not None:
            raise err

    def exception(self, timeout: float | None = None) -> GpuShareError | None:
        """Wait like :meth:`wait` and return the request's error, or ``None``."""
        t = _types.timeout(timeout)
        if not self._native.wait(-1.0 if t is None else t):
            raise WaitTimeoutError(f"{self.kind} did not complete within {timeout} s")
        return self._error()

    def add_done_callback(self, fn: Callable[[Request], Any]) -> None:
        """Call ``fn(request)`` when the request completes.

        It runs in the agent's progress thread, or at once in this thread if
        the request has already completed.  Exceptions it raises are reported
        through :func:`sys.unraisablehook`.
        """
        if not callable(fn):
            raise InvalidInputError("callback must be callable")
        ref = self

        def run() -> None:
            try:
                fn(ref)
            except Exception:
                report_callback_error("done")

        self._native.add_callback(run)

    def __await__(self) -> Generator[Any, None, Request]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def wake() -> None:
            def settle() -> None:
                if not fut.done():
                    fut.set_result(None)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass  # the loop closed; nobody is awaiting any more

        self._native.add_callback(wake)
        yield from fut.__await__()
        self._buffer = None
        err = self._error()
        if err is not None:
            raise err
        return self

    def __repr__(self) -> str:
        state = "done" if self._native.done() else "pending"
        return f"<gpushare.ucx.Request {self.kind} {state}>"


#: How many requests an endpoint keeps beyond twice those of its last sweep before it sweeps
#: done ones from anywhere in its list.
_SWEEP_SLACK = 64


class Connection:
    """What :class:`Endpoint` and the region server's ``Peer`` share: a native
    endpoint, the requests in flight (whose buffers stay referenced), close."""

    __slots__ = ("_native", "_inflight", "_sweeping", "_closed", "_lock", "__weakref__")

    def _init(self, native_ep: Any) -> None:
        self._native = native_ep
        self._inflight: deque[Request] = deque()
        #: When _track drops every done request, not only those at its head (see _sweep).
        self._sweeping = _types.Regrowth(_SWEEP_SLACK)
        self._closed = False
        self._lock = threading.Lock()

    def _check_open(self) -> Any:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        """Whether the connection is up (false once closed or the peer failed)."""
        return not self._closed and self._native.alive()

    @property
    def closed(self) -> bool:
        return self._closed

    def transport_info(self) -> str:
        """UCX's description of the lanes and transports this connection uses."""
        n = self._check_open()
        return n.info()

    def _track(self, req: Request) -> Request:
        """Keep ``req`` (and its buffer) referenced until it completes; the requests found done
        at the head of those kept go (one lock for both), and all done ones once the list has
        doubled since the last sweep."""
        done = req._native.done()
        if self._inflight or not done:
            with self._lock:
                inflight = self._inflight
                while inflight and inflight[0]._native.done():
                    inflight.popleft()._buffer = None
                if not done:
                    inflight.append(req)
                if self._sweeping.due(len(inflight)):
                    self._sweep()
        return req

    def _sweep(self) -> None:
        """Drop every done request kept (under the lock).  A request that never completes (a
        peer that stopped answering, without error handling) would otherwise keep every later
        one, and its buffer, behind it; sweeping when the list has doubled since the last sweep
        costs O(1) a request, amortized, and keeps the list at most twice as long as the
        requests in flight at the last sweep, plus _SWEEP_SLACK."""
        kept: deque[Request] = deque()
        for r in self._inflight:
            if r._native.done():
                r._buffer = None
            else:
                kept.append(r)
        self._inflight = kept
        self._sweeping.kept = len(kept)

    def _shutdown(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._native.close(timeout)
        except GpuShareError:
            pass  # the peer is gone already: nothing left to disconnect
        with self._lock:
            self._inflight.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 5.0) -> None:  # pragma: no cover - overridden
        raise NotImplementedError
