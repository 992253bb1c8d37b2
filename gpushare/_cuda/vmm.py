"""CUDA virtual memory (VMM): what the posix-fd and fabric paths share.

:func:`allocate_device` creates physical allocations exportable with every
handle type the device supports (POSIX fd; fabric too where the device and an
IMEX channel allow it), maps them back to back into one reservation, and
returns a cuda.core ``Buffer``.  Export turns each physical allocation into a
shareable handle (POSIX fds, which the posix-fd path hands over through its
broker, or 64-byte fabric handles); import does
``cuMemImportFromShareableHandle`` + ``cuMemAddressReserve`` + ``cuMemMap`` +
``cuMemSetAccess`` and returns a ``Buffer`` whose close unmaps, frees the
reservation and releases the handles once.

Thin on purpose: every driver call goes through :func:`._driver.check`.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._descriptors import (
    FABRIC_HANDLE_BYTES,
    PosixFdBufferDescriptor,
    VirtualMemoryFabricBufferDescriptor,
)
from .._errors import ClosedError, CUDAError, InvalidInputError, UnsupportedError
from .._ranges import Ranges
from .._types import round_up
from . import _copies, _driver

__all__ = ["allocate_device", "export_fabric", "export_handle_type", "export_posix_fds", "import_device",
           "map_device", "is_vmm_buffer", "mapping_count", "posix_fds", "POSIX_FD", "FABRIC"]

#: The handle types a VMM allocation is exported with, as this module spells
#: them (the public spelling has a hyphen: ``_types.internal_handle_type``).
POSIX_FD, FABRIC = "posix_fd", "fabric"

_live_lock = threading.Lock()
_live: set[int] = set()  # ids of mappings not yet released


def mapping_count() -> int:
    """How many VMM mappings (allocated or imported) this process holds."""
    with _live_lock:
        return len(_live)


def _prop(drv: Any, ordinal: int, handle_types: Sequence[str], rdma: bool = False) -> Any:
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    if rdma:
        # Without it the memory cannot be registered for GPUDirect RDMA
        # (UCX over InfiniBand/RoCE would fall back to staging or fail).
        prop.allocFlags.gpuDirectRDMACapable = 1
    _set_handle_types(drv, prop, handle_types)
    return prop


def _set_handle_types(drv: Any, prop: Any, names: Sequence[str]) -> None:
    """Request every handle type in ``names``.  The driver takes a bit mask,
    but the bindings' setter accepts one enum member; a mask is written into
    the C struct (``requestedHandleTypes`` follows the 4-byte ``type``) after
    checking that the setter writes exactly there."""
    t = drv.CUmemAllocationHandleType
    members = {POSIX_FD: t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, FABRIC: t.CU_MEM_HANDLE_TYPE_FABRIC}
    chosen = [members[n] for n in names]
    if not chosen:
        prop.requestedHandleTypes = t.CU_MEM_HANDLE_TYPE_NONE
        return
    prop.requestedHandleTypes = chosen[-1]
    if len(chosen) == 1:
        return
    field = _driver.handle_types_field(prop)
    if field.value != int(chosen[-1]):
        raise UnsupportedError("cannot request several handle types: unexpected CUmemAllocationProp layout")
    mask = 0
    for member in chosen:
        mask |= int(member)
    field.value = mask


def _attribute(drv: Any, ordinal: int, name: str) -> int:
    attr = getattr(drv.CUdevice_attribute, name, None)
    if attr is None:
        return 0
    dev = _driver.check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    return int(_driver.check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


def device_handle_types(ordinal: int) -> tuple[list[str], str | None]:
    """Handle types the device's VMM allocations can be exported with, and
    why fabric is missing (``None`` when it is there)."""
    drv = _driver.driver()
    types = []
    if _attribute(drv, ordinal, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
        if _attribute(drv, ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
            types.append(POSIX_FD)
    else:
        return [], f"device {ordinal} does not support CUDA virtual memory management"
    if not _attribute(drv, ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"):
        return types, f"device {ordinal} does not support fabric handles (no NVLink fabric)"
    types.append(FABRIC)
    return types, None


def _access(drv: Any, ordinal: int, readonly: bool = False) -> Any:
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    flags = drv.CUmemAccess_flags
    desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _map(drv: Any, ordinal: int, handles: Sequence[Any], sizes: Sequence[int], gran: int,
         readonly: bool = False) -> int:
    """Reserve one range and map ``handles`` back to back into it, with
    access for device ``ordinal`` (read-only when asked); on failure nothing
    stays mapped or reserved (the handles stay the caller's)."""
    total = sum(sizes)
    ptr = _driver.check(drv.cuMemAddressReserve(total, gran, 0, 0), f"cuMemAddressReserve({total})")
    mapped: list[tuple[int, int]] = []
    try:
        offset = 0
        for i, (h, n) in enumerate(zip(handles, sizes, strict=True)):
            _driver.check(drv.cuMemMap(int(ptr) + offset, n, 0, h, 0), f"cuMemMap(allocation {i}, {n} bytes)")
            mapped.append((int(ptr) + offset, n))
            offset += n
        _driver.check(drv.cuMemSetAccess(ptr, total, [_access(drv, ordinal, readonly)], 1), "cuMemSetAccess")
    except BaseException:
        for at, n in mapped:
            drv.cuMemUnmap(at, n)
        drv.cuMemAddressFree(ptr, total)
        raise
    return int(ptr)


def _release_handles(drv: Any, handles: Sequence[Any]) -> None:
    for h in handles:
        drv.cuMemRelease(h)


class _Vmm:
    """Owns one contiguous VMM mapping: the reservation and the physical
    handles mapped into it; :meth:`release` (a cuda.core ``Buffer``'s
    ``deallocate``) releases them once.  Plain Python: a view's mapping
    (:func:`map_device`) needs no cuda.core; :func:`_mapping_class` makes
    it cuda.core's memory resource where a ``Buffer`` is asked for."""

    def __init__(
        self,
        ordinal: int,
        ptr: int,
        handles: list[Any],
        sizes: tuple[int, ...],
        handle_types: list[str],
        fabric_reason: str | None,
        exporter: bool,
        readonly: bool = False,
    ) -> None:
        self.ordinal = ordinal
        self.ptr = ptr
        self.handles = handles
        self.sizes = sizes
        self.handle_types = handle_types
        self.fabric_reason = fabric_reason
        self.exporter = exporter
        self.readonly = readonly
        self.devices = {ordinal}  # devices with access to the mapping
        self.lock = threading.Lock()
        self.closed = False
        #: The broker's export of the allocations' POSIX fds, made once by
        #: the posix-fd path: (broker, descriptor, the fds it serves).
        self.posix_export: tuple[Any, PosixFdBufferDescriptor, list[int]] | None = None
        #: The POSIX fds of the allocations, exported once, for shares' own registrations.
        self.posix_fds: list[int] | None = None
        with _live_lock:
            _live.add(id(self))

    def grant(self, ordinal: int) -> None:
        """Give device ``ordinal`` access too (read-only for a read-only
        mapping), so a copy or kernel on it can touch the memory."""
        drv = _driver.driver()
        with self.lock:
            if ordinal in self.devices:
                return
            if self.closed:
                raise ClosedError("the mapping is closed")
            total = sum(self.sizes)
            _driver.check(drv.cuMemSetAccess(self.ptr, total, [_access(drv, ordinal, self.readonly)], 1),
                        f"cuMemSetAccess(device {ordinal})")
            self.devices.add(ordinal)

    def allocate(self, size: int, *, stream: Any = None) -> Any:
        raise UnsupportedError("allocate through gpushare.allocate(size, device=...)")

    def deallocate_all(self) -> None:
        """:meth:`deallocate` of the whole mapping."""
        self.deallocate(self.ptr, sum(self.sizes))

    def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
        # Called by Buffer.close() and by the garbage collector: a driver
        # failure becomes a warning, and what is left stays mapped (a leak
        # is better than a dangling mapping).
        try:
            self.release()
        except CUDAError as exc:
            warnings.warn(f"releasing a VMM mapping failed; leaking the rest: {exc}", ResourceWarning, 2)

    def release(self) -> None:
        drv = _driver.driver()
        with self.lock:
            if self.closed:
                return
            self.closed = True
            export, self.posix_export = self.posix_export, None
            for fd in self.posix_fds or ():
                os.close(fd)
            self.posix_fds = None
            if export is not None:
                if export[0].pid == os.getpid():
                    export[0].revoke(export[1].export_id)
                for fd in export[2]:
                    os.close(fd)
            # gpushare's own copies on the memory must land before it
            # goes (an importer's view waited for its consumers' work
            # before it got here: Mapped.close); the exporter's own other
            # work is not waited for, as cuda.core's VMM resource does
            # not.  Any thread, the garbage collector's included, pushes
            # the device's context for the duration.
            _copies.wait_for_copies(self.ptr, sum(self.sizes))
            with _driver.on_device(self.ordinal):
                _driver.check(drv.cuMemUnmap(self.ptr, sum(self.sizes)), "cuMemUnmap")
                _driver.check(drv.cuMemAddressFree(self.ptr, sum(self.sizes)), "cuMemAddressFree")
                for h in self.handles:
                    _driver.check(drv.cuMemRelease(h), "cuMemRelease")
            with _live_lock:
                _live.discard(id(self))

    @property
    def is_device_accessible(self) -> bool:
        return True

    @property
    def is_host_accessible(self) -> bool:
        return False

    @property
    def is_managed(self) -> bool:
        return False

    @property
    def device_id(self) -> int:
        return self.ordinal


def _mapping_class() -> type:
    """:class:`_Vmm` as a cuda.core ``MemoryResource`` (made lazily so that
    importing gpushare does not import cuda.core)."""
    global _Mapping
    if _Mapping is not None:
        return _Mapping
    from cuda.core import MemoryResource

    class VmmMapping(_Vmm, MemoryResource):  # type: ignore[misc]
        """Owns one contiguous VMM mapping (:class:`_Vmm`), as cuda.core's memory resource."""

    _Mapping = VmmMapping
    return _Mapping


_Mapping: type | None = None


def _rdma_capable(drv: Any, ordinal: int) -> bool:
    return bool(_attribute(drv, ordinal, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))


def allocate_device(size: int, device: int, *, chunk_size: int | None = None) -> Any:
    """A cuda.core ``Buffer`` of ``size`` bytes of VMM memory on ``device``,
    exportable with every handle type the device supports, registrable for
    GPUDirect RDMA where the device supports it.  The calling thread's
    current context is left as it was."""
    drv = _driver.driver()
    from cuda.core import Buffer

    ordinal = _driver.valid_ordinal(device)
    types, fabric_reason = device_handle_types(ordinal)
    if not types:
        raise UnsupportedError(fabric_reason or f"device {ordinal} cannot export VMM memory")
    rdma = _rdma_capable(drv, ordinal)
    gran_flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    prop = _prop(drv, ordinal, types, rdma)
    gran = int(_driver.check(drv.cuMemGetAllocationGranularity(prop, gran_flag), "granularity"))
    chunk = round_up(chunk_size or size, gran)
    count = -(-size // chunk)
    sizes = tuple([chunk] * (count - 1) + [round_up(size - chunk * (count - 1), gran)])
    handles: list[Any] = []
    with _driver.on_device(ordinal):
        try:
            for n in sizes:
                try:
                    handles.append(_driver.check(drv.cuMemCreate(n, prop, 0), f"cuMemCreate({n})"))
                except CUDAError as exc:
                    if FABRIC not in types or handles:
                        raise
                    # Fabric needs an IMEX channel this process can open; fall back.
                    fabric_reason = (
                        f"allocating with fabric handles failed ({exc.status}); "
                        "is an IMEX channel (/dev/nvidia-caps-imex-channels) accessible?"
                    )
                    types = [t for t in types if t != FABRIC]
                    prop = _prop(drv, ordinal, types, rdma)
                    handles.append(_driver.check(drv.cuMemCreate(n, prop, 0), f"cuMemCreate({n})"))
            ptr = _map(drv, ordinal, handles, sizes, gran)
        except BaseException:
            _release_handles(drv, handles)
            raise
        mr = _mapping_class()(ordinal, ptr, handles, sizes, types, fabric_reason, True)
        # Buffer.from_handle records the current context's default stream
        # for deallocation: it needs the context pushed above.
        buf = Buffer.from_handle(ptr, size, mr=mr)
    _allocated.add(int(buf.handle), int(buf.handle) + int(buf.size), None, weakref.ref(buf))
    return buf


def _exportable(buf: Any) -> bool:
    mr = getattr(buf, "memory_resource", None)
    return mr is not None and not getattr(mr, "closed", True) and bool(getattr(mr, "exporter", False))


#: VMM buffers this process allocated (and can export), by address, to find the one a CUDA
#: array lies in (by bisection, not buffer by buffer).
_allocated = Ranges(_exportable)


def containing(address: int, nbytes: int) -> tuple[Any, int] | None:
    """The open VMM buffer this process allocated that holds ``nbytes``
    bytes at ``address`` (a slice or typed view of an array over it, made by
    CuPy, torch or ``gpushare.empty``), and the offset in it."""
    for ref in _allocated.candidates(address, nbytes, None):
        buf = ref()
        if buf is None or not _exportable(buf):
            continue
        start = int(buf.handle)
        if start <= address and address + nbytes <= start + int(buf.size):
            return buf, address - start
    return None


def is_vmm_buffer(buf: Any) -> bool:
    return _Mapping is not None and isinstance(getattr(buf, "memory_resource", None), _Mapping)


def _exportable(buf: Any) -> Any:
    """The memory resource of a buffer this process allocated and may export."""
    mr = buf.memory_resource
    if mr.closed or buf.is_closed:
        raise ClosedError("cannot export a closed buffer")
    if not mr.exporter:
        raise UnsupportedError("this buffer was imported; only the process that allocated it can export it")
    return mr


def export_handle_type(buf: Any, handle_type: str | None) -> str:
    """The handle type a buffer from :func:`allocate_device` is exported
    with: ``handle_type`` if it supports it (``None``: fabric where it can,
    else posix_fd); else :class:`UnsupportedError` saying why not."""
    mr = _exportable(buf)
    if handle_type is None:
        handle_type = FABRIC if FABRIC in mr.handle_types else POSIX_FD
    if handle_type not in mr.handle_types:
        why = mr.fabric_reason if handle_type == FABRIC else None
        raise UnsupportedError(
            f"this buffer cannot be exported with handle_type={handle_type!r}"
            + (f": {why}" if why else f"; it supports {mr.handle_types}")
        )
    return handle_type


def export_fabric(buf: Any) -> VirtualMemoryFabricBufferDescriptor:
    """The fabric descriptor of a buffer from :func:`allocate_device`."""
    drv = _driver.driver()
    export_handle_type(buf, FABRIC)
    mr = buf.memory_resource
    t = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    handles = [
        _driver.bytes_of(_driver.check(drv.cuMemExportToShareableHandle(h, t, 0), "export fabric"),
                         FABRIC_HANDLE_BYTES)
        for h in mr.handles
    ]
    return VirtualMemoryFabricBufferDescriptor.from_handles(
        handles, mr.sizes, size=buf.size, owner_uuid=_driver.device_uuid(mr.ordinal)
    )


def _export_fds(drv: Any, mr: Any) -> list[int]:
    """New POSIX fds of the allocations of ``mr``, the caller's to close."""
    t = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    fds: list[int] = []
    try:
        for h in mr.handles:
            fds.append(int(_driver.check(drv.cuMemExportToShareableHandle(h, t, 0), "export posix fd")))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def export_posix_fds(buf: Any) -> list[int]:
    """New POSIX fds of the allocations of a buffer from
    :func:`allocate_device`, the caller's to close (or to hand to
    ``memory_resource.posix_export``, whose release closes them)."""
    drv = _driver.driver()
    export_handle_type(buf, POSIX_FD)
    return _export_fds(drv, buf.memory_resource)


def posix_fds(buf: Any) -> list[int]:
    """The POSIX fds of a buffer from :func:`allocate_device` (borrowed: the
    buffer keeps them), exported once and registered with no broker."""
    drv = _driver.driver()
    mr = _exportable(buf)
    if POSIX_FD not in mr.handle_types:
        raise UnsupportedError(f"this buffer cannot be exported with handle_type='posix-fd'; it supports "
                               f"{mr.handle_types}")
    with mr.lock:
        if mr.posix_fds is None:
            mr.posix_fds = _export_fds(drv, mr)
        return list(mr.posix_fds)


def import_device(desc: PosixFdBufferDescriptor | VirtualMemoryFabricBufferDescriptor, device: int | None,
                  *, readonly: bool = False, fetch_fds: Callable[[], Sequence[int]] | None = None) -> Any:
    """Map the allocations ``desc`` names into one reservation; a cuda.core
    ``Buffer`` whose close unmaps and releases them.  The mapping is
    accessible to the chosen device only, read-only when ``readonly``.

    A posix-fd descriptor's fds come from ``fetch_fds`` (the posix-fd path
    asks the exporter's broker), called once the sizes are checked; they are
    closed here once imported."""
    return _import(desc, device, readonly, fetch_fds, buffer=True)


def map_device(desc: PosixFdBufferDescriptor | VirtualMemoryFabricBufferDescriptor, device: int | None,
               *, readonly: bool = False, fetch_fds: Callable[[], Sequence[int]] | None = None) -> Any:
    """:func:`import_device` for a view: the mapping as a
    :class:`gpushare._cuda._driver.DeviceMemory` (no cuda.core on the way)."""
    return _import(desc, device, readonly, fetch_fds, buffer=False)


def _import(desc: PosixFdBufferDescriptor | VirtualMemoryFabricBufferDescriptor, device: int | None,
            readonly: bool, fetch_fds: Callable[[], Sequence[int]] | None, *, buffer: bool) -> Any:
    drv = _driver.driver()
    ordinal = _driver.import_ordinal(desc.owner_uuid, device)
    t = drv.CUmemAllocationHandleType
    prop = _prop(drv, ordinal, ())
    gran_flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    gran = int(_driver.check(drv.cuMemGetAllocationGranularity(prop, gran_flag), "granularity"))
    for i, n in enumerate(desc.sizes):
        if n % gran:
            raise InvalidInputError(
                f"allocation size {i} is {n}; device {ordinal} maps multiples of {gran} bytes"
            )
    handles: list[Any] = []
    with _driver.on_device(ordinal):
        try:
            if isinstance(desc, PosixFdBufferDescriptor):
                if fetch_fds is None:
                    raise InvalidInputError("a posix-fd descriptor is imported through the posix-fd path")
                fds = fetch_fds()
                try:
                    for i, fd in enumerate(fds):
                        handles.append(
                            _driver.check(
                                drv.cuMemImportFromShareableHandle(
                                    fd, t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                ),
                                f"importing allocation {i}",
                            )
                        )
                finally:
                    for fd in fds:
                        os.close(fd)
            else:
                for i, raw in enumerate(desc.handles):
                    fh = _driver.set_bytes(drv.CUmemFabricHandle(), raw)
                    handles.append(
                        _driver.check(
                            drv.cuMemImportFromShareableHandle(fh.getPtr(), t.CU_MEM_HANDLE_TYPE_FABRIC),
                            f"importing fabric handle {i}",
                        )
                    )
            ptr = _map(drv, ordinal, handles, desc.sizes, gran, readonly)
        except BaseException:
            _release_handles(drv, handles)
            raise
        if not buffer:
            vmm = _Vmm(ordinal, ptr, handles, desc.sizes, [], None, False, readonly)
            return _driver.DeviceMemory(ptr, desc.size, ordinal, vmm.deallocate_all, readonly=readonly,
                                        resource=vmm)
        from cuda.core import Buffer

        mr = _mapping_class()(ordinal, ptr, handles, desc.sizes, [], None, False, readonly)
        return Buffer.from_handle(ptr, desc.size, mr=mr)
