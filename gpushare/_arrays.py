"""Typed arrays over shareable memory: dtype and shape checks, and the CUDA
array object that :func:`gpushare.empty` and channels hand out on a device.

NumPy describes host memory itself; for CUDA memory, :class:`CudaArray` is a
small C-contiguous array object that CuPy, PyTorch, Numba and JAX take
without a copy, through ``__cuda_array_interface__`` and DLPack.
"""

from __future__ import annotations

import re
from typing import Any

from ._errors import InvalidInputError

__all__ = ["CudaArray", "portable_typestr", "check_shape", "MAX_DIMS"]

MAX_DIMS = 32
_TYPESTR = re.compile(r"^[<>|=][biufcV]\d{1,4}\Z")


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
        from . import _dlpack

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
