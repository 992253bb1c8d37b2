"""A small DLPack producer for views of shared memory.

cuda.core's ``Buffer.__dlpack__`` cannot mark memory read-only and always
exports bytes; a view must export the share's dtype and shape, and a
read-only share must reach its consumers as read-only.  :func:`capsule`
builds the capsule itself (DLPack 1.0 ``dltensor_versioned`` with the
read-only flag, or the unversioned ``dltensor`` for older consumers when the
memory is writable) and keeps ``owner`` alive until the consumer is done
with it: the consumer calls the tensor's deleter, or the capsule is dropped
unconsumed.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
from typing import Any

__all__ = ["capsule", "dtype_of", "live_count", "borrow", "Borrowed", "dlpack_only_name"]

_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY
_VERSION = (1, 0)


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    ]


_lock = threading.Lock()
#: address of a managed tensor -> (the struct, its shape and strides arrays, the owner)
_live: dict[int, tuple[Any, Any, Any]] = {}


def _delete(address: int | None) -> None:
    if address:
        with _lock:
            _live.pop(address, None)


_deleter = _Deleter(_delete)
_exit_hooked = False


def _at_exit() -> None:
    """Interpreter exit: a consumer's tensor still alive now is released in
    the last collection, after this module's globals (``_live``, the
    callbacks) are gone, and calling its deleter then crashed the process.
    Leak what it would touch instead: every live struct stays, its deleter
    NULL (DLPack consumers call none then), and the callbacks stay valid for
    capsules never consumed."""
    with _lock:
        kept = list(_live.values())
        for managed, _, _ in kept:
            managed.deleter = _Deleter()
    for obj in (kept, _deleter, _destructor):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _destroy(capsule_address: int) -> None:
    # A capsule dropped before any consumer renamed it ("used_dltensor"):
    # the producer frees the tensor.  The argument is a raw pointer on
    # purpose: a Python reference to a dying object would revive it.
    for name in (_NAME, _NAME_VERSIONED):
        if _capsule_valid(capsule_address, name):
            _delete(_capsule_pointer(capsule_address, name))
            return


_destructor = _Destructor(_destroy)

# typestr kind -> DLPack type code
_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


def dtype_of(typestr: str) -> tuple[int, int] | None:
    """DLPack (code, bits) of an array-interface typestr, or ``None`` when
    DLPack has no such type (big-endian, datetime, object, ...)."""
    if len(typestr) < 3 or typestr[0] not in "<|" or typestr[1] not in _CODES:
        return None
    try:
        size = int(typestr[2:])
    except ValueError:
        return None
    if size not in (1, 2, 4, 8, 16):
        return None
    return _CODES[typestr[1]], size * 8


def live_count() -> int:
    """Tensors exported and not yet released by their consumers."""
    with _lock:
        return len(_live)


def capsule(address: int, shape: tuple[int, ...], typestr: str, device: tuple[int, int], *,
            readonly: bool, owner: Any, max_version: Any = None,
            dl_dtype: tuple[int, int, int] | None = None, strides: tuple[int, ...] | None = None) -> Any:
    """A DLPack capsule of C-contiguous memory at ``address``.

    ``owner`` is kept alive until the consumer releases the tensor.  A
    consumer that asks for DLPack 1.0 (``max_version >= (1, 0)``) gets a
    versioned tensor, read-only when ``readonly``; an older consumer gets an
    unversioned one, refused (``BufferError``) for read-only memory, which it
    could not know not to write.  ``dl_dtype`` (code, bits, lanes) gives a
    dtype that has no typestr (bfloat16, float8, complex32); ``typestr`` then
    only says its size.
    """
    dtype = dtype_of(typestr) if dl_dtype is None else (dl_dtype[0], dl_dtype[1])
    if dtype is None and strides is not None:
        raise BufferError(f"a strided array of {typestr} items has no DLPack form")
    if dtype is None:
        nbytes = int(typestr[2:]) if typestr[2:].isdigit() else 1
        for d in shape:
            nbytes *= d
        shape, dtype = (nbytes,), (1, 8)
    versioned = False
    if max_version is not None:
        if not isinstance(max_version, tuple) or len(max_version) != 2:
            raise BufferError(f"max_version must be a (major, minor) tuple, not {max_version!r}")
        versioned = tuple(max_version) >= _VERSION
    if readonly and not versioned:
        raise BufferError(
            "this memory is read-only, which only DLPack 1.0 can say: the consumer must ask with "
            "max_version=(1, 0) (NumPy 2.1+, recent PyTorch and CuPy do)"
        )
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed: Any = _ManagedVersioned() if versioned else _Managed()
    t = managed.dl_tensor
    t.data = address
    t.device.device_type, t.device.device_id = device
    t.ndim = len(shape)
    t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype[0], dtype[1], 1 if dl_dtype is None else dl_dtype[2]
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    steps = None
    if strides is not None:  # DLPack counts strides in items, not bytes
        itemsize = int(typestr[2:])
        steps = (ctypes.c_int64 * max(len(strides), 1))(*(s // itemsize for s in strides))
        t.strides = ctypes.cast(steps, ctypes.POINTER(ctypes.c_int64))
    else:
        t.strides = ctypes.POINTER(ctypes.c_int64)()  # NULL: C-contiguous
    t.byte_offset = 0
    managed.deleter = _deleter
    if versioned:
        managed.version.major, managed.version.minor = _VERSION
        managed.flags = _READ_ONLY if readonly else 0
    at = ctypes.addressof(managed)
    global _exit_hooked
    with _lock:
        _live[at] = (managed, (dims, steps), owner)
        if not _exit_hooked:
            atexit.register(_at_exit)
            _exit_hooked = True
    try:
        return _capsule_new(at, _NAME_VERSIONED if versioned else _NAME,
                            ctypes.cast(_destructor, ctypes.c_void_p))
    except BaseException:
        _delete(at)
        raise


# ---------------------------------------------------------------- consuming

#: DLPack dtype codes that name a type no array-interface typestr can.
_DLPACK_ONLY = {(4, 16): "bfloat16", (5, 32): "complex32", (7, 8): "float8_e3m4", (8, 8): "float8_e4m3",
                (9, 8): "float8_e4m3b11fnuz", (10, 8): "float8_e4m3fn", (11, 8): "float8_e4m3fnuz",
                (12, 8): "float8_e5m2", (13, 8): "float8_e5m2fnuz", (14, 8): "float8_e8m0fnu"}


def dlpack_only_name(code: int, bits: int, lanes: int = 1) -> str | None:
    """The name of a DLPack-only dtype (bfloat16, float8, complex32), else ``None``."""
    name = _DLPACK_ONLY.get((code, bits))
    if name is None:
        return None
    return name if lanes == 1 else f"{name}x{lanes}"


class Borrowed:
    """A DLPack tensor read without being consumed: the capsule (kept here)
    stays alive, and its producer frees the tensor when the capsule goes."""

    __slots__ = ("address", "capsule", "device", "dtype", "readonly", "shape", "strides")

    def __init__(self, capsule: Any, address: int, shape: tuple[int, ...], strides: tuple[int, ...] | None,
                 dtype: tuple[int, int, int], device: tuple[int, int], readonly: bool) -> None:
        self.capsule, self.address, self.shape, self.strides = capsule, address, shape, strides
        self.dtype, self.device, self.readonly = dtype, device, readonly

    @property
    def itemsize(self) -> int:
        code, bits, lanes = self.dtype
        return max(1, bits * lanes // 8)

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    def contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


def borrow(obj: Any, stream: Any = None) -> Borrowed:
    """Read ``obj.__dlpack__()``'s tensor (data, shape, strides, dtype,
    device) without consuming it.

    Raises
    ------
    BufferError
        ``obj`` gave something that is not a DLPack capsule, or one too large to trust.
    """
    try:
        cap = obj.__dlpack__(stream=stream, max_version=_VERSION)
    except TypeError:
        cap = obj.__dlpack__(stream=stream) if stream is not None else obj.__dlpack__()
    for name, struct in ((_NAME_VERSIONED, _ManagedVersioned), (_NAME, _Managed)):
        if _capsule_valid(id(cap), name):
            managed = struct.from_address(_capsule_pointer(id(cap), name))
            break
    else:
        raise BufferError(f"{type(obj).__name__}.__dlpack__ did not return a DLPack capsule")
    t = managed.dl_tensor
    if not 0 <= t.ndim <= 64:
        raise BufferError(f"DLPack tensor has {t.ndim} dimensions")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides else None
    readonly = bool(struct is _ManagedVersioned and managed.flags & _READ_ONLY)
    return Borrowed(cap, int(t.data or 0) + int(t.byte_offset), shape, strides,
                    (int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes)),
                    (int(t.device.device_type), int(t.device.device_id)), readonly)
