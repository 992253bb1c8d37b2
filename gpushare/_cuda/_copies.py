"""gpushare's own CUDA copies: the ones a caller waits for (:func:`copy_sync`,
in native code without the GIL) and the ones it does not
(:func:`copy_async`, a :class:`CopyRequest`), and the registry of copies in
flight that must complete before their memory is unmapped
(:func:`wait_for_copies`).

A synchronous copy costs three driver calls in the steady state: the copy
(``cuMemcpyDtoDAsync`` and the like, the kind given where both sides' memory
types are known), ``cuEventRecord`` of an event kept for the next copy, and
one ``cuEventQuery`` at the copy's expected time, until which the waiting
thread spins (after one sleep when that time is long) without the GIL.  The
expected time is learned per device, kind of copy and size class from the
copies before; a copy not done by then is waited for by blocking (see
``src/cuda/copy.cpp``), never by sleeping in steps.

Streams: a copy runs on the stream the caller names, else on the stream the
buffer's producer named, else on a non-blocking stream of gpushare's own per
device, created once: ordered after nothing of the caller's (a buffer that
names no stream needs no ordering, by the array interface's rule; a DLPack
producer orders its work before that stream itself).  The legacy and
per-thread default streams are the current context's: a copy on one of them
makes the device's primary context current for the call.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
import weakref
from typing import Any

from .._errors import CUDAError, WaitTimeoutError
from . import _await, _driver
from ._driver import LEGACY_STREAM, check, on_device

__all__ = ["CopyRequest", "copy_async", "copy_sync", "inflight_copies", "notify_after", "own_stream", "drain_own_stream",
           "wait_for_copies", "KIND_ANY",
           "KIND_HTOD", "KIND_DTOH", "KIND_DTOD"]

#: Copy kinds, as ``src/cuda/copy.cpp`` names them.
KIND_ANY, KIND_HTOD, KIND_DTOH, KIND_DTOD = 0, 1, 2, 3

_TIMED_OUT = -1
_NO_DRIVER = -2

# ---------------------------------------------------------------- copies in flight

_inflight_lock = threading.Lock()
#: Every stream-ordered copy gpushare queued that nobody has yet seen complete.
_inflight: set[_Pending] = set()
#: Those of them whose request was dropped unfinished (a subset, looked at by every copy: kept
#: apart so that a copy costs nothing per copy in flight), and those dropped since the last look
#: (appended by the request's finalizer, which takes no lock: it may run in a garbage
#: collection that a thread holding ``_inflight_lock`` set off).
_orphans: set[_Pending] = set()
_dropped: collections.deque[_Pending] = collections.deque()


class _Pending:
    """The event recorded after one queued copy, the memory the copy touches,
    and what it keeps alive; shared by its :class:`CopyRequest` and the
    registry that :func:`wait_for_copies` searches.

    ``lock`` serialises the driver calls on the event: whoever holds it may
    synchronise; the event is destroyed once the copy is known complete and
    nobody can ask again (the request finished or was dropped).
    """

    __slots__ = ("ordinal", "event", "stream", "spans", "keep", "lock", "complete", "error", "retired")

    def __init__(self, ordinal: int, event: Any, stream: int, spans: tuple[tuple[int, int], ...], keep: Any) -> None:
        self.ordinal = ordinal
        self.event = event
        self.stream = stream  # the event's
        self.spans = spans
        self.keep = keep
        self.lock = threading.Lock()
        self.complete = False
        self.error: BaseException | None = None
        self.retired = False

    def overlaps(self, start: int, end: int) -> bool:
        return any(a < end and start < b for a, b in self.spans)

    def _settle(self, err: Any) -> None:
        drv = _driver.driver()
        self.complete = True
        if err != drv.CUresult.CUDA_SUCCESS:
            self.error = CUDAError(_driver._name(drv, err), "copy")

    def query(self) -> bool:
        """Whether the copy is known complete; never blocks (a thread that
        is synchronising on it holds the lock: not yet)."""
        if self.complete:
            return True
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if not self.complete:
                drv = _driver.driver()
                with on_device(self.ordinal):
                    (err,) = drv.cuEventQuery(self.event)
                if err == drv.CUresult.CUDA_ERROR_NOT_READY:
                    return False
                self._settle(err)
            return True
        finally:
            self.lock.release()

    def wait(self, timeout: float | None) -> None:
        """Block until the copy has completed (or failed), without the GIL
        and without sleeping in steps (``src/cuda/copy.cpp``).

        Raises
        ------
        WaitTimeoutError
            If ``timeout`` seconds pass first.
        """
        if timeout is None:
            self.sync()
            return
        lib = _native()
        with self.lock:
            if self.complete:
                return
            late, elapsed = ctypes.c_int(), ctypes.c_int64()
            with on_device(self.ordinal):  # a host function on the legacy stream goes to the current context's
                code = lib.gs_wait_for(int(self.event), self.stream, max(0, int(timeout * 1e9)),
                                       ctypes.byref(late), ctypes.byref(elapsed))
            if code == _TIMED_OUT:
                raise WaitTimeoutError(f"the CUDA copy did not complete within {timeout} s")
            self._settle(_driver.driver().CUresult(code))

    def notify(self, fd: int) -> None:
        """Queue a host function that adds 1 to eventfd ``fd`` once the copy
        has completed: on an idle stream of gpushare's own that waits for
        the copy's event (nothing is added to the stream the copy runs on).
        Never blocks: while another thread synchronises on the copy, its
        awaiter is left to its poll."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if self.complete:
                return
            notify_after(self.ordinal, self.event, fd)
        finally:
            self.lock.release()

    def sync(self) -> None:
        """Block until the copy has completed (or failed)."""
        with self.lock:
            if not self.complete:
                drv = _driver.driver()
                with on_device(self.ordinal):
                    (err,) = drv.cuEventSynchronize(self.event)
                self._settle(err)

    def retire(self) -> None:
        """Forget a completed copy: release what it kept and its event."""
        with _inflight_lock:
            if self.retired:
                return
            self.retired = True
            _inflight.discard(self)
            _orphans.discard(self)
        keep, self.keep = self.keep, None
        release = getattr(keep, "release", None)
        if release is not None:
            release()
        with self.lock:
            _destroy_event(self.ordinal, self.event)


