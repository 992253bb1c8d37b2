"""The CUDA driver, loaded lazily, and the one place its failures become
:class:`gpushare.CUDAError`.

Nothing here runs at import of gpushare: :func:`driver` imports
``cuda.bindings`` and initialises the driver the first time a CUDA path needs
it.  Where there is no CUDA driver, :func:`driver` raises
:class:`gpushare.UnsupportedError` saying so, and :func:`unavailable_reason`
returns that sentence for :func:`gpushare.capabilities`.

Contexts: gpushare never changes the calling thread's current context.  Every
driver call that needs one runs inside :func:`on_device`, which pushes the
device's primary context and pops it again, so the same code works from any
thread (worker threads, finalizers, the garbage collector) and leaves CuPy's
and torch's current device where the caller put it.

Devices are named by UUID across processes: an ordinal means nothing to a
process with another ``CUDA_VISIBLE_DEVICES``.  UUIDs are written as cuda.core
writes ``Device.uuid`` (``"xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"``, no
``GPU-`` prefix); :func:`normalize_uuid` accepts NVML's ``GPU-`` form too.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import CUDAError, InvalidInputError, UnsupportedError

log = logging.getLogger("gpushare.cuda")

__all__ = [
    "LEGACY_STREAM",
    "DeviceMemory",
    "NO_DEVICE",
    "PER_THREAD_STREAM",
    "bytes_of",
    "check",
    "current_ordinal",
    "ipc_allocation_size",
    "device_count",
    "device_name",
    "device_uuid",
    "driver",
    "import_ordinal",
    "normalize_uuid",
    "on_device",
    "ordinal_of_uuid",
    "own_stream",
    "pointer_ordinal",
    "set_bytes",
    "stream_handle",
    "stream_ordinal",
    "unavailable_reason",
    "valid_ordinal",
]

_lock = threading.Lock()
_driver: Any = None
_reason: str | None = None


def _load() -> None:
    global _driver, _reason
    try:
        from cuda.bindings import driver as drv
    except ImportError as exc:
        _reason = f"cuda-bindings is not installed ({exc}); pip install cuda-bindings"
        return
    try:
        (err,) = drv.cuInit(0)
    except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError
        _reason = f"no CUDA driver: libcuda.so.1 not found ({exc})"
        return
    if err != drv.CUresult.CUDA_SUCCESS:
        _reason = f"the CUDA driver failed to initialise [{_name(drv, err)}]"
        return
    _driver = drv


def unavailable_reason() -> str | None:
    """Why the CUDA paths cannot run here, or ``None`` when they can."""
    with _lock:
        if _driver is None and _reason is None:
            _load()
        return _reason


def driver() -> Any:
    """``cuda.bindings.driver``, initialised.

    Raises
    ------
    ImportError
        If cuda-bindings is not installed.
    UnsupportedError
        If there is no usable CUDA driver.
    """
    reason = unavailable_reason()
    if reason is not None:
        if reason.startswith("cuda-bindings"):
            raise ImportError(reason)
        raise UnsupportedError(reason)
    return _driver


def _name(drv: Any, err: Any) -> str:
    try:
        res, name = drv.cuGetErrorName(err)
        if res == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming an error must not fail
        pass
    return getattr(err, "name", str(err))


def check(result: tuple[Any, ...], what: str) -> Any:
    """Raise :class:`CUDAError` unless ``result[0]`` is ``CUDA_SUCCESS``;
    return the rest (one value, a tuple, or ``None``)."""
    drv = _driver
    err, rest = result[0], result[1:]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CUDAError(_name(drv, err), what)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def bytes_of(handle: Any, n: int) -> bytes:
    """The ``n`` bytes of a driver struct (fabric or IPC handle)."""
    data = getattr(handle, "data", None)
    if data is None:
        data = getattr(handle, "bytes", None)
    if data is not None:
        return bytes(data)[:n]
    return ctypes.string_at(handle.getPtr(), n)


def handle_types_field(prop: Any) -> ctypes.c_uint32:
    """``requestedHandleTypes`` of a ``CUmemAllocationProp`` in the C struct (it follows the
    4-byte ``type``): the driver's bit mask, which the bindings' getter and setter take as one
    enum member only."""
    return ctypes.c_uint32.from_address(prop.getPtr() + 4)


def set_bytes(handle: Any, data: bytes) -> Any:
    """Fill a driver struct from bytes; returns it."""
    ctypes.memmove(handle.getPtr(), data, len(data))
    return handle


def device_uuid(ordinal: int) -> str:
    """The UUID of a device ordinal of this process, as cuda.core's
    ``Device.uuid`` writes it (no ``GPU-`` prefix)."""
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    uuid = check(drv.cuDeviceGetUuid(dev), f"cuDeviceGetUuid({ordinal})")
    raw = bytes_of(uuid, 16).hex()
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:32]}"


def device_name(ordinal: int) -> str:
    """The driver's name of a device ordinal of this process ("NVIDIA H200")."""
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    name = check(drv.cuDeviceGetName(256, dev), f"cuDeviceGetName({ordinal})")
    return bytes(name).split(b"\0", 1)[0].decode("utf-8", "replace")


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.ASCII)


