"""Turn a user's buffer object into (address, nbytes, memory type), pinned.

Host memory: anything with the buffer protocol (NumPy arrays, bytearray,
memoryview, mmap), or DLPack on the CPU.  CUDA memory: a cuda.core
``Buffer``, anything with ``__cuda_array_interface__`` (CuPy, Numba) or
DLPack on a CUDA device; DLPack is preferred where the array interface names
no stream (torch's), so that the producer's pending work is ordered first.
The returned :class:`LocalBuffer` keeps the object (and, for host memory, a
buffer-protocol export that stops it from being resized) alive until
:meth:`LocalBuffer.release`.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any

from . import _dlpack
from ._errors import InvalidInputError, InvalidTypeError

__all__ = ["LocalBuffer", "resolve", "plain_torch_cpu", "pending_stream", "plain_host_nbytes", "host_address_reader", "MEMORY_TYPES"]

#: Memory type names, as accepted by ``memory_type=`` arguments.
MEMORY_TYPES = ("host", "cuda")

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3
_DLPACK_CUDA_MANAGED = 13


@dataclass
class LocalBuffer:
    """A resolved, pinned local buffer."""

    address: int
    nbytes: int
    memory_type: str
    readonly: bool
    owner: Any
    pin: Any = None
    device: int | None = None
    #: For CUDA memory: the stream its producer's pending work is on (from
    #: ``__cuda_array_interface__``), which a copy must come after.
    stream: int | None = None

    def release(self) -> None:
        """Drop the pin and the reference to the owner."""
        pin, self.pin, self.owner = self.pin, None, None
        if pin is not None:
            pin.release()


_CONTIGUOUS_FIX = ("pass a C-contiguous copy instead: numpy.ascontiguousarray(a), cupy.ascontiguousarray(a) "
                   "or tensor.contiguous()")


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    if len(strides) != len(shape):
        return False
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


_TYPESTR = re.compile(r"[<>|=][a-zA-Z]([0-9]{1,4})(\[[0-9a-zA-Z]{1,8}\])?", re.ASCII)


def _itemsize(typestr: str) -> int:
    """Bytes per item of an array-interface typestr (``"<f4"``, ``"<M8[s]"``)."""
    m = _TYPESTR.fullmatch(typestr) if isinstance(typestr, str) else None
    if m is None:
        raise InvalidInputError(f"unrecognised typestr {typestr!r:.40} in array interface")
    return int(m.group(1))


def _from_cuda_array_interface(obj: Any, cai: dict) -> LocalBuffer:
    try:
        shape = tuple(int(d) for d in cai["shape"])
        ptr, readonly = cai["data"]
        strides = cai.get("strides")
        itemsize = _itemsize(cai["typestr"])
        stream = cai.get("stream")
        stream = None if stream is None else int(stream)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(f"malformed __cuda_array_interface__: {exc}") from None
    if stream is not None and stream <= 0:
        raise InvalidInputError(f"__cuda_array_interface__ names stream {stream}; version 3 forbids 0")
    if strides is not None:
        strides = tuple(int(s) for s in strides)
    if not _c_contiguous(shape, strides, itemsize):
        raise InvalidInputError(f"CUDA array is not C-contiguous; {_CONTIGUOUS_FIX}")
    nbytes = math.prod(shape) * itemsize
    return LocalBuffer(int(ptr or 0), nbytes, "cuda", bool(readonly), obj, stream=stream, device=_device_said(obj))


def _device_said(obj: Any) -> int | None:
    """The CUDA device an array says it is on, where it says so as gpushare's
    arrays (``device``, an int) and CuPy's (``device.id``) do; else None (the
    driver is asked where it matters)."""
    device = getattr(obj, "device", None)
    if type(device) is not int:
        device = getattr(device, "id", None)
    return device if type(device) is int and device >= 0 else None


def _from_cuda_core_buffer(obj: Any) -> LocalBuffer:
    if getattr(obj, "is_host_accessible", False):
        # Pinned or managed memory the CPU can touch: register it as host.
        mtype = "host"
    else:
        mtype = "cuda"
    device = getattr(obj, "device_id", None)
    return LocalBuffer(int(obj.handle), int(obj.size), mtype, False, obj, device=device)


def _is_cuda_core_buffer(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("cuda.core") and hasattr(obj, "handle") and hasattr(obj, "size")


def plain_torch_cpu(obj: Any) -> bool:
    """Whether ``obj`` is an ordinary torch CPU tensor, read straight off it
    (its ``data_ptr`` and ``nbytes``): C-contiguous, no autograd, no lazy
    conjugate or negation bit, which DLPack would refuse (a state dict holds
    thousands of such tensors)."""
    torch = sys.modules.get("torch")
    return (torch is not None and type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.is_contiguous()
            and not (obj.requires_grad or obj.is_conj() or obj.is_neg()))


def pending_stream(obj: Any, lb: LocalBuffer) -> int | None:
    """For CUDA memory about to be read by another process: the stream to
    wait on for the work its producer queued on it.  The stream its array
    interface names (version 3, read as it is; None where it says nothing is
    pending); else the legacy default stream (1): a DLPack producer resolved
    with ``stream=1`` orders its work before it, and a cuda.core ``Buffer``
    or a version 2 interface (torch's) says nothing, so the work is taken to
    be there or on a blocking stream.  None for host memory."""
    if lb.memory_type != "cuda":
        return None
    cai = None if _is_cuda_core_buffer(obj) else _cuda_array_interface(obj)
    if isinstance(cai, dict) and "stream" in cai and not _orders_by_dlpack(obj, cai):
        return lb.stream
    return 1


def plain_host_nbytes(obj: Any) -> int | None:
    """The size of ``obj`` when its exact type is a NumPy array or one of
    Python's byte buffers (host memory read through the buffer protocol, as
    :func:`resolve` concludes for them), without resolving it; None for
    anything else.  NumPy is not imported for this."""
    t = type(obj)
    if t is bytearray or t is bytes:
        return len(obj)
    if t is memoryview:
        return obj.nbytes
    np = sys.modules.get("numpy")
    if np is not None and t is np.ndarray:
        return obj.nbytes
    return None


_address_reader: Any = None


def host_address_reader() -> Any:
    """A function that gives the address of a NumPy array's first byte, as
    ``a.__array_interface__["data"][0]`` does, in a tenth of the time: it
    reads the array object's data pointer (just past CPython's object
    header, as NumPy's C API lays it out) where a check on probe arrays, at
    first use, found that to agree with the array interface; else it is the
    array interface."""
    global _address_reader
    if _address_reader is None:
        _address_reader = _pick_address_reader()
    return _address_reader


def _pick_address_reader() -> Any:
    import ctypes

    import numpy as np

    read = ctypes.c_void_p.from_address
    header = object.__basicsize__  # PyObject_HEAD: the array's data pointer follows it

    def fast(a: Any) -> int:
        return read(id(a) + header).value or 0

    def slow(a: Any) -> int:
        return int(a.__array_interface__["data"][0])

    base = np.arange(64, dtype=np.float64)
    probes = [base, base[3:], base[5:40].view(np.uint8), base.reshape(8, 8)[2:, 1:], np.frombuffer(b"abcdefgh", np.uint8)[3:],
              np.zeros(0, np.int32), np.zeros((4, 4), np.int16).T]
    return fast if all(fast(a) == slow(a) for a in probes) else slow


def resolve(obj: Any, *, writable: bool, stream: int | None = None) -> LocalBuffer:
    """Resolve ``obj`` into a pinned :class:`LocalBuffer`.

    Parameters
    ----------
    obj
        The buffer object.
    writable
        Whether the caller will write into it (a get's destination).
    stream
        The stream the caller will use the memory on: a CUDA DLPack producer
        orders its pending work before it.  ``None``: no ordering (the
        memory's address is all that is needed).

    Raises
    ------
    InvalidInputError
        If ``obj`` is not a contiguous buffer gpushare understands, or is
        read-only while ``writable`` is true.
    """
    if isinstance(obj, LocalBuffer):
        return obj
    np = sys.modules.get("numpy")
    if np is not None and type(obj) is np.ndarray and obj.flags.c_contiguous:
        # the common case (a get's fresh arrays, thousands in a batch), read straight off it: a NumPy
        # array that other references see cannot be resized, so the reference held here pins it
        readonly = not obj.flags.writeable
        if writable and readonly:
            raise InvalidInputError("ndarray buffer is read-only; a destination must be writable")
        return LocalBuffer(host_address_reader()(obj) if obj.nbytes else 0, obj.nbytes, "host", readonly, obj)
    if plain_torch_cpu(obj):
        # as DLPack would give it (which holds no more than this reference)
        return LocalBuffer(obj.data_ptr(), obj.nbytes, "host", False, obj)
    cai = None if _is_cuda_core_buffer(obj) else _cuda_array_interface(obj)
    if cai is not None and _orders_by_dlpack(obj, cai):
        cai = None
    if _is_cuda_core_buffer(obj):
        lb = _from_cuda_core_buffer(obj)
    elif cai is not None:
        lb = _from_cuda_array_interface(obj, cai)
    else:
        lb = _from_host_or_dlpack(obj, writable, stream)
    if writable and lb.readonly:
        lb.release()
        raise InvalidInputError(f"{type(obj).__name__} buffer is read-only; a destination must be writable")
    return lb


def _orders_by_dlpack(obj: Any, cai: Any) -> bool:
    """Whether ``obj``'s memory is to be read through DLPack although it has
    ``__cuda_array_interface__``: when the interface names no stream (version
    2, as torch writes it), it says nothing of the producer's pending work,
    while DLPack orders that work before the consumer's stream (torch's
    current stream for a torch tensor).  A version 3 interface with its
    ``stream`` entry (CuPy's, gpushare's) is used as it is."""
    if not isinstance(cai, dict) or "stream" in cai or not hasattr(obj, "__dlpack__"):
        return False
    try:
        dev_type = obj.__dlpack_device__()[0]
    except Exception:  # noqa: BLE001 - the producer's own error: keep its array interface
        return False
    return dev_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED)


def _cuda_array_interface(obj: Any) -> Any:
    """``obj.__cuda_array_interface__``, or None.  One that raises (torch's,
    for bfloat16) counts as none when ``obj`` also speaks DLPack."""
    try:
        return getattr(obj, "__cuda_array_interface__", None)
    except Exception as exc:  # noqa: BLE001 - the producer's own error, whatever its type
        if hasattr(obj, "__dlpack__"):
            return None
        raise InvalidInputError(f"{type(obj).__name__}.__cuda_array_interface__ failed: {exc}") from None


def _from_array_interface(obj: Any, ai: dict, writable: bool) -> LocalBuffer:
    """Host memory described by ``__array_interface__`` (no buffer protocol)."""
    try:
        shape = tuple(int(d) for d in ai["shape"])
        itemsize = _itemsize(ai["typestr"])
        data = ai["data"]
        strides = ai.get("strides")
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(f"malformed __array_interface__: {exc}") from None
    if strides is not None and not _c_contiguous(shape, tuple(int(s) for s in strides), itemsize):
        raise InvalidInputError(f"array is not C-contiguous; {_CONTIGUOUS_FIX}")
    nbytes = math.prod(shape) * itemsize
    if isinstance(data, tuple):
        ptr, readonly = data
        return LocalBuffer(int(ptr), nbytes, "host", bool(readonly), obj)
    lb = _from_host_or_dlpack(data, writable)
    if lb.nbytes < nbytes:
        lb.release()
        raise InvalidInputError("__array_interface__ data is smaller than its shape says")
    lb.nbytes, lb.owner = nbytes, (obj, lb.owner)
    return lb


class _Pin:
    """A buffer-protocol export of an object, held until :meth:`release`:
    while it is held the object cannot be resized or freed.  Pure Python, so
    that host-to-host copies never load UCX."""

    __slots__ = ("_view", "address", "nbytes", "readonly")

    def __init__(self, obj: Any, writable: bool) -> None:
        try:
            view = memoryview(obj)  # TypeError: no buffer protocol
        except ValueError as exc:
            # The exporter has a buffer but cannot say its format (NumPy's
            # datetime64, for one): described by its array interface instead.
            raise TypeError(str(exc)) from None
        if not view.c_contiguous:
            view.release()
            raise BufferError("the buffer is not C-contiguous")
        if writable and view.readonly:
            view.release()
            raise BufferError("the buffer is read-only")
        self.nbytes = view.nbytes
        self.readonly = view.readonly
        if view.nbytes == 0:
            self.address = 0
        else:
            import numpy

            flat = numpy.frombuffer(view.cast("B") if view.ndim != 1 or view.itemsize != 1 else view, numpy.uint8)
            self.address = int(flat.__array_interface__["data"][0])
        self._view = view

    def release(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            try:
                view.release()
            except BufferError:
                pass  # a copy of the export is still referenced: it goes with it


def _from_host_or_dlpack(obj: Any, writable: bool, stream: int | None = None) -> LocalBuffer:
    try:
        pin = _Pin(obj, writable)
    except (BufferError, ValueError) as exc:
        if writable and "read-only" in str(exc):
            raise InvalidInputError(
                f"{type(obj).__name__} buffer is read-only; a destination must be writable"
            ) from None
        fix = f"; {_CONTIGUOUS_FIX}" if "contiguous" in str(exc) else ""
        raise InvalidInputError(f"{type(obj).__name__} cannot be used as a buffer: {exc}{fix}") from None
    except TypeError:
        pin = None
    if pin is not None:
        return LocalBuffer(pin.address, pin.nbytes, "host", pin.readonly, obj, pin)
    if hasattr(obj, "__array_interface__"):
        return _from_array_interface(obj, obj.__array_interface__, writable)
    if hasattr(obj, "__dlpack_device__"):
        dev_type, dev_id = obj.__dlpack_device__()
        if dev_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            # Read the tensor itself rather than through NumPy, which refuses
            # dtypes only DLPack has (bfloat16, float8, complex32).
            try:
                tensor = _dlpack.borrow(obj)
            except (BufferError, TypeError, ValueError, RuntimeError) as exc:
                raise InvalidInputError(f"{type(obj).__name__}.__dlpack__ failed: {exc}") from None
            if not tensor.contiguous():
                raise InvalidInputError(f"tensor is not C-contiguous; {_CONTIGUOUS_FIX}")
            return LocalBuffer(tensor.address, tensor.nbytes, "host", tensor.readonly, (obj, tensor))
        if dev_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            return _from_cuda_dlpack(obj, stream, int(dev_id))  # read directly: no cuda.core on the way
        raise InvalidInputError(f"DLPack device type {dev_type} is not supported (host and CUDA are)")
    raise InvalidTypeError(
        f"{type(obj).__name__} is not a buffer: expected the buffer protocol, "
        "__cuda_array_interface__, DLPack or a cuda.core Buffer"
    )


def _from_cuda_dlpack(obj: Any, stream: int | None, device: int) -> LocalBuffer:
    """A CUDA DLPack tensor read directly (its producer orders its work
    before ``stream``, or none is asked for)."""
    try:
        tensor = _dlpack.borrow(obj, stream=-1 if stream is None else stream)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise InvalidInputError(f"{type(obj).__name__}.__dlpack__ failed: {exc}") from None
    if not tensor.contiguous():
        raise InvalidInputError(f"CUDA tensor is not C-contiguous; {_CONTIGUOUS_FIX}")
    return LocalBuffer(tensor.address, tensor.nbytes, "cuda", tensor.readonly, (obj, tensor), device=device)
