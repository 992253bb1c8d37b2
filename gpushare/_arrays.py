"""Typed arrays over shareable memory: dtype and shape checks, and the CUDA
array object that :func:`gpushare.empty` and channels hand out on a device.

NumPy describes host memory itself; for CUDA memory, :class:`CudaArray` is a
small C-contiguous array object that CuPy, PyTorch, Numba and JAX take
without a copy, through ``__cuda_array_interface__`` and DLPack.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal, overload

from . import _dlpack, _memory, _types
from ._cuda import _driver
from ._errors import CUDAOutOfMemoryError, InvalidInputError
from ._by_descriptor import allocate

if TYPE_CHECKING:
    import numpy

__all__ = ["CudaArray", "portable_typestr", "check_shape", "describe", "span_of", "MAX_DIMS"]

MAX_DIMS = 32
_TYPESTR = re.compile(r"^[<>|=][biufcV][0-9]{1,4}\Z")


def portable_typestr(dtype: Any) -> str:
    """The array-interface type string of ``dtype``, refusing the ones that
    have no portable form (object, datetime, strings, structured)."""
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"dtype {dtype!r:.60} is not a NumPy dtype: {exc}") from None
    typestr = dt.str
    if dt.fields is not None or dt.subdtype is not None or not _TYPESTR.match(typestr) or dt.itemsize < 1:
        raise InvalidInputError(
            f"dtype {dt} has no portable form for sharing; use a bool, integer, floating-point or complex "
            "dtype (or bytes: 'u1')"
        )
    return typestr


def check_shape(shape: Any, what: str = "shape") -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (an int is a 1-d shape)."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidInputError(f"{what} must be an int or a tuple of ints, not {type(shape).__name__}") from None
    if len(dims) > MAX_DIMS:
        raise InvalidInputError(f"{what} has {len(dims)} dimensions; at most {MAX_DIMS}")
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__"):
            raise InvalidInputError(f"{what} entries must be ints, not {type(d).__name__}")
        if int(d) < 0 or int(d) >= 1 << 56:
            raise InvalidInputError(f"{what} entry {int(d)} is out of range (0 to 2**56 - 1)")
    return tuple(int(d) for d in dims)


def nbytes_of(shape: tuple[int, ...], typestr: str) -> int:
    n = int(typestr[2:])
    for d in shape:
        n *= d
    return n


class CudaArray:
    """A C-contiguous array in CUDA memory, as CuPy, PyTorch and JAX take it.

    Made by :func:`gpushare.empty` (and ``zeros``, ``empty_like``) with a
    CUDA device, and by channels over CUDA memory.  It holds the memory
    (``base``) for as long as it, or a tensor made from it through DLPack,
    lives.  ``cupy.asarray(a)``, ``torch.as_tensor(a, device="cuda")`` and
    ``torch.from_dlpack(a)`` view it without a copy; :func:`gpushare.export`
    shares it with its dtype and shape.

    Attributes
    ----------
    shape : tuple of int
        Array shape.
    dtype : numpy.dtype
        Element type.
    nbytes : int
        Size in bytes.
    device : int
        CUDA device ordinal.
    ptr : int
        Address of the first element.
    base : object
        What owns the memory (a cuda.core ``Buffer``, or a view of a share).
    readonly : bool
        Consumers are told not to write.
    """

    __slots__ = ("__weakref__", "base", "device", "ptr", "readonly", "shape", "typestr")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("CudaArray objects are made by gpushare.empty, gpushare.zeros and channels")

    @classmethod
    def _make(cls, base: Any, ptr: int, shape: tuple[int, ...], typestr: str, device: int,
              readonly: bool = False) -> CudaArray:
        self = object.__new__(cls)
        self.base, self.ptr, self.shape, self.typestr = base, int(ptr), tuple(shape), typestr
        self.device, self.readonly = int(device), bool(readonly)
        return self

    @property
    def dtype(self) -> Any:
        import numpy as np

        return np.dtype(self.typestr)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.typestr)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def __cuda_array_interface__(self) -> dict:
        # Nothing gpushare queued is pending on the memory: no stream to wait on.
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, self.readonly),
                "version": 3, "strides": None, "stream": None}

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """A DLPack capsule of the array (read-only, DLPack 1.0, when ``readonly``)."""
        if copy is True:
            raise BufferError("the array is exported without copying (copy=True is not supported)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the memory is on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        return _dlpack.capsule(self.ptr, self.shape, self.typestr, self.__dlpack_device__(),
                               readonly=self.readonly, owner=self, max_version=max_version)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<gpushare.CudaArray shape={self.shape} dtype={self.dtype} on device {self.device}>"


_KIND = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}  # DLPack type code -> typestr kind


def _interface(obj: Any) -> dict | None:
    """``obj``'s array interface (CUDA first), or None; a property that
    raises (torch's for bfloat16) counts as none."""
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        try:
            ai = getattr(obj, attr, None)
        except Exception:  # noqa: BLE001 - only a description: try the next way
            ai = None
        if isinstance(ai, dict) and "shape" in ai and "typestr" in ai:
            return ai
    return None


def describe(obj: Any, nbytes: int,
             strided: bool = False) -> tuple[tuple[int, ...], str, str | None, tuple[int, int, int] | None]:
    """What a share says of ``obj``'s elements: (shape, typestr, dtype name,
    DLPack dtype).  ``strided``: ``obj`` spans ``nbytes`` with gaps (its
    shape and typestr are kept as they are, or it is refused).

    A dtype an array-interface typestr names is kept as it is; one only DLPack
    names (bfloat16, float8, complex32) travels as raw items (``|V2``...)
    with its DLPack dtype and name; one with no portable form (datetime,
    object, structured) travels as bytes with its name, which the importer's
    ``view.why`` reports.  Anything else is bytes.
    """
    as_bytes: tuple[tuple[int, ...], str, str | None, tuple[int, int, int] | None] = ((nbytes,), "|u1", None, None)
    ai = _interface(obj)
    if ai is not None:
        try:
            shape = tuple(int(d) for d in ai["shape"])
            typestr = str(ai["typestr"])
        except (TypeError, ValueError):
            return as_bytes
        descr = ai.get("descr")
        structured = typestr[1:2] == "V" and isinstance(descr, list) and (len(descr) > 1 or bool(descr[0][0]))
        if _TYPESTR.match(typestr) and (strided or nbytes_of(shape, typestr) == nbytes) and not structured:
            return shape, typestr, None, None
        if strided:
            raise InvalidInputError(f"a strided array of dtype {_dtype_name(obj, typestr)} cannot be shared; "
                                    "pass numpy.ascontiguousarray(a) instead")
        return (nbytes,), "|u1", _dtype_name(obj, typestr), None
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        try:
            device = obj.__dlpack_device__()[0]
            b = _dlpack.borrow(obj, stream=None if device == 1 else -1)
        except Exception:  # noqa: BLE001 - only a description: fall back to bytes
            return as_bytes
        code, bits, lanes = b.dtype
        if b.nbytes != nbytes or bits % 8:
            return as_bytes
        size = bits * lanes // 8
        if code in _KIND and lanes == 1:
            return b.shape, f"{'|' if size == 1 else '<'}{_KIND[code]}{size}", None, None
        name = _dlpack.dlpack_only_name(code, bits, lanes)
        if name is not None:
            return b.shape, f"|V{size}", name, (code, bits, lanes)
    return as_bytes


def _dtype_name(obj: Any, typestr: str) -> str:
    dtype = getattr(obj, "dtype", None)
    name = str(dtype) if dtype is not None else typestr
    return name if re.match(r"^[A-Za-z0-9_\[\]<>|=,. ]{1,64}\Z", name) else typestr[:64] or "unknown"


# ---------------------------------------------------------------- shareable arrays


class _HostOwner:
    """The base of a host array from :func:`empty`: it holds the buffer, so
    that the array keeps the buffer (and every path to it) alive."""

    __slots__ = ("__array_interface__", "buffer")

    def __init__(self, buffer: Any, shape: tuple[int, ...], typestr: str) -> None:
        self.buffer = buffer
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": (buffer.ptr, False), "version": 3}


@overload
def empty(shape: Any, dtype: Any = ..., *, device: Literal["host", "cpu"] = ...,
          huge_pages: Any = ...) -> numpy.ndarray: ...
@overload
def empty(shape: Any, dtype: Any = ..., *, device: int, huge_pages: Any = ...) -> CudaArray: ...
@overload
def empty(shape: Any, dtype: Any = ..., *, device: str | int,
          huge_pages: Any = ...) -> numpy.ndarray | CudaArray: ...
def empty(shape: Any, dtype: Any = "float64", *, device: Any = "host",
          huge_pages: Any = "auto") -> numpy.ndarray | CudaArray:
    """A new array in memory other processes can map: uninitialised.

    Parameters
    ----------
    shape : int or tuple of int
        Array shape.
    dtype : numpy dtype, default float64
        Element type: bool, integer, floating-point or complex.
    device : "host" or int, default "host"
        ``"host"`` (or ``"cpu"``): a NumPy array over
        :func:`gpushare.allocate` host memory.  An int: a :class:`CudaArray`
        over CUDA virtual memory of that device.
    huge_pages : {"auto", "thp", "hugetlb", False}, default "auto"
        For host arrays: as for :func:`gpushare.allocate`.

    Returns
    -------
    numpy.ndarray or CudaArray
        :func:`gpushare.export` offers it on every path, with its dtype and
        shape (so do its slices and typed views, on host).

    Raises
    ------
    InvalidInputError
        A shape, dtype or device out of range.
    OutOfMemoryError
        More host memory than this machine's RAM and swap together, at once
        (nothing is allocated); or a CUDA device out of memory
        (:class:`CUDAOutOfMemoryError`).  The message names the size.
    """
    dims = check_shape(shape)
    typestr = portable_typestr(dtype)
    nbytes = nbytes_of(dims, typestr)
    if _types.is_host(device):
        import numpy as np

        buf = allocate(max(nbytes, 1), device="host", huge_pages=huge_pages)  # it checks the size
        return np.asarray(_HostOwner(buf, dims, typestr))
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidInputError(f"device is {device!r}; expected 'host' (or 'cpu') or a CUDA device ordinal")
    try:
        buf = allocate(max(nbytes, 1), device=device, huge_pages=huge_pages)
    except CUDAOutOfMemoryError as exc:
        raise CUDAOutOfMemoryError(exc.status, f"{nbytes} bytes ({_memory.human(nbytes)}) on CUDA device "
                                               f"{device}: {exc.message}") from None
    return CudaArray._make(buf, int(buf.handle), dims, typestr, device)


@overload
def zeros(shape: Any, dtype: Any = ..., *, device: Literal["host", "cpu"] = ...,
          huge_pages: Any = ...) -> numpy.ndarray: ...
@overload
def zeros(shape: Any, dtype: Any = ..., *, device: int, huge_pages: Any = ...) -> CudaArray: ...
@overload
def zeros(shape: Any, dtype: Any = ..., *, device: str | int,
          huge_pages: Any = ...) -> numpy.ndarray | CudaArray: ...
def zeros(shape: Any, dtype: Any = "float64", *, device: Any = "host",
          huge_pages: Any = "auto") -> numpy.ndarray | CudaArray:
    """:func:`empty`, filled with zeros.

    Host memory is new memfd memory, which the kernel gives zeroed: nothing
    is written, and a page takes memory only when it is first used (as with
    ``numpy.zeros``).  CUDA memory is set to zero on the device.

    Parameters
    ----------
    shape, dtype, device, huge_pages
        As for :func:`empty`.

    Returns
    -------
    numpy.ndarray or CudaArray

    Raises
    ------
    InvalidInputError, OutOfMemoryError
        As for :func:`empty`.
    """
    arr = empty(shape, dtype, device=device, huge_pages=huge_pages)
    if isinstance(arr, CudaArray):
        drv = _driver.driver()
        # Zeros when this returns, without waiting for the caller's other work on the device.
        with _driver.on_device(arr.device), _driver.own_stream() as stream:
            _driver.check(drv.cuMemsetD8Async(arr.ptr, 0, max(arr.nbytes, 1), stream), "cuMemsetD8Async")
    # Host: empty() allocates new memfds (gs.allocate never hands out used
    # memory), whose pages read as zero until written.
    return arr


def empty_like(a: Any, *, device: Any = None) -> Any:
    """:func:`empty` with the shape and dtype of ``a`` (a NumPy array, a
    :class:`CudaArray`, or anything with ``shape`` and ``dtype``).

    Parameters
    ----------
    a : array-like
        The model.
    device : "host" or int, optional
        By default where ``a`` is: a CUDA device for a :class:`CudaArray` or an
        object with ``__cuda_array_interface__``, else host.

    Returns
    -------
    numpy.ndarray or CudaArray
    """
    if device is None:
        dev = getattr(a, "device", None)
        if isinstance(a, CudaArray):
            device = a.device
        elif _interface(a) is not None and "__cuda_array_interface__" in dir(type(a)) and isinstance(
                getattr(dev, "index", dev), int):
            device = int(getattr(dev, "index", dev) or 0)
        else:
            device = "host"
    try:
        shape, dtype = tuple(a.shape), a.dtype
    except AttributeError:
        raise InvalidInputError(f"empty_like needs an array with shape and dtype, not {type(a).__name__}") from None
    return empty(shape, dtype, device=device)


def span_of(obj: Any) -> tuple[Any, tuple[int, ...] | None]:
    """For a strided NumPy array (a column, every other row...): a contiguous
    byte array over the memory it spans, which holds ``obj``, and its byte
    strides.  Anything else: ``(obj, None)``.

    Raises
    ------
    InvalidInputError
        Negative strides, or strides that are not whole items.
    """
    import ctypes

    ai = obj.__array_interface__ if type(obj).__module__ == "numpy" and hasattr(obj, "__array_interface__") else None
    if not isinstance(ai, dict) or ai.get("strides") is None or not isinstance(ai.get("data"), tuple):
        return obj, None
    shape, strides = tuple(ai["shape"]), tuple(ai["strides"])
    itemsize = int(obj.itemsize)
    if any(d == 0 for d in shape):
        return obj, None  # nothing to span: export refuses it as empty
    if any(s < 0 for s in strides) or any(s % itemsize for s in strides):
        raise InvalidInputError(
            f"array is not C-contiguous and its strides {strides} are negative or not whole {itemsize}-byte "
            "items; pass a C-contiguous copy instead: numpy.ascontiguousarray(a)"
        )
    span = itemsize + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
    address, readonly = ai["data"]
    raw = (ctypes.c_uint8 * span).from_address(address)
    raw._owner = obj  # type: ignore[attr-defined]  # the memory lives as long as the span does
    import numpy as np

    memory = np.ctypeslib.as_array(raw)
    if readonly:
        memory.flags.writeable = False
    return memory, strides
