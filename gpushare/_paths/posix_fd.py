"""The posix-fd path: CUDA virtual memory mapped on this node through POSIX
file descriptors, handed over by the broker: gpushare.allocate's, and
another allocator's whose allocations export as POSIX fds (torch's
expandable segments; ``_cuda.foreign_vmm``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .._cuda import _driver, foreign_vmm, vmm
from .._descriptors import PosixFdBufferDescriptor
from .._errors import GpuShareError, InvalidInputError
from .._process import check_same_node
from . import broker as _broker
from .base import (
    ALLOCATED_CUDA,
    Grant,
    Here,
    Mapped,
    Memory,
    Offer,
    Opened,
    Options,
    Path,
    cuda_unavailable,
    descriptor_of,
    descriptor_payload,
    no_fds,
    own_registration,
    same_node,
)

if TYPE_CHECKING:
    from .._share import Share


class PosixFd(Path):
    name = "posix-fd"
    rank = 2
    mapped = True
    holds_memory = True
    reopens = False
    maps_strided = False
    serves = frozenset({ALLOCATED_CUDA})
    device_handle = "posix-fd"
    reason = "same node; CUDA virtual memory mapped through POSIX fds"

    def offer(self, memory: Memory) -> Offer | None:
        obj = memory.obj
        if memory.memory_type != "cuda":
            return None
        if isinstance(obj, foreign_vmm.ForeignVmm):
            return _foreign_offer(obj)
        if not vmm.is_vmm_buffer(obj):
            return None
        try:
            fds = vmm.posix_fds(obj)
        except GpuShareError:
            return None
        mr = obj.memory_resource
        return own_registration(fds, device=mr.ordinal, sizes=mr.sizes, size=obj.size,
                                owner_uuid=_driver.device_uuid(mr.ordinal))

    def holder(self, obj: Any, memory_type: str, span: tuple[int, int]) -> tuple[Any, int] | None:
        if memory_type != "cuda" or not span[1] or vmm.is_vmm_buffer(obj) or isinstance(obj, foreign_vmm.ForeignVmm):
            return None
        return vmm.containing(*span) or foreign_vmm.covering(*span, obj)

    def grant_fds(self, export: Any) -> int:
        return 0

    def serve(self, export: Any, session: Any) -> Grant:
        return Grant(descriptor_payload(export, self.name))

    def not_offered(self, share: Share) -> str | None:
        if share.device != "host":
            return ("not posix-fd/fabric: not offered, the memory is not from gpushare.allocate(device=N) nor "
                    "virtual memory whose allocations export as POSIX fds (torch's expandable segments)")
        return None

    def unavailable(self, share: Share, here: Here) -> str | None:
        if not same_node(share, here):
            return "exporter is on another node (or network namespace)"
        return cuda_unavailable(here)

    def open(self, share: Share, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        no_fds(self.name, fds)
        desc = descriptor_of(share, grant, (PosixFdBufferDescriptor,))
        if desc.device == "host":
            raise InvalidInputError("exporter sent a descriptor of host memory with a posix-fd offer")
        return Opened(mapping=Mapped.cuda(import_device(desc, how.device, readonly=share.readonly, view=True,
                                                        timeout=how.timeout)))


PATH: Path = PosixFd()


def _foreign_offer(buf: foreign_vmm.ForeignVmm) -> Offer | None:
    """The offer of another allocator's virtual memory: its allocations'
    fds under this share's own registration (None where the driver will not
    export them)."""
    try:
        fds = foreign_vmm.export_fds(buf)
    except GpuShareError:
        return None
    try:
        return own_registration(fds, device=buf.ordinal, sizes=buf.sizes, size=buf.size,
                                owner_uuid=_driver.device_uuid(buf.ordinal))
    finally:
        for fd in fds:
            os.close(fd)


def export_device(buf: Any) -> PosixFdBufferDescriptor:
    """The posix-fd descriptor of a buffer from gpushare.allocate(device=N):
    its allocations' fds, published by this process's broker once (the
    same descriptor each time after that)."""
    vmm.export_handle_type(buf, "posix_fd")
    mr = buf.memory_resource
    uuid = _driver.device_uuid(mr.ordinal)
    with mr.lock:
        if mr.posix_export is not None and mr.posix_export[0].pid == os.getpid():
            return mr.posix_export[1]
        fds = vmm.export_posix_fds(buf)
        try:
            broker, desc = _broker.publish(fds, device=mr.ordinal, sizes=mr.sizes, size=buf.size, owner_uuid=uuid)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        mr.posix_export = (broker, desc, fds)  # the mapping's release revokes it and closes the fds
        return desc


def import_device(desc: PosixFdBufferDescriptor, device: int | None, *, readonly: bool = False,
                  timeout: float = _broker.TIMEOUT, view: bool = False) -> Any:
    """Map the CUDA virtual memory a posix-fd descriptor names, its fds
    fetched from the exporter's broker (within ``timeout`` seconds): a
    cuda.core ``Buffer`` (:func:`gpushare.import_buffer`), or for a view
    (``view``) a :class:`gpushare._cuda._driver.DeviceMemory`."""

    def fetch_fds() -> list[int]:
        check_same_node(desc)
        return _broker.fetch_fds(desc.address, desc.export_id, desc.token, len(desc.sizes), pid=desc.pid,
                                 timeout=timeout)

    importer = vmm.map_device if view else vmm.import_device
    return importer(desc, device, readonly=readonly, fetch_fds=fetch_fds)
