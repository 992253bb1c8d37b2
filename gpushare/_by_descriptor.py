"""Same-node sharing: :func:`allocate`, :func:`export_buffer`, :func:`import_buffer`.

Host memory goes through memfds and the exporter's broker (the host-fd path),
CUDA virtual memory through POSIX-fd or fabric handles, other CUDA memory
through legacy CUDA IPC.  CUDA itself loads on first use.
"""

from __future__ import annotations

from typing import Any, Literal, overload

from . import _memory, _types
from ._cuda import vmm
from ._descriptors import PosixFdBufferDescriptor
from ._types import integer as _integer
from ._errors import InvalidInputError, InvalidTypeError
from ._paths import handles
from ._paths.handles import HostBuffer, allocate_host

__all__ = ["allocate", "export_buffer", "import_buffer"]


@overload
def allocate(size: int, device: Literal["host", "cpu"] = ..., *, chunk_size: int | None = ...,
             huge_pages: Any = ...) -> HostBuffer: ...
@overload
def allocate(size: int, device: int, *, chunk_size: int | None = ...,
             huge_pages: Any = ...) -> Any: ...  # a cuda.core Buffer
def allocate(size: int, device: _types.Device = "host", *, chunk_size: int | None = None,
             huge_pages: Any = "auto") -> Any:
    """Allocate memory that another process can import.

    Parameters
    ----------
    size : int
        Bytes, at least 1.
    device : int or {"host", "cpu"}, default "host"
        ``"host"`` (or its synonym ``"cpu"``; the default, as for
        :func:`gpushare.empty`): host memory in memfds.  A CUDA device
        ordinal: CUDA virtual memory, exportable with every handle type the
        device supports (POSIX fd; fabric too where the device and an IMEX
        channel allow it).
    chunk_size : int, optional
        Largest physical allocation; the buffer is made of as many as needed,
        mapped contiguously in address order.  Rounded up to the CUDA
        allocation granularity; for host memory, a multiple of the page size.
        One allocation by default.
    huge_pages : {"auto", "thp", "hugetlb", False}, default "auto"
        Host memory only.  ``"auto"``: advise transparent huge pages for a
        buffer of 2 MiB or more, as NumPy does for its large arrays (they back
        it where the system's ``transparent_hugepage/shmem_enabled`` honours
        the advice; ``buf.huge_pages`` says whether it does).  ``"thp"``:
        advise them at any size.  ``"hugetlb"``: take reserved huge pages
        (``vm.nr_hugepages``), faulted in at once; :class:`UnsupportedError`
        where there are not enough.  ``False``: ordinary pages.  Fewer pages
        make allocation, first touch and importers' first copies cheaper
        (see docs/same-node.md).

    Returns
    -------
    cuda.core.Buffer or HostBuffer
        A cuda.core ``Buffer`` for a device; for ``"host"``, a host buffer with
        ``__array_interface__`` (``numpy.asarray`` views it without a copy),
        ``memoryview()``, ``close()`` and the context-manager protocol.

    Raises
    ------
    InvalidInputError
        A size or chunk size out of range, or an unknown device.
    UnsupportedError
        No CUDA driver, or a device that cannot export VMM memory.
    OutOfMemoryError
        More host memory than this machine's RAM and swap together (at once:
        nothing is allocated), or a CUDA device out of memory
        (:class:`CUDAOutOfMemoryError`).
    """
    size = _integer(size, "size")
    if chunk_size is not None:
        chunk_size = _integer(chunk_size, "chunk_size")
    if _types.is_host(device):
        _memory.check_host(size)
        return allocate_host(size, chunk_size=chunk_size, huge_pages=huge_pages)
    if huge_pages != "auto":
        raise InvalidInputError("huge_pages= is for host memory; CUDA virtual memory uses the device's own "
                                "large pages (its allocation granularity)")
    if isinstance(device, str):
        raise InvalidInputError(f"device is {device!r}; expected 'host' (or 'cpu') or a device ordinal")
    ordinal = _integer(device, "device")
    if size <= 0:
        raise InvalidInputError(f"size is {size}; expected a positive integer")
    if chunk_size is not None and chunk_size <= 0:
        raise InvalidInputError(f"chunk_size is {chunk_size}; expected a positive integer")
    return vmm.allocate_device(size, ordinal, chunk_size=chunk_size)


