"""The view of an open share: :class:`View`.

A view either maps the memory (its path's :class:`~gpushare._paths.Mapping`,
or the exporter's own object in the exporting process) or copies through
its path's :class:`~gpushare._paths.Transport` (cma, ucx-rma); it branches
only on which of the two it holds, never on a path's name.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
import time
import weakref
from typing import Any, Literal

from . import _arrays, _buffers, _dlpack, _progress
from ._cuda import _copies, _driver
from ._errors import (
    ClosedError,
    InvalidInputError,
    OutOfBoundsError,
    UnsupportedError,
    WaitTimeoutError,
)
from ._share import Share
from ._types import PathName
from ._view_use import _NO_LEASE, MappingUse, _end_lease, _Once, _Pin, _release_view

__all__ = ["View", "with_timeout"]

log = logging.getLogger("gpushare.api")


def _dtype_note(share: Share) -> str:
    """What ``view.why`` adds about a dtype the typestr could not carry."""
    if share.dtype_name is None:
        return ""
    if share.dlpack_dtype is not None:
        return (f"; dtype {share.dtype_name} travels as DLPack {share.dlpack_dtype} "
                f"(DLPack consumers see it; NumPy sees {share.typestr} items)")
    return f"; exported as bytes: dtype {share.dtype_name} has no portable form"


#: (source, destination) memory types -> the kind of CUDA copy between them.
_KINDS = {("cuda", "cuda"): _copies.KIND_DTOD, ("host", "cuda"): _copies.KIND_HTOD,
          ("cuda", "host"): _copies.KIND_DTOH}


class View:
    """An open share: made by :func:`gpushare.open`.

    Mapped views (every path but cma and ucx-rma) are zero-copy: host ones expose
    ``__array_interface__`` (``numpy.asarray(view)``), :meth:`memoryview`
    and ``__dlpack__``; CUDA ones ``__cuda_array_interface__`` and
    ``__dlpack__``; all with the exporter's dtype, shape and strides, and
    read-only where the share is.  A cma or ucx-rma view is not mapped: use
    :meth:`get` and :meth:`put`.  Views are context managers, also
    asynchronous ones (``async with``).

    :meth:`close` ends the lease at once, but never unmaps memory that arrays
    made from the view still use: a DLPack tensor keeps the mapping until it
    is released, and an array made through ``__cuda_array_interface__`` (which
    keeps the view object alive) until the view object is gone.  A host-fd
    view of a ``lifetime="revoked"`` share is the exception: its lease and
    mapping are kept two seconds after the close, for a reopen of the share
    that asks the exporter nothing (docs/lifetimes.md).

    Attributes
    ----------
    path : str
        The path taken: ``"same-process"``, ``"fabric"``, ``"posix-fd"``,
        ``"cuda-ipc"``, ``"host-fd"``, ``"cma"`` or ``"ucx-rma"``.
    why : str
        One line: why this path, and why not the better ones.
    nbytes : int
        Size of the shared buffer in bytes.
    device : "host" or int
        ``"host"``, or the CUDA device the memory is mapped on in this process
        (an ordinal of this process; for ucx-rma, the exporter's).
    shape : tuple of int
        Array shape as exported.
    typestr : str
        ``__array_interface__`` type string as exported.
    strides : tuple of int or None
        Byte strides of a strided array (``nbytes`` is the span it covers),
        else ``None``.
    share : Share
        The share this view opened.
    """

    # No __dict__: a bundle makes a view per tensor, thousands at once.
    __slots__ = ("share", "path", "why", "nbytes", "device", "shape", "typestr", "strides", "_target", "_mapped",
                 "_transport", "_lease", "_closed", "_cai_taken", "_use", "_fast_ok", "_fast", "_finalizer",
                 "__weakref__")

    share: Share
    path: PathName
    why: str
    nbytes: int
    device: int | Literal["host"]
    shape: tuple[int, ...]
    typestr: str
    strides: tuple[int, ...] | None
    _use: MappingUse | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("View objects are made by gpushare.open")

    @classmethod
    def _make(cls, share: Share, path: str, why: str, opened: Any, use: MappingUse | None = None,
              kept: MappingUse | None = None) -> View:
        """A view of ``share`` over ``path``: ``opened`` holds the path's
        mapping or transport (or, in the exporting process, its object).
        ``use``: the mapping's users, where other views share the mapping
        (a bundle's tensors of one allocation); this view becomes one.
        ``kept``: the users of a closed view's mapping, kept for a reopen
        (:mod:`gpushare._reopen`), whose count this view takes over."""
        target, mapped, transport = opened.target, opened.mapping, opened.transport
        self = object.__new__(cls)
        self.share = share
        self.path = path
        self.why = why + _dtype_note(share) if why else why
        self.nbytes = share.nbytes
        self.device = share.device
        if mapped is not None and share.device != "host":
            self.device = mapped.device  # this process's ordinal
        self.shape = share.shape
        self.typestr = share.typestr
        self.strides = share.strides
        self._target = target
        self._mapped = mapped
        self._transport = transport
        self._lease: list | tuple = [] if use is None else _NO_LEASE
        self._closed = False
        self._cai_taken = False
        if use is not None:
            use.acquire()
            self._use = use
        elif kept is not None:
            self._use = kept
        else:
            self._use = MappingUse(mapped) if mapped is not None else None
        # Mapped host memory: get/put of NumPy arrays take a short path (see _fast_array).
        self._fast_ok = mapped is not None and self.device == "host" and share.strides is None
        self._fast: Any = None
        # A bundle's tensor (``use`` given) lives in its bundle until the bundle
        # closes it: no finalizer of its own is needed, only the call once.
        self._finalizer = _Once(use) if use is not None else weakref.finalize(
            self, _release_view, self._use, self._lease)
        return self

    @classmethod
    def _of_leaves(cls, items: list[tuple], path: str, why: str, mapped: Any, use: MappingUse) -> list[View]:
        """Views of a bundle's tensors in one mapped allocation, made at once:
        what :meth:`_make` does for each with ``use``, its users counted once.
        ``items``: per tensor (share, nbytes, shape, typestr, strides, dtype
        name), the share's own fields."""
        use.acquire_many(len(items))
        device = mapped.device
        fast = device == "host"
        notes: dict[Any, str] = {}
        out = []
        new = object.__new__
        for share, nbytes, shape, typestr, strides, name in items:
            self = new(cls)
            self.share = share
            self.path = path
            if name is None:
                self.why = why
            else:
                note = notes.get(name)
                if note is None:
                    note = notes[name] = _dtype_note(share)
                self.why = why + note
            self.nbytes = nbytes
            self.device = device
            self.shape = shape
            self.typestr = typestr
            self.strides = strides
            self._target = None
            self._mapped = mapped
            self._transport = None
            self._lease = _NO_LEASE
            self._closed = False
            self._cai_taken = False
            self._use = use
            self._fast_ok = fast and strides is None
            self._fast = None
            self._finalizer = _Once(use)
            out.append(self)
        return out

    def _attach_lease(self, lease: Any, why: str) -> None:
        self._lease.append(lease)
        self.why = why + _dtype_note(self.share)

    # -- state -----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed or not self._finalizer.alive

    def _check(self) -> None:
        if self.closed:
            raise ClosedError("view is closed")

    def close(self) -> None:
        """End the lease with the exporter, and unmap or disconnect (idempotent).

        Memory that arrays made from the view still use stays mapped until
        the last of them is gone (see the class notes); the view refuses any
        further use at once.  A host-fd view of a ``lifetime="revoked"``
        share keeps its lease and mapping two seconds more, for a reopen.
        """
        self._target = None
        self._fast_ok = False
        self._fast = None
        if self._finalizer.alive and not self._closed:
            log.debug("closing the %s view of share %s", self.path, self.share.share_id[:8])
        self._closed = True
        if self._cai_taken and self._finalizer.alive:
            # An array made through __cuda_array_interface__ holds this view,
            # not a count we can see: unmap when the view object goes.
            _end_lease(self._lease)
            return
        self._finalizer()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> View:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()  # ends the lease and unmaps: no waiting on anything

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return (f"<gpushare.View {self.dtype} {shape} ({self.nbytes} bytes) on {self.device} "
                f"{'closed' if self.closed else 'via ' + self.path}>")

    @property
    def dtype(self) -> Any:
        """The items' NumPy dtype as they travel (``numpy.dtype(typestr)``;
        ``share.dtype_name`` names a dtype NumPy has no form of)."""
        import numpy as np

        return np.dtype(self.typestr)

    @property
    def ndim(self) -> int:
        """The number of dimensions, ``len(shape)``."""
        return len(self.shape)

    def __len__(self) -> int:
        """The length of the first dimension, as for an array."""
        if not self.shape:
            raise TypeError("len() of a 0-d view")
        return self.shape[0]

    def __bool__(self) -> bool:
        return True  # a view is an object, not its values: never empty or ambiguous

    # -- memory ------------------------------------------------------------
    def _local(self) -> _buffers.LocalBuffer:
        """The mapped memory as a local buffer (not for ucx-rma)."""
        self._check()
        if self._transport is not None:
            raise UnsupportedError(f"a {self.path} view is not mapped in this process: use view.get() and view.put()")
        if self._target is not None:
            return _buffers.resolve(_arrays.span_of(self._target)[0], writable=False)
        return self._mapped.local(self.share.offset, self.nbytes)

    def memoryview(self) -> memoryview:
        """A writable byte view of mapped host memory."""
        self._check()
        if self.device != "host":
            raise UnsupportedError("memoryview() needs host memory; this view is CUDA memory")
        if self._transport is not None:
            self._local()
        if self._target is not None:
            lb = _buffers.resolve(_arrays.span_of(self._target)[0], writable=False)
            raw = (ctypes.c_char * self.nbytes).from_address(lb.address)
            raw._owner = (self._target, lb)  # the memory lives as long as the view of it
            view = memoryview(raw).cast("B")
        else:
            view = self._mapped.memoryview()[self.share.offset:self.share.offset + self.nbytes]
        return view.toreadonly() if self._read_only() else view

    def __buffer__(self, flags: int) -> memoryview:  # the buffer protocol on Python 3.12+
        return self.memoryview()

    @property
    def __array_interface__(self) -> dict:
        if self.device != "host":
            raise AttributeError("__array_interface__ (this view is CUDA memory; use __cuda_array_interface__)")
        return {"shape": self.shape, "typestr": self.typestr, "data": self.memoryview(), "strides": self.strides,
                "version": 3}

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device == "host":
            raise AttributeError("__cuda_array_interface__ (this view is host memory)")
        lb = self._local()
        if self._target is None:
            self._cai_taken = True
        # gpushare leaves no work pending on the memory (its copies complete
        # before they return), so consumers need no stream to wait on.
        return {"shape": self.shape, "typestr": self.typestr, "data": (lb.address, self._read_only()),
                "version": 3, "strides": None, "stream": None}

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """A DLPack capsule of the mapped memory (host or CUDA), with the
        share's dtype and shape; read-only (DLPack 1.0) for a read-only share.
        The mapping stays until the consumer releases the tensor, even past
        :meth:`close`.  ``stream`` needs no ordering (gpushare leaves no work
        pending); for CUDA memory it is remembered, and the unmapping waits
        for the work queued there, as it does for the legacy stream's.  ``numpy.from_dlpack(view)`` and ``torch.from_dlpack(view)``
        take it without a copy."""
        self._check()
        if self._transport is not None:
            raise UnsupportedError(f"a {self.path} view is not mapped in this process: use view.get() and view.put()")
        if copy is True:
            raise BufferError("a view exports its memory without copying (copy=True is not supported)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the memory is on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        lb = self._local()
        if self._target is not None:
            if self.device != "host":
                return self._target.__dlpack__(stream=stream, max_version=max_version)
            owner: Any = (self._target, lb)  # the exporter's own object keeps the memory
        else:
            if type(stream) is int and stream > 0 and self.device != "host":
                self._mapped.used_on(stream)  # closing waits for the consumer's work there
            owner = _Pin()
            self._use.acquire()
            weakref.finalize(owner, self._use.drop)
        return _dlpack.capsule(lb.address, self.shape, self.typestr, self.__dlpack_device__(),
                               readonly=self._read_only(), owner=owner, max_version=max_version,
                               dl_dtype=self.share.dlpack_dtype, strides=self.strides)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device == "host":
            return (1, 0)
        return (2, int(self.device))

    # -- copies ------------------------------------------------------------
    def _read_only(self) -> bool:
        """Read-only here: the share is, or the mapping is (a sealed buffer)."""
        return self.share.readonly or bool(getattr(self._mapped, "readonly", False))

    def _check_writable(self) -> None:
        if self.share.readonly:
            raise InvalidInputError("this share is read-only: its exporter allows get, not put")
        if getattr(self._mapped, "readonly", False):
            raise InvalidInputError("this view's memory is mapped read-only (the exporter sealed the buffer)")

    def _span(self, buf: Any, offset: Any, writable: bool, stream: Any = None) -> tuple[_buffers.LocalBuffer, int]:
        """``buf`` resolved and checked against the view (its state, the
        bounds at ``offset``, the memory a path can copy to and from)."""
        self._check()
        if self.strides is not None:
            raise UnsupportedError(f"this share is a strided array (strides {self.strides}): its bytes are not "
                                   "its elements, so get/put refuse it; use numpy.asarray(view) or DLPack")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidInputError(f"offset must be a non-negative int, not {offset!r}")
        local = _buffers.resolve(buf, writable=writable, stream=stream)
        if self._transport is not None and self._transport.host_only and local.memory_type != "host":
            local.release()
            raise UnsupportedError(f"a {self.path} view copies to and from host memory only; stage CUDA memory "
                                   "on the host")
        if offset + local.nbytes > self.nbytes:
            local.release()
            raise OutOfBoundsError(
                f"{local.nbytes} bytes at offset {offset} run past the shared {self.nbytes} bytes"
            )
        return local, offset

    def _host_span(self, buf: Any, offset: Any) -> bool:
        """What :meth:`_span` checks for a NumPy array or a byte buffer
        within bounds, without resolving it (the ucx-rma path pins it
        itself, and says what is wrong with one it cannot use).  False for
        anything else: :meth:`_span` checks it."""
        n = _buffers.plain_host_nbytes(buf)
        if n is None or self._closed or self.strides is not None or type(offset) is not int or not 0 <= offset <= self.nbytes - n:
            return False
        return True

    def _checked(self, buf: Any, offset: Any, writable: bool) -> None:
        """What :meth:`_span` checks, for a path that pins ``buf`` itself."""
        if not self._host_span(buf, offset):
            self._span(buf, offset, writable)[0].release()  # checks bounds and the buffer

    def _fast_copy(self, buf: Any, offset: Any, get: bool) -> bool:
        """Copy between a mapped host view and a C-contiguous NumPy array
        within bounds with ``numpy.copyto``: a few microseconds a call less
        than the general path, and faster than libc's memmove for large
        copies.  False (nothing done) for anything else: the general path
        checks it and says what is wrong."""
        np_ = sys.modules.get("numpy")
        if (not self._fast_ok or self._closed or np_ is None or type(buf) is not np_.ndarray
                or type(offset) is not int):
            return False
        flags = buf.flags
        n = buf.nbytes
        if not flags.c_contiguous or (get and not flags.writeable) or not 0 <= offset <= self.nbytes - n:
            return False
        shared = self._fast
        if shared is None:
            raw = (ctypes.c_uint8 * self.nbytes).from_address(self._mapped.address + self.share.offset)
            shared = self._fast = np_.ctypeslib.as_array(raw)
        mine = buf if buf.dtype == np_.uint8 and buf.ndim == 1 else buf.reshape(-1).view(np_.uint8)
        if get:
            np_.copyto(mine, shared[offset:offset + n])
        else:
            np_.copyto(shared[offset:offset + n], mine)
        return True

    def _copy(self, buf: Any, offset: int, direction: str, stream: Any, wait: bool = False,
              timeout: float | None = None) -> Any:
        """Start a copy between ``buf`` and the mapped memory; a request for
        CUDA copies, ``None`` when the copy is already done.  ``wait``: a
        CUDA copy is waited for here (``timeout`` seconds at most), without
        the GIL (:func:`gpushare._cuda._copies.copy_sync`)."""
        handle = _driver.stream_handle(stream)
        # A DLPack producer orders its pending work before the stream the copy
        # runs on: the one named, else gpushare's own of a CUDA view's device,
        # else the legacy default stream.
        if handle is not None:
            consumer = handle
        elif isinstance(self.device, int):
            consumer = _copies.own_stream(self.device)
        else:
            consumer = _driver.LEGACY_STREAM
        local, offset = self._span(buf, offset, direction == "get", consumer)
        try:
            shared = self._local()
            if direction == "get":
                src, dst = shared.address + offset, local.address
            else:
                src, dst = local.address, shared.address + offset
            if local.nbytes == 0:
                local.release()
                return None
            if local.memory_type == "host" and shared.memory_type == "host":
                ctypes.memmove(dst, src, local.nbytes)
                local.release()
                return None
            return self._cuda_copy(local, shared, src, dst, handle, consumer, direction, wait, timeout)
        except BaseException:
            local.release()
            raise

    def _cuda_copy(self, local: _buffers.LocalBuffer, shared: _buffers.LocalBuffer, src: int, dst: int,
                   stream: int | None, consumer: int, direction: str, wait: bool, timeout: float | None) -> Any:
        ordinal = _driver.stream_ordinal(stream) if stream is not None else None
        if ordinal is None and local.memory_type == "cuda":
            # The local memory's device (asked of the driver where the array does not say): the copy runs
            # there, the mapping granted to it, as memory of one device is not always reachable from another.
            ordinal = local.device if local.device is not None else _driver.pointer_ordinal(local.address)
        if ordinal is None:
            ordinal = shared.device
        if self._mapped is not None and ordinal != self.device:
            self._mapped.grant(ordinal)  # the copy runs on another device: it needs access too
        what = f"copy {'from' if direction == 'get' else 'to'} the shared CUDA memory"
        # The copy comes after the producer's work: on the stream its array
        # interface names, else the one DLPack ordered it before.
        producer = local.stream if local.stream is not None else consumer
        if stream is None and producer == consumer and isinstance(self.device, int) and ordinal != self.device:
            # DLPack ordered the producer's work before gpushare's stream of the view's device, and the copy
            # runs on another device's: that work is waited for here (only where devices differ).
            _copies.drain_own_stream(self.device)
            producer = None
        if not wait:
            return _copies.copy_async(dst, src, local.nbytes, ordinal=ordinal, stream=stream, producer=producer,
                                      keep=local, what=what)
        kind = _KINDS.get((shared.memory_type, local.memory_type) if direction == "get"
                          else (local.memory_type, shared.memory_type), _copies.KIND_ANY)
        _copies.copy_sync(dst, src, local.nbytes, ordinal=ordinal, kind=kind, stream=stream, producer=producer,
                          keep=local, what=what, timeout=timeout)
        return None

    def get(self, dst: Any = None, offset: int = 0, *, stream: Any = None, timeout: float | None = 60.0,
            progress: _progress.ProgressCallback | None = None) -> Any:
        """Copy ``len(dst)`` bytes from the shared memory at ``offset`` into
        ``dst``; with no ``dst``, the whole view into a fresh array, returned
        (as :meth:`Bundle.get` does).

        Parameters
        ----------
        dst
            Host or CUDA memory (any buffer :func:`gpushare.export` takes),
            C-contiguous and writable.  Omitted: a new NumPy array (host
            memory) or :class:`CudaArray` (CUDA memory, on :attr:`device`)
            of the view's dtype and shape (strides of a strided host view);
            ``offset`` must then be 0.  A strided view (always mapped)
            gives a C-contiguous copy of its elements.
        offset : int
            Byte offset into the shared memory.
        stream : optional
            For CUDA memory: the stream to order the copy on (a cuda.core
            ``Stream``, a CuPy or torch stream, or a raw handle).  By default
            the stream ``dst`` names (``__cuda_array_interface__``'s
            ``stream``, or DLPack's), else the legacy default stream; either
            way the copy runs after the work already queued there.
        timeout : float or None
            Seconds to wait; :class:`WaitTimeoutError` when they pass (the
            copy stays in flight and ``dst`` in use until it completes).
            Whatever the timeout, a copy the exporter serves (cma, ucx-rma)
            ends with :class:`ExporterUnreachableError` once the exporter
            has left a sign-of-life request unanswered for
            ``GPUSHARE_PEER_TIMEOUT`` seconds (default 3; about 4 s after it
            stopped, froze or was cut off).
        progress : callable, optional
            ``progress(done, total)``, in bytes, for a progress bar: over
            cma and ucx-rma the copy then moves in pieces of 64 MiB
            (``gpushare._progress.PIECE``) and it is called after each (done
            grows to ``total``); on a mapped path once, at the end.  It runs
            in the calling thread; an exception it raises stops the copy
            after that piece and goes on.  A copy over cma or ucx-rma larger
            than 256 MiB also logs its progress at DEBUG on the
            ``gpushare.progress`` logger (docs/paths.md, "Progress").

        The bytes are in ``dst`` when this returns.

        Returns
        -------
        The fresh array when ``dst`` is omitted, else None.
        """
        progress = _progress.check_callback(progress)
        if dst is None:
            return self._get_fresh(offset, stream, timeout, progress)
        self._move(dst, offset, "get", stream, timeout, progress)
        return None

    def _get_fresh(self, offset: int, stream: Any, timeout: float | None,
                   progress: _progress.ProgressCallback | None = None) -> Any:
        import numpy as np

        if offset != 0:
            raise InvalidInputError("view.get() with no destination copies the whole view: offset must be 0 "
                                    f"(not {offset}); pass a destination to copy part of it")
        self._check()
        dtype = self.dtype
        if self.device != "host":
            if self.strides is not None:
                raise UnsupportedError("view.get() with no destination: the view is a strided CUDA array; pass a "
                                       "destination of its span, or read it with DLPack")
            out = _arrays.empty(self.shape, self.typestr, device=self.device)
            if self.nbytes:
                self._move(out, 0, "get", stream, timeout, progress)
            return out
        if self.strides is None:
            dst = np.empty(self.shape, dtype=dtype)
            if self.nbytes:
                self._move(dst, 0, "get", stream, timeout, progress)
            return dst
        return np.array(np.asarray(self))  # a strided view is mapped: its elements, copied

    def put(self, src: Any, offset: int = 0, *, stream: Any = None, timeout: float | None = 60.0,
            progress: _progress.ProgressCallback | None = None) -> None:
        """Copy ``src`` into the shared memory at ``offset``.

        Arguments as for :meth:`get` (``progress`` included).  When this
        returns the bytes are in the shared memory and visible to every
        process that maps it (CUDA copies are synchronised; a ucx-rma put
        completes once the exporter has the bytes in its memory).
        """
        progress = _progress.check_callback(progress)
        self._check_writable()
        self._move(src, offset, "put", stream, timeout, progress)

    def _move(self, buf: Any, offset: int, direction: str, stream: Any, timeout: float | None,
              progress: _progress.ProgressCallback | None = None) -> None:
        """One get or put on this view's path, waited for."""
        get = direction == "get"
        transport = self._transport
        if transport is not None and _progress.listening(progress):
            self._move_reported(transport, buf, offset, direction, stream, timeout, progress)
            return
        if stream is None and self._fast_copy(buf, offset, get):
            pass
        elif transport is not None:
            (transport.get if get else transport.put)(offset, buf, timeout, stream, self._span, self._checked)
        else:
            self._copy(buf, offset, direction, stream, True, timeout)
        self._report_whole(buf, offset, progress)

    def _report_whole(self, buf: Any, offset: int, progress: _progress.ProgressCallback | None) -> None:
        """A mapped copy's progress: reported once, at the end."""
        if progress is not None:
            local = self._span(buf, offset, False)[0]
            local.release()
            progress(local.nbytes, local.nbytes)

    def _move_reported(self, transport: Any, buf: Any, offset: int, direction: str, stream: Any,
                       timeout: float | None, progress: _progress.ProgressCallback | None) -> None:
        """A copied path's get or put that someone listens to: in the pieces
        :func:`gpushare._progress.pieces` gives, each reported (else whole)."""
        move = transport.get if direction == "get" else transport.put
        local, offset = self._span(buf, offset, direction == "get", stream)
        deadline = None if timeout is None else time.monotonic() + timeout
        reported = False
        for start, end, piece, report in _progress.pieces(local, self._copy_name(direction), progress):
            left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
            move(offset + start, piece, left, stream, self._span, self._checked)
            report(end)
            reported = True
        if not reported and (local.nbytes or progress is None):
            move(offset, buf, timeout, stream, self._span, self._checked)
        local.release()  # every piece is done (a piece in flight after an error holds it)

    async def _transfer_reported(self, transport: Any, buf: Any, offset: int, direction: str, stream: Any,
                                 progress: _progress.ProgressCallback | None) -> None:
        """:meth:`_move_reported` for asyncio."""
        move = transport.get_async if direction == "get" else transport.put_async
        local, offset = self._span(buf, offset, direction == "get", stream)
        reported = False
        for start, end, piece, report in _progress.pieces(local, self._copy_name(direction), progress):
            await move(offset + start, piece, stream, self._span)
            report(end)
            reported = True
        if not reported and (local.nbytes or progress is None):
            await move(offset, buf, stream, self._span)
        local.release()  # every piece is done (a piece in flight after an error or cancel holds it)

    def _copy_name(self, direction: str) -> str:
        return f"{direction} of share {self.share.share_id[:8]} over {self.path}"

    async def get_async(self, dst: Any, offset: int = 0, *, stream: Any = None,
                        timeout: float | None = None, progress: _progress.ProgressCallback | None = None) -> None:
        """:meth:`get` for asyncio: awaits the transfer without blocking the
        loop.  CUDA copies are queued on the stream and their completion
        awaited (no thread); host copies run in a worker thread.
        :class:`WaitTimeoutError` after ``timeout`` seconds.  ``progress``
        as for :meth:`get` (called in the loop's thread), and the same
        DEBUG lines for a copy over cma or ucx-rma larger than 256 MiB."""
        progress = _progress.check_callback(progress)
        await with_timeout(self._transfer(dst, offset, "get", stream, progress), timeout)

    async def put_async(self, src: Any, offset: int = 0, *, stream: Any = None,
                        timeout: float | None = None, progress: _progress.ProgressCallback | None = None) -> None:
        """:meth:`put` for asyncio; done when the bytes are visible to every
        process that maps the memory (remote puts are flushed).  ``progress``
        as for :meth:`get_async`."""
        progress = _progress.check_callback(progress)
        self._check_writable()
        await with_timeout(self._transfer(src, offset, "put", stream, progress), timeout)

    async def _transfer(self, buf: Any, offset: int, direction: str, stream: Any,
                        progress: _progress.ProgressCallback | None = None) -> None:
        transport = self._transport
        if transport is not None:
            if _progress.listening(progress):
                return await self._transfer_reported(transport, buf, offset, direction, stream, progress)
            return await (transport.get_async if direction == "get" else transport.put_async)(
                offset, buf, stream, self._span)
        if self.device == "host" and stream is None:
            request = await asyncio.to_thread(self._copy, buf, offset, direction, None)
        else:
            request = self._copy(buf, offset, direction, stream)
        if request is not None:
            await request
        self._report_whole(buf, offset, progress)


def check_item(view: View, offset: Any, buf: Any, direction: str) -> None:
    """A batch item checked as :meth:`View.get`/:meth:`View.put` check it."""
    if direction == "put":
        view._check_writable()
    view._span(buf, offset, direction == "get")[0].release()


def transport_of(view: View) -> Any:
    """The transport a copied view moves its bytes through (None: mapped)."""
    return view._transport


def start_copy(view: View, offset: int, buf: Any, direction: str) -> Any:
    """Start a copy to or from a mapped view: a request, or None when done."""
    return view._copy(buf, offset, direction, None)


async def with_timeout(transfer: Any, timeout: float | None) -> None:
    if timeout is None:
        await transfer
        return
    try:
        await asyncio.wait_for(transfer, timeout)
    except TimeoutError:
        raise WaitTimeoutError(f"the transfer did not complete within {timeout} s; it stays in flight") from None