def _orphan(pending: _Pending) -> None:
    """The request was dropped unfinished (its finalizer): the registry alone holds the copy
    now, and the next copy's look retires it once it is seen complete.  Takes no lock (see
    ``_dropped``)."""
    _dropped.append(pending)


def _retire_orphans() -> None:
    """Retire the dropped requests whose copies have completed."""
    if not _orphans and not _dropped:
        return
    with _inflight_lock:
        while _dropped:
            p = _dropped.popleft()
            if not p.retired:
                _orphans.add(p)
        orphans = list(_orphans)
    for p in orphans:
        try:
            if p.query():
                p.retire()
        except CUDAError:
            p.complete = True  # the context is gone or poisoned: nothing left to wait for
            p.retire()


def wait_for_copies(address: int, size: int) -> None:
    """Block until every copy gpushare queued that touches ``size`` bytes at
    ``address`` has completed: what must happen before that memory is
    unmapped or freed.  Other work (the user's) is :func:`wait_for_consumers`'
    to wait for.  A copy's own failure stays with its request (``wait``
    raises it).

    Raises
    ------
    CUDAError
        If the device's context cannot be made current.
    """
    end = address + size
    with _inflight_lock:
        touching = [p for p in _inflight if p.overlaps(address, end)]
    for p in touching:
        # Only synchronised: a dropped request's copy is retired (what it
        # keeps released) by the next copy_async, outside the caller's locks.
        p.sync()


def inflight_copies() -> int:
    """How many queued copies gpushare has not yet seen complete."""
    with _inflight_lock:
        return len(_inflight)