def normalize_uuid(uuid: str | None) -> str | None:
    """A device UUID in cuda.core's form, from that form or NVML's
    ``GPU-`` form; ``None`` for anything that is not a UUID."""
    if not isinstance(uuid, str):
        return None
    text = uuid.strip().lower()
    if text.startswith("gpu-"):
        text = text[4:]
    return text if _UUID.fullmatch(text) else None


#: Why there is no CUDA where the driver loads but sees no device.
NO_DEVICE = "the CUDA driver sees no device"


def device_count() -> int:
    drv = driver()
    return int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))


def valid_ordinal(ordinal: int) -> int:
    """``ordinal`` if this process sees such a device, else
    :class:`InvalidInputError` saying how many it sees."""
    count = device_count()
    if not 0 <= ordinal < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise InvalidInputError(f"no CUDA device {ordinal}: this process sees {count}{extra}")
    return ordinal


def ordinal_of_uuid(uuid: str | None) -> int | None:
    """This process's ordinal of the device with ``uuid``, or ``None`` when
    it does not see that device."""
    want = normalize_uuid(uuid)
    if want is None:
        return None
    for i in range(device_count()):
        if device_uuid(i) == want:
            return i
    return None


class PerDevice:
    """Driver state kept per key (a device) for this process: made once by
    ``make(key)``, forgotten in a forked child (the driver's state does not
    survive fork).  Read without a lock once made."""

    __slots__ = ("_lock", "_items", "_pid")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[Any, Any] = {}
        self._pid = 0

    def get(self, key: Any, make: Callable[[Any], Any]) -> Any:
        if self._pid == os.getpid():
            value = self._items.get(key)
            if value is not None:
                return value
        with self._lock:
            if self._pid != os.getpid():
                self._items = {}
                self._pid = os.getpid()
            value = self._items.get(key)
            if value is None:
                value = self._items[key] = make(key)
            return value

    def keys(self) -> list[Any]:
        """The keys made in this process."""
        with self._lock:
            return list(self._items) if self._pid == os.getpid() else []


def _retain_primary(ordinal: int) -> Any:
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    return check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({ordinal})")


_primary = PerDevice()


def _primary_context(ordinal: int) -> Any:
    """The device's primary context, retained once per process (as the CUDA
    runtime does) and kept until the process exits."""
    return _primary.get(ordinal, _retain_primary)


