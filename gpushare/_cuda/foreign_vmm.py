"""CUDA virtual memory another allocator mapped, as torch's expandable
segments map it: physical allocations (``cuMemCreate``) mapped back to back
into one reservation, each exportable as a POSIX fd.

:func:`covering` finds the mappings under a range of such memory and
returns them as one :class:`ForeignVmm` buffer; the posix-fd path exports
its allocations' fds (:func:`export_fds`) and an importer maps them back to
back, as it maps a ``gpushare.allocate`` buffer.  Memory of ``cuMemAlloc``,
a stream-ordered pool or a registered host range is not such memory:
:func:`covering` answers None for it after a few driver calls.

It takes every mapping to map one whole allocation from its start (offset
0, as torch maps its segments' pages): the driver says how large a mapping
is, not where in its allocation it starts.
"""

from __future__ import annotations

import os
from typing import Any

from . import _driver

__all__ = ["ForeignVmm", "MAX_FOREIGN_ALLOCATIONS", "covering", "export_fds"]

#: The most allocations one buffer of another allocator's virtual memory is
#: exported as (each is an fd the broker hands over with one open).  torch's
#: expandable segments map pages of 20 MiB (2 MiB below 1 MiB requests), so
#: this covers a tensor of 20 GiB; a larger one goes the copied way.
MAX_FOREIGN_ALLOCATIONS = 1024


class ForeignVmm:
    """Another allocator's mappings that cover a range: ``sizes`` bytes of
    whole allocations mapped back to back from ``address`` on device
    ``ordinal``.  It holds ``owner`` (the array over the range), so that the
    allocator keeps them mapped while a share offers them, and reads as CUDA
    bytes (``__cuda_array_interface__``) for the paths that copy."""

    __slots__ = ("address", "sizes", "ordinal", "owner", "__cuda_array_interface__")

    def __init__(self, address: int, sizes: tuple[int, ...], ordinal: int, owner: Any) -> None:
        self.address = address
        self.sizes = sizes
        self.ordinal = ordinal
        self.owner = owner
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (sum(sizes),), "typestr": "|u1",
                                         "version": 3, "strides": None, "stream": None}

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def __repr__(self) -> str:
        return f"<ForeignVmm {len(self.sizes)} allocations, {self.size} bytes at 0x{self.address:x}>"


def _handle_at(drv: Any, address: int) -> int | None:
    """The allocation handle mapped at ``address`` (its number), or None
    where none is (not virtual memory)."""
    err, handle = drv.cuMemRetainAllocationHandle(address)
    if err != drv.CUresult.CUDA_SUCCESS:
        return None
    drv.cuMemRelease(handle)
    return int(handle)


def _exportable(drv: Any, address: int, size: int, ordinal: int) -> bool:
    """Whether the mapping of ``size`` bytes at ``address`` is one
    allocation of virtual memory on device ``ordinal`` that exports as a
    POSIX fd (a stream-ordered pool's memory, whose pages the pool maps, is
    not: it goes as the pool's; nor is a range whose last byte lies in
    another allocation than its first, as a driver that answered a
    reservation's range would give)."""
    err, pool = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, address)
    if err != drv.CUresult.CUDA_SUCCESS or (pool is not None and int(pool)):
        return False
    err, handle = drv.cuMemRetainAllocationHandle(address)
    if err != drv.CUresult.CUDA_SUCCESS:
        return False  # not virtual memory
    try:
        if _handle_at(drv, address + size - 1) != int(handle):
            return False
        err, prop = drv.cuMemGetAllocationPropertiesFromHandle(handle)
    finally:
        drv.cuMemRelease(handle)
    posix = int(drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return (err == drv.CUresult.CUDA_SUCCESS and bool(_driver.handle_types_field(prop).value & posix)
            and int(prop.location.id) == ordinal)


def covering(address: int, nbytes: int, owner: Any) -> tuple[ForeignVmm, int] | None:
    """The mappings of another allocator's virtual memory that cover
    ``nbytes`` bytes at ``address`` (the memory of ``owner``), as one
    buffer, and the range's offset in it; None unless the range lies in
    mappings back to back, each of a whole allocation that exports as a
    POSIX fd, at most :data:`MAX_FOREIGN_ALLOCATIONS` of them."""
    drv = _driver.driver()
    ok = drv.CUresult.CUDA_SUCCESS
    try:
        ordinal = _driver.pointer_ordinal(address)
    except Exception:  # noqa: BLE001 - not memory the driver knows: nothing to find
        return None
    sizes: list[int] = []
    with _driver.on_device(ordinal):
        if _handle_at(drv, address) is None:
            return None  # the common case, cudaMalloc or pool memory: one call
        err, base, _ = drv.cuMemGetAddressRange(address)
        if err != ok:
            return None
        start = at = int(base)
        end = address + nbytes
        while at < end:
            if len(sizes) == MAX_FOREIGN_ALLOCATIONS:
                return None
            err, got, size = drv.cuMemGetAddressRange(at)
            if err != ok or int(got) != at or int(size) <= 0:
                return None  # a hole in the reservation
            if not _exportable(drv, at, int(size), ordinal):
                return None
            sizes.append(int(size))
            at += int(size)
    return ForeignVmm(start, tuple(sizes), ordinal, owner), address - start


def export_fds(buf: ForeignVmm) -> list[int]:
    """New POSIX fds of ``buf``'s allocations, in order (the caller's to close)."""
    drv = _driver.driver()
    posix = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    fds: list[int] = []
    try:
        with _driver.on_device(buf.ordinal):
            at = buf.address
            for i, size in enumerate(buf.sizes):
                handle = _driver.check(drv.cuMemRetainAllocationHandle(at), f"retaining allocation {i}")
                try:
                    fds.append(int(_driver.check(drv.cuMemExportToShareableHandle(handle, posix, 0),
                                                 f"exporting allocation {i} as a POSIX fd")))
                finally:
                    drv.cuMemRelease(handle)
                at += size
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