class CopyRequest:
    """A stream-ordered copy in flight: complete when the event recorded
    after it has completed, which is when its bytes are in the destination
    memory and visible to every process that maps it.

    ``wait(timeout)``, ``done()`` and ``await`` as for
    :class:`gpushare.ucx.Request`.  A request dropped before it finished
    leaves its copy in the registry of copies in flight, which keeps its
    buffers alive until the copy is seen complete.
    """

    __slots__ = ("_pending", "_finished", "_error", "_finalizer", "__weakref__")

    def __init__(self, pending: _Pending) -> None:
        self._pending = pending
        self._finished = False
        self._error: BaseException | None = None
        self._finalizer = weakref.finalize(self, _orphan, pending)

    def _finish(self) -> None:
        self._finished = True
        self._error = self._pending.error
        self._finalizer.detach()
        self._pending.retire()

    def done(self) -> bool:
        """Whether the copy has completed (or failed)."""
        if self._finished:
            return True
        if not self._pending.query():
            return False
        self._finish()
        return True

    def exception(self) -> BaseException | None:
        """The error the copy ended with, or ``None``."""
        return self._error if self.done() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy completes; raise its error.

        Raises
        ------
        WaitTimeoutError
            If ``timeout`` seconds pass first; the copy stays queued.
        CUDAError
            If the copy failed.
        """
        if not self._finished:
            self._pending.wait(timeout)
            self._finish()
        if self._error is not None:
            raise self._error

    def __await__(self) -> Any:
        """Wait in the event loop, woken by a host function queued after the
        copy (``_await``): no thread, no polling in steps."""
        if not self._finished:
            yield from _await.until(self.done, self._pending.notify).__await__()
        if self._error is not None:
            raise self._error


def notify_after(ordinal: int, event: Any, fd: int) -> None:
    """Queue a host function that adds 1 to eventfd ``fd`` once ``event`` (of device
    ``ordinal``) has completed: on an idle stream of gpushare's own that waits for the event, so
    nothing is added to the stream the event was recorded on (:mod:`._await`)."""
    drv = _driver.driver()
    with on_device(ordinal):
        stream = _device(ordinal).notify_stream()
        check(drv.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")
        code = _native().gs_notify(int(stream), fd)
    if code:
        _raise(code, "cuLaunchHostFunc")


def _destroy_event(ordinal: int, event: Any) -> None:
    drv = _driver.driver()
    try:
        with on_device(ordinal):
            drv.cuEventDestroy(event)
    except CUDAError:
        pass  # the context is gone or poisoned: nothing left to free


def copy_async(dst: int, src: int, n: int, *, ordinal: int, stream: int | None,
               producer: int | None, keep: Any, what: str) -> CopyRequest:
    """Queue ``n`` bytes from ``src`` to ``dst`` in device ``ordinal``'s
    context: on ``stream``, else on the producer's stream, else on the legacy
    default stream, after the producer's earlier work; return the request
    that completes when the bytes have landed.  ``keep`` (released when the
    request ends) keeps the buffers alive meanwhile."""
    drv = _driver.driver()
    _retire_orphans()
    no_timing = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
    with on_device(ordinal):
        s = stream if stream is not None else (producer if producer is not None else LEGACY_STREAM)
        if producer is not None and producer != s:
            after = check(drv.cuEventCreate(no_timing), "cuEventCreate")
            try:
                check(drv.cuEventRecord(after, producer), "cuEventRecord(the producer's stream)")
                check(drv.cuStreamWaitEvent(s, after, 0), "cuStreamWaitEvent")
            finally:
                drv.cuEventDestroy(after)
        check(drv.cuMemcpyAsync(dst, src, n, s), what)
        event = check(drv.cuEventCreate(no_timing), "cuEventCreate")
        try:
            check(drv.cuEventRecord(event, s), "cuEventRecord")
        except BaseException:
            drv.cuEventDestroy(event)
            raise
    pending = _Pending(ordinal, event, int(s), ((dst, dst + n), (src, src + n)), keep)
    with _inflight_lock:
        _inflight.add(pending)
    return CopyRequest(pending)


# ---------------------------------------------------------------- the native copy

#: The driver entry points ``src/cuda/copy.cpp`` calls, in its order, with
#: the CUDA version each is asked for at.
_ENTRIES = (("cuMemcpyAsync", 12000), ("cuMemcpyHtoDAsync", 12000), ("cuMemcpyDtoHAsync", 12000),
            ("cuMemcpyDtoDAsync", 12000), ("cuEventRecord", 12000), ("cuEventQuery", 12000),
            ("cuEventSynchronize", 12000), ("cuLaunchHostFunc", 12000), ("cuCtxPushCurrent", 12000),
            ("cuCtxPopCurrent", 12000), ("cuCtxGetCurrent", 12000), ("cuStreamQuery", 12000),
            ("cuStreamSynchronize", 12000))

_LIBRARY = "libgpushare_cuda_copy.so"
_lib_lock = threading.Lock()
_lib: Any = None
_lib_pid = 0


def _native() -> Any:
    """``libgpushare_cuda_copy``, given the driver's entry points (once per
    process: a forked child asks again).

    Raises
    ------
    CUDAError
        If the library is missing or the driver lacks an entry point.
    """
    global _lib, _lib_pid
    lib = _lib
    if lib is not None and _lib_pid == os.getpid():
        return lib
    with _lib_lock:
        if _lib is not None and _lib_pid == os.getpid():
            return _lib
        drv = _driver.driver()
        # Built beside this package's modules (an editable install keeps it in the package's other folder).
        folders = list(getattr(sys.modules[__package__], "__path__", ())) or [os.path.dirname(__file__)]
        paths = [os.path.join(folder, _LIBRARY) for folder in folders]
        path = next((p for p in paths if os.path.isfile(p)), None)
        if path is None:
            raise CUDAError("CUDA_ERROR_NOT_FOUND", f"{_LIBRARY} is not in {' or '.join(folders)}: reinstall gpushare")
        try:
            lib = ctypes.CDLL(path)  # CDLL: every call releases the GIL
        except OSError as exc:
            raise CUDAError("CUDA_ERROR_NOT_FOUND", f"loading {path} failed: {exc}") from None
        fns = (ctypes.c_uint64 * len(_ENTRIES))()
        flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        for i, (name, version) in enumerate(_ENTRIES):
            fn = check(drv.cuGetProcAddress(name.encode(), version, flags), f"cuGetProcAddress({name})")
            if isinstance(fn, tuple):  # (pfn, symbolStatus)
                fn = fn[0]
            fns[i] = int(fn or 0)
        lib.gs_copy_init.restype = ctypes.c_int
        missing = lib.gs_copy_init(fns, len(_ENTRIES))
        if missing:
            raise CUDAError("CUDA_ERROR_NOT_FOUND", f"the CUDA driver has no {_ENTRIES[missing - 1][0]}")
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        lib.gs_copy_wait.argtypes = (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, vp, vp, vp,
                                     i64, i64, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(i64))
        lib.gs_wait_for.argtypes = (vp, vp, i64, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(i64))
        lib.gs_notify.argtypes = (vp, ctypes.c_int)
        _lib, _lib_pid = lib, os.getpid()
        return lib


_notify_lock = threading.Lock()
#: The most streams per device that awaits queue their host functions on.
_NOTIFY_STREAMS = 8


class _Device:
    """What synchronous copies on one device reuse: gpushare's stream there,
    idle events (taken and given back whole: each waiter has its own), and
    the time a copy is expected to take, learned per kind and size class."""

    __slots__ = ("ordinal", "ctx", "stream", "events", "ns_per_byte", "seen", "streak", "_notify")

    def __init__(self, ordinal: int) -> None:
        drv = _driver.driver()
        self.ordinal = ordinal
        with on_device(ordinal) as ctx:
            self.ctx = ctx
            self.stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.events: list[Any] = []
        #: (kind, size class) -> ns per byte a copy is expected to take
        self.ns_per_byte: dict[tuple[int, int], float] = {}
        self.seen: set[tuple[int, int]] = set()  # classes whose first late copy was seen
        self.streak: dict[tuple[int, int], int] = {}  # copies on time in a row
        self._notify: list[Any] = []

    def notify_stream(self) -> Any:
        """A non-blocking stream of gpushare's own that only waits for
        events and runs the host functions that wake awaiting loops: an idle
        one, so that an await is never queued behind another's copy (a new
        one while all are busy, up to :data:`_NOTIFY_STREAMS`).  The
        device's context is current."""
        drv = _driver.driver()
        with _notify_lock:
            streams = list(self._notify)
        for stream in streams:
            if drv.cuStreamQuery(stream)[0] == drv.CUresult.CUDA_SUCCESS:
                return stream
        if len(streams) >= _NOTIFY_STREAMS:
            return streams[len(streams) - 1]
        stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        with _notify_lock:
            self._notify.append(stream)
        return stream

    def take_event(self) -> Any:
        try:
            return self.events.pop()
        except IndexError:
            drv = _driver.driver()
            with on_device(self.ordinal):
                return check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")