def export_buffer(buffer: Any, *, handle_type: _types.HandleType | None = None) -> Any:
    """Describe ``buffer`` so that another process can import it.

    Parameters
    ----------
    buffer : HostBuffer, cuda.core.Buffer or CUDA array
        A buffer from :func:`allocate` (host or device); or, with
        ``handle_type="cuda-ipc"`` (or ``None``), any device memory: a cuda.core
        ``Buffer`` or an object with ``__cuda_array_interface__``.
    handle_type : {"posix-fd", "fabric", "cuda-ipc"}, optional
        ``None`` picks the best the buffer supports: ``"posix-fd"`` for host
        buffers; ``"fabric"``, else ``"posix-fd"`` for :func:`allocate`'d device
        buffers; ``"cuda-ipc"`` for other device memory.  The spellings
        ``"posix_fd"`` and ``"cuda_ipc"`` still work but are deprecated.

    Returns
    -------
    PosixFdBufferDescriptor, VirtualMemoryFabricBufferDescriptor or CudaIpcBufferDescriptor
        Plain data; pickle it to the importer.  Exporting the same buffer
        again returns the same posix-fd descriptor.

    Raises
    ------
    UnsupportedError
        The buffer cannot be exported with ``handle_type`` here; the message
        says why (for fabric: the device or IMEX channel lacking).
    ClosedError
        The buffer was closed.

    Notes
    -----
    The exporter must keep the buffer open until every importer has imported
    it; see the same-node page of the documentation for lifetimes.
    """
    handle_type = _types.handle_type(handle_type)
    return handles.export_buffer(buffer, handle_type)


def import_buffer(descriptor: Any, *, device: int | None = None, readonly: bool = False,
                  timeout: float | None = None) -> Any:
    """Map the memory a descriptor names into this process.

    Mirrors cuda.core's ``Buffer.from_ipc_descriptor()``: the allocations are
    mapped into one contiguous range.

    Parameters
    ----------
    descriptor : PosixFdBufferDescriptor, VirtualMemoryFabricBufferDescriptor or CudaIpcBufferDescriptor
        From :func:`export_buffer` in another process (cuda.core's own
        ``VirtualMemoryFabricBufferDescriptor`` is accepted too).  Untrusted:
        it is validated before any mapping.
    device : int, optional
        The CUDA device (an ordinal of this process) to map device memory
        on.  By default the calling thread's current device, where it is the
        memory's own device or can reach it as a peer; else the memory's own
        device, found by its UUID (ordinals differ between processes with
        another ``CUDA_VISIBLE_DEVICES``); else device 0.  The calling
        thread's current context is left as it was.  Must be ``None`` for
        host memory.
    timeout : float, optional
        Seconds the exporter's broker may take to hand the file descriptors
        over (5 by default).
    readonly : bool, default False
        Map device memory with read-only access (``posix-fd`` and ``fabric``;
        legacy CUDA IPC cannot and refuses).

    Returns
    -------
    HostBuffer or cuda.core.Buffer
        Its ``close()`` unmaps, frees the reservation and closes or releases
        the handles, once.

    Raises
    ------
    InvalidInputError
        A malformed descriptor, or memory whose real size differs from it.
    AccessDeniedError
        The exporter refused the token or this user.
    ExporterUnreachableError
        The exporter exited, closed the buffer or did not answer in time.
    UnsupportedError
        Exported on another node, or no CUDA driver for device memory.
    """
    if _types.is_host(device):
        if not (isinstance(descriptor, PosixFdBufferDescriptor) and descriptor.device == "host"):
            raise InvalidInputError(f"device={device!r} given for a descriptor of CUDA memory")
        device = None
    if device is not None:
        device = _integer(device, "device")
    if not isinstance(readonly, bool):
        raise InvalidTypeError(f"readonly must be a bool, not {type(readonly).__name__}")
    return handles.import_buffer(descriptor, device, readonly, _timeout(timeout))


def _timeout(timeout: float | None) -> dict:
    if timeout is None:
        return {}
    return {"timeout": _types.positive_timeout(timeout)}
