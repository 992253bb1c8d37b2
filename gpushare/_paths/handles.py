"""The handle types of :func:`gpushare.export_buffer` and
:func:`gpushare.import_buffer`: which path's code exports a buffer with
which handle type, and which imports a descriptor (the one table of them
outside the paths' own modules)."""

from __future__ import annotations

from typing import Any

from .._cuda import vmm
from .._descriptors import (
    CudaIpcBufferDescriptor,
    CudaPoolBufferDescriptor,
    PosixFdBufferDescriptor,
    VirtualMemoryFabricBufferDescriptor,
)
from .._errors import InvalidInputError, UnsupportedError, InvalidTypeError
from .._types import internal_handle_type
from . import cuda_ipc, host_fd, posix_fd
# Named here for the modules above the paths, which may not import a path module
# (tests/test_paths_closed.py): gs.allocate's host buffer is host-fd's.
from .host_fd import HostBuffer, allocate_host

__all__ = ["HostBuffer", "allocate_host", "export_buffer", "import_buffer", "HOST_HANDLE_TYPES", "CUDA_HANDLE_TYPES"]

#: The handle types host memory from gpushare.allocate is exported with.
HOST_HANDLE_TYPES = ("posix-fd",)
#: The handle types any CUDA memory is exported with (VMM memory adds those its device supports).
CUDA_HANDLE_TYPES = ("cuda-ipc",)


def export_buffer(buffer: Any, handle_type: str | None) -> Any:
    """The descriptor of ``buffer`` with ``handle_type`` (checked; None: the best it supports)."""
    if isinstance(buffer, host_fd.HostBuffer):
        if handle_type not in (None, "posix-fd"):
            raise UnsupportedError(f"host buffers are exported with 'posix-fd', not {handle_type!r}")
        return host_fd.export_host(buffer)
    if vmm.is_vmm_buffer(buffer) and handle_type != "cuda-ipc":
        if vmm.export_handle_type(buffer, internal_handle_type(handle_type)) == vmm.FABRIC:
            return vmm.export_fabric(buffer)
        return posix_fd.export_device(buffer)
    if handle_type in (None, "cuda-ipc"):
        return cuda_ipc.export_ipc(buffer)
    raise UnsupportedError(
        f"handle_type={handle_type!r} needs a buffer from gpushare.allocate(); "
        f"{type(buffer).__name__} can be shared with handle_type='cuda-ipc'"
    )


def import_buffer(descriptor: Any, device: int | None, readonly: bool, timeout: dict) -> Any:
    """Map the memory ``descriptor`` names (``device``, ``readonly`` and
    ``timeout``, as keyword arguments, checked by the caller)."""
    if isinstance(descriptor, PosixFdBufferDescriptor):
        if descriptor.device == "host":
            if device is not None:
                raise InvalidInputError(f"device={device} given for a descriptor of host memory")
            return host_fd.import_host(descriptor, **timeout)
        return posix_fd.import_device(descriptor, device, readonly=readonly, **timeout)
    if isinstance(descriptor, CudaIpcBufferDescriptor):
        return cuda_ipc.import_ipc(descriptor, device, readonly=readonly)
    if isinstance(descriptor, CudaPoolBufferDescriptor):
        return cuda_ipc.import_pool(descriptor, device, readonly=readonly, **timeout)
    try:
        fabric = VirtualMemoryFabricBufferDescriptor._coerce(descriptor)
    except InvalidInputError:
        raise InvalidTypeError(
            f"import_buffer expects a descriptor from gpushare.export_buffer, not {type(descriptor).__name__}"
        ) from None
    return vmm.import_device(fabric, device, readonly=readonly)