_devices = _driver.PerDevice()

#: How much longer than the last late copy of its class a copy is expected
#: to take (so that one a little slower is not late); how much shorter each
#: copy found done on time makes the next one's expected time (so that a
#: class that got faster, or a slow first copy, is outgrown); and how late
#: counts as "just after" the expected time.
_MARGIN = 1.02
_DECAY = 0.995
_FASTEST_DECAY = 0.8
_JUST_AFTER = 1.01


def _device(ordinal: int) -> _Device:
    return _devices.get(ordinal, _Device)


def _learn(dev: _Device, klass: tuple[int, int], n: int, per_byte: float | None, expected: int, late: int,
           elapsed: int) -> None:
    """What one synchronous copy teaches about its class's time.  ``late``
    (``src/cuda/copy.cpp``): 0, done at its expected time: the expected time
    shrinks, faster the longer the run of copies on time, so that a slow
    outlier is soon outgrown; 1, done when asked again just after: about
    right, or a driver that runs work only when asked (the stand-in), so it
    is expected sooner, to learn; 2, later: it took ``elapsed`` (the first
    such copy of a class is not believed: a first touch of memory is slow)."""
    if not n:
        return
    if late == 2 and elapsed > expected * _JUST_AFTER:
        if klass in dev.seen:
            dev.ns_per_byte[klass] = elapsed / n
        dev.seen.add(klass)
        dev.streak[klass] = 0
    elif per_byte is None:
        return
    elif late:
        dev.ns_per_byte[klass] = per_byte / 2
        dev.streak[klass] = 0
    else:
        streak = dev.streak.get(klass, 0)
        dev.ns_per_byte[klass] = per_byte * max(_FASTEST_DECAY, 1 - (1 - _DECAY) * (1 << min(streak, 8)))
        dev.streak[klass] = streak + 1