def ipc_allocation_size(handle: bytes, uuid: bytes) -> int:
    """The size of the allocation a legacy CUDA IPC handle (64 bytes) names, on the device with
    the 16-byte ``uuid``: opened, measured (``cuMemGetAddressRange``) and closed again.  The
    driver counts opens of one handle, so one held elsewhere in this process stays open."""
    drv = driver()
    ordinal = ordinal_of_uuid("-".join((uuid[:4].hex(), uuid[4:6].hex(), uuid[6:8].hex(), uuid[8:10].hex(),
                                        uuid[10:16].hex())))
    if ordinal is None:
        raise InvalidInputError(f"the CUDA IPC handle is of device {uuid.hex()}, which this process does not see")
    with on_device(ordinal):
        ipc = set_bytes(drv.CUipcMemHandle(), handle)
        base = int(check(drv.cuIpcOpenMemHandle(ipc, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                         "cuIpcOpenMemHandle"))
        try:
            _, size = check(drv.cuMemGetAddressRange(base), "cuMemGetAddressRange")
        finally:
            drv.cuIpcCloseMemHandle(base)
    return int(size)


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[Any]:
    """Make ``ordinal``'s primary context current in this thread for the
    duration of the block, then restore whatever was current before."""
    drv = driver()
    ctx = _primary_context(ordinal)
    check(drv.cuCtxPushCurrent(ctx), f"cuCtxPushCurrent(device {ordinal})")
    try:
        yield ctx
    finally:
        drv.cuCtxPopCurrent()


def current_ordinal() -> int | None:
    """The device of the calling thread's current context, or ``None``
    when it has none."""
    drv = driver()
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        return None
    return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


# ---------------------------------------------------------------- streams

#: ``CU_STREAM_LEGACY``: the legacy default stream, which waits for earlier
#: work on every blocking stream of its context (CuPy's and torch's default).
LEGACY_STREAM = 1
#: ``CU_STREAM_PER_THREAD``: the calling thread's default stream.
PER_THREAD_STREAM = 2


def stream_handle(stream: Any) -> int | None:
    """The raw ``CUstream`` of ``stream``: a cuda.core ``Stream``, anything
    with ``__cuda_stream__``, a CuPy stream (``.ptr``), a torch stream
    (``.cuda_stream``), or an ``int`` handle (0 and 1 name the legacy default
    stream, 2 the per-thread one).  ``None`` stays ``None``."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise InvalidInputError("stream must be a CUDA stream or a stream handle, not a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise InvalidInputError(f"stream handle {stream} is negative")
        return stream or LEGACY_STREAM
    proto = getattr(stream, "__cuda_stream__", None)
    if callable(proto):
        try:
            _, handle = proto()
            return int(handle) or LEGACY_STREAM
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{type(stream).__name__}.__cuda_stream__() is malformed: {exc}") from None
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, CuPy, cuda.core
        value = getattr(stream, attr, None)
        if value is not None:
            try:
                return int(value) or LEGACY_STREAM
            except (TypeError, ValueError):
                break
    raise InvalidInputError(
        f"stream must be a cuda.core Stream, a CuPy or torch stream, or an int handle, not {type(stream).__name__}"
    )


def stream_ordinal(stream: int) -> int | None:
    """The device of a real stream's context; ``None`` for the default
    streams (1, 2), which mean "the current context's"."""
    if stream in (LEGACY_STREAM, PER_THREAD_STREAM):
        return None
    drv = driver()
    ctx = check(drv.cuStreamGetCtx(stream), "cuStreamGetCtx")
    check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent(the stream's context)")
    try:
        return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))
    finally:
        drv.cuCtxPopCurrent()


def pointer_ordinal(address: int, hint: int | None = None) -> int:
    """The device that owns ``address``.

    Asked with no context pushed: under unified addressing the driver finds
    the allocation from the address alone (UCX's memory-type detection makes
    the same query from threads with no current context), and pushing one
    would retain a primary context, hundreds of MiB of device memory, on a
    device this process may never use.  Should a driver answer that it needs a
    context, the query is repeated in ``hint``'s (a device the caller already
    uses), else in a primary context gpushare already holds; never in a new
    one.
    """
    drv = driver()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    result = drv.cuPointerGetAttribute(attr, address)
    if result[0] == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        held = _primary.keys()
        for ordinal in [hint] if hint is not None else held:
            with on_device(ordinal):
                result = drv.cuPointerGetAttribute(attr, address)
            if result[0] != drv.CUresult.CUDA_ERROR_INVALID_CONTEXT:
                break
    return int(check(result, "cuPointerGetAttribute(DEVICE_ORDINAL)"))


@contextlib.contextmanager
def own_stream() -> Iterator[Any]:
    """A non-blocking stream of gpushare's own in the current context: what
    the block queues on it has completed when the block ends, and waited for
    nothing else (the legacy stream would wait for the context's blocking
    streams, ``cuCtxSynchronize`` for every stream)."""
    drv = driver()
    stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    try:
        yield stream
        check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
    finally:
        drv.cuStreamDestroy(stream)


def wait_for_producers(pending: set[tuple[int, int]]) -> None:
    """Block until the work queued on each ``(ordinal, stream)`` has
    completed: what a producer left pending on memory it exports (see
    :func:`gpushare._buffers.pending_stream`), which no importer may see
    half done.  (torch.multiprocessing sends an IPC event for the consumer
    to wait on; here the export waits, once per stream.)"""
    drv = driver()
    for ordinal, stream in sorted(pending):
        with on_device(ordinal):
            check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize(the producer's stream)")


def wait_for_consumers(ordinal: int, whole_context: bool) -> None:
    """Before memory mapped on device ``ordinal`` is unmapped or its handle
    closed: block until the work a consumer may still have queued on it has
    completed.  On the legacy default stream, which waits for every blocking
    stream of the context (CuPy's and torch's defaults): an event recorded
    there.  ``whole_context``: a consumer named a stream of its own (to
    ``__dlpack__``), so all the context's work is waited for (a stream handle
    kept until now may have been destroyed meanwhile: it is never used).
    Work on a non-blocking stream nobody named is not seen.  A failure (the
    device's sticky error) is logged: the memory goes anyway."""
    drv = driver()
    try:
        with on_device(ordinal):
            if whole_context:
                _logged(drv.cuCtxSynchronize(), "cuCtxSynchronize")
                return
            # An event recorded on the legacy stream completes after the work queued before it there
            # and on every blocking stream (a synchronisation of the stream alone waits for its own).
            event = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            try:
                _logged(drv.cuEventRecord(event, LEGACY_STREAM), "cuEventRecord(the legacy stream)")
                _logged(drv.cuEventSynchronize(event), "cuEventSynchronize")
            finally:
                drv.cuEventDestroy(event)
    except CUDAError as exc:
        log.warning("before unmapping CUDA memory of device %d: %s", ordinal, exc)


def _logged(result: tuple, what: str) -> None:
    err = result[0]
    if err != driver().CUresult.CUDA_SUCCESS:
        log.warning("before unmapping CUDA memory: %s failed (%s); unmapping it anyway", what, _name(driver(), err))


class DeviceMemory:
    """CUDA memory mapped into this process, held without cuda.core: its
    address (``handle``), size and device ordinal (``device_id``, also as
    ``memory_resource.device_id``, where a cuda.core ``Buffer`` says it), and
    what releases it: :meth:`close`, or the garbage collector, once."""

    __slots__ = ("handle", "size", "device_id", "readonly", "_resource", "_finalizer", "__weakref__")

    def __init__(self, handle: int, size: int, device_id: int, release: Any, *, readonly: bool = False,
                 resource: Any = None) -> None:
        self.handle = handle
        self.size = size
        self.device_id = device_id
        #: mapped read-only (a read-only share's VMM mapping)
        self.readonly = readonly
        self._resource = resource  # what owns the mapping, where it has more to say (``grant``)
        self._finalizer = weakref.finalize(self, release)

    @property
    def memory_resource(self) -> Any:
        return self if self._resource is None else self._resource

    def close(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"<gpushare DeviceMemory 0x{self.handle:x}, {self.size} bytes on device {self.device_id}>"


def import_ordinal(owner_uuid: str | None, device: int | None) -> int:
    """The device to map imported memory on: ``device`` if given; else the
    calling thread's current device, where it is the memory's own device
    (found by UUID) or can reach it as a peer; else the memory's own device
    if this process sees it; else the current device, else 0.

    Ordinals are never taken from the exporter: they differ between
    processes with another ``CUDA_VISIBLE_DEVICES``.
    """
    if device is not None:
        return valid_ordinal(device)
    current = current_ordinal()
    owner = ordinal_of_uuid(owner_uuid)
    if current is not None and (owner is None or owner == current or _can_access_peer(current, owner)):
        return current
    if owner is not None:
        return owner
    return 0 if current is None else current


def _can_access_peer(ordinal: int, peer: int) -> bool:
    drv = driver()
    try:
        a = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        b = check(drv.cuDeviceGet(peer), "cuDeviceGet")
        return bool(check(drv.cuDeviceCanAccessPeer(a, b), "cuDeviceCanAccessPeer"))
    except CUDAError:
        return False
