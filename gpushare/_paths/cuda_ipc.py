"""The cuda-ipc path: legacy CUDA IPC for device memory not from VMM.

The exporter takes the IPC handle of the whole base allocation that contains
the buffer (``cuMemGetAddressRange``) and sends the offset along.  Opening a
handle costs about a millisecond, so the importer opens each base allocation
once and shares the mapping among every buffer imported from it; the handle
is closed when the last of them is closed.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Any

from .._descriptors import CudaIpcBufferDescriptor
from .._errors import CUDAError, InvalidInputError, UnsupportedError
from . import _cuda
from .broker import node_identity
from .host_fd import check_same_node

__all__ = ["export_ipc", "import_ipc", "open_handle_count"]

_lock = threading.Lock()
#: (exporter pid, handle bytes, device) -> [base pointer, mapped size, users]
_opened: dict[tuple[int, bytes, int], list[int]] = {}
_Ref: type | None = None


def open_handle_count() -> int:
    """How many base allocations this process has open through CUDA IPC."""
    with _lock:
        return len(_opened)


def _pointer_and_size(obj: Any) -> tuple[int, int]:
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        itemsize = int(cai["typestr"][2:])
        strides = cai.get("strides")
        if strides is not None:
            expected = []
            step = itemsize
            for dim in reversed(shape):
                expected.append(step)
                step *= dim
            if tuple(reversed(expected)) != tuple(strides) and math.prod(shape) > 1:
                raise InvalidInputError("only C-contiguous arrays can be exported through CUDA IPC")
        return int(cai["data"][0]), math.prod(shape) * itemsize
    if hasattr(obj, "handle") and hasattr(obj, "size") and getattr(obj, "is_device_accessible", False):
        return int(obj.handle), int(obj.size)
    raise InvalidInputError(
        f"cannot export {type(obj).__name__}: expected a cuda.core Buffer or an object "
        "with __cuda_array_interface__"
    )


def export_ipc(obj: Any) -> CudaIpcBufferDescriptor:
    """The legacy CUDA IPC descriptor of a device buffer or array.

    Raises
    ------
    UnsupportedError
        For memory legacy IPC cannot export: memory from a stream-ordered
        pool (``cudaMallocAsync``, cuda.core's ``Device.allocate``, torch's
        expandable segments) or CUDA virtual memory not from
        :func:`gpushare.allocate`.
    """
    drv = _cuda.driver()
    ptr, size = _pointer_and_size(obj)
    hint = getattr(obj, "device_id", None)
    ordinal = _cuda.pointer_ordinal(ptr, hint if isinstance(hint, int) and hint >= 0 else None)
    attrs = drv.CUpointer_attribute
    with _cuda.on_device(ordinal):
        capable = _cuda.check(drv.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr),
                              "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)")
        if not int(capable):
            raise UnsupportedError(
                "legacy CUDA IPC cannot export this memory: it comes from a stream-ordered memory pool "
                "(cudaMallocAsync, cuda.core Device.allocate, torch expandable segments) or from CUDA "
                "virtual memory; allocate it with gpushare.allocate(size, device=N) to share it on this "
                "node, or share it over ucx-rma"
            )
        base, base_size = _cuda.check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        handle = _cuda.check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    return CudaIpcBufferDescriptor._from_fields(
        _cuda.bytes_of(handle, 64),
        int(base_size),
        ptr - int(base),
        size,
        ordinal,
        _cuda.device_uuid(ordinal),
        os.getpid(),
        node_identity(),
    )


def _ref_class() -> type:
    global _Ref
    if _Ref is not None:
        return _Ref
    from cuda.core._memory._buffer import MemoryResource

    class IpcRef(MemoryResource):  # type: ignore[misc]
        """One importer's use of an opened base allocation."""

        def __init__(self, key: tuple[int, bytes, int], ordinal: int) -> None:
            self.key = key
            self.ordinal = ordinal
            self.done = False

        def allocate(self, size: int, *, stream: Any = None) -> Any:
            raise UnsupportedError("imported CUDA IPC memory cannot allocate")

        def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
            try:
                _unuse(self)
            except CUDAError as exc:  # from close() or the garbage collector: warn, never crash
                warnings.warn(f"closing a CUDA IPC handle failed: {exc}", ResourceWarning, 2)

        is_device_accessible = property(lambda self: True)
        is_host_accessible = property(lambda self: False)
        is_managed = property(lambda self: False)
        device_id = property(lambda self: self.ordinal)

    _Ref = IpcRef
    return _Ref


def _unuse(ref: Any) -> None:
    drv = _cuda.driver()
    with _lock:
        if ref.done:
            return
        ref.done = True
        entry = _opened.get(ref.key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del _opened[ref.key]
            # Any thread may get here (close, finalizers, the garbage
            # collector): the handle belongs to the device's context.
            with _cuda.on_device(ref.ordinal):
                _cuda.check(drv.cuIpcCloseMemHandle(entry[0]), "cuIpcCloseMemHandle")


def import_ipc(desc: CudaIpcBufferDescriptor, device: int | None, *, readonly: bool = False) -> Any:
    """Open (or reuse) the base allocation and return a cuda.core ``Buffer``
    of the described range."""
    check_same_node(desc)
    if readonly:
        raise UnsupportedError(
            "legacy CUDA IPC maps memory writable only; a read-only share cannot be opened over cuda-ipc"
        )
    if desc.pid == os.getpid():
        raise UnsupportedError(
            "a CUDA IPC handle cannot be opened in the process that exported it; use the original buffer"
        )
    drv = _cuda.driver()
    from cuda.core import Buffer

    ordinal = _cuda.import_ordinal(desc.owner_uuid, device)
    key = (desc.pid, desc.handle, ordinal)
    with _cuda.on_device(ordinal), _lock:
        entry = _opened.get(key)
        if entry is None:
            handle = _cuda.set_bytes(drv.CUipcMemHandle(), desc.handle)
            flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            base = int(_cuda.check(drv.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle"))
            try:
                _, real = _cuda.check(drv.cuMemGetAddressRange(base), "cuMemGetAddressRange")
            except BaseException:
                drv.cuIpcCloseMemHandle(base)
                raise
            entry = [base, int(real), 0]
            _opened[key] = entry
        if desc.offset + desc.size > entry[1]:
            if entry[2] == 0:
                del _opened[key]
                drv.cuIpcCloseMemHandle(entry[0])
            raise InvalidInputError(
                f"buffer of {desc.size} bytes at offset {desc.offset} does not fit in the "
                f"opened allocation of {entry[1]} bytes"
            )
        entry[2] += 1
        ref = _ref_class()(key, ordinal)
        return Buffer.from_handle(entry[0] + desc.offset, desc.size, mr=ref)