def own_stream(ordinal: int) -> int:
    """gpushare's non-blocking stream on device ``ordinal``, made once."""
    return int(_device(ordinal).stream)


def drain_own_stream(ordinal: int) -> None:
    """Block until the work queued on gpushare's stream of device ``ordinal`` (what a
    DLPack producer ordered before it, included) has completed."""
    dev = _device(ordinal)
    with on_device(ordinal):
        check(_driver.driver().cuStreamSynchronize(dev.stream), "cuStreamSynchronize(gpushare's stream)")


def _raise(code: int, what: str) -> None:
    raise CUDAError(_driver._name(_driver.driver(), _driver.driver().CUresult(code)), what)


def copy_sync(dst: int, src: int, n: int, *, ordinal: int, kind: int, stream: int | None, producer: int | None,
              keep: Any, what: str, timeout: float | None) -> None:
    """Copy ``n`` bytes from ``src`` to ``dst`` with device ``ordinal``'s
    context and return when they have landed (see the module's docstring
    for the stream).  ``kind``: ``KIND_*``, what both sides' memory is
    known to be.  ``keep`` is released when the copy is done; when
    ``timeout`` seconds pass first, the copy stays in flight, registered
    with what ``keep`` keeps alive, and :class:`WaitTimeoutError` is raised.

    Raises
    ------
    WaitTimeoutError
        If ``timeout`` seconds pass first.
    CUDAError
        If the copy fails or cannot be queued.
    """
    lib = _native()
    _retire_orphans()
    dev = _device(ordinal)
    s = stream if stream is not None else producer
    if s is None:
        s = int(dev.stream)
    elif producer is not None and producer != s:
        # Named a stream and the producer another: the Python path orders them.
        request = copy_async(dst, src, n, ordinal=ordinal, stream=stream, producer=producer, keep=keep, what=what)
        request.wait(timeout)
        return
    own = s == int(dev.stream)
    event = None if own else dev.take_event()  # on gpushare's own stream, all its work is waited for
    klass = (kind, n.bit_length())
    per_byte = dev.ns_per_byte.get(klass)
    expected = int(per_byte * n * _MARGIN) if per_byte else 0
    limit = -1 if timeout is None else max(0, int(timeout * 1e9))
    late, elapsed = ctypes.c_int(), ctypes.c_int64()
    code = lib.gs_copy_wait(dst, src, n, kind, s, None if event is None else int(event), int(dev.ctx), expected,
                            limit, ctypes.byref(late), ctypes.byref(elapsed))
    if code == _TIMED_OUT:
        if event is None:  # the copy is to be found in flight: an event after it
            event = dev.take_event()
            with on_device(ordinal):
                check(_driver.driver().cuEventRecord(event, s), "cuEventRecord")
        pending = _Pending(ordinal, event, s, ((dst, dst + n), (src, src + n)), keep)
        with _inflight_lock:
            _inflight.add(pending)
        _orphan(pending)
        raise WaitTimeoutError(f"the CUDA copy did not complete within {timeout} s")
    if event is not None:
        dev.events.append(event)
    if code != 0:
        release = getattr(keep, "release", None)
        if release is not None:
            release()
        _raise(code, what)
    _learn(dev, klass, n, per_byte, expected, late.value, elapsed.value)
    release = getattr(keep, "release", None)
    if release is not None:
        release()
