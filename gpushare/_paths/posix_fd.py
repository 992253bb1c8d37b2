"""The posix-fd path: CUDA virtual memory from gpushare.allocate mapped on
this node through POSIX file descriptors, handed over by the broker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._descriptors import PosixFdBufferDescriptor
from .._errors import GpuShareError, InvalidInputError
from . import _cuda, cuda_vmm
from .base import (
    Grant,
    Here,
    Mapped,
    Memory,
    Offer,
    Opened,
    Options,
    cuda_unavailable,
    descriptor_of,
    descriptor_payload,
    no_fds,
    own_registration,
    same_node,
)

if TYPE_CHECKING:
    from .._share import Share


class PosixFd:
    name = "posix-fd"
    rank = 2
    mapped = True
    maps_strided = False
    reason = "same node; CUDA virtual memory mapped through POSIX fds"

    def offer(self, memory: Memory) -> Offer | None:
        obj = memory.obj
        if memory.memory_type != "cuda" or not cuda_vmm.is_vmm_buffer(obj):
            return None
        try:
            fds = cuda_vmm.posix_fds(obj)
        except GpuShareError:
            return None
        mr = obj.memory_resource
        return own_registration(fds, device=mr.ordinal, sizes=mr.sizes, size=obj.size,
                                owner_uuid=_cuda.device_uuid(mr.ordinal))

    def serve(self, export: Any, session: Any) -> Grant:
        return Grant(descriptor_payload(export, self.name))

    def not_offered(self, share: Share) -> str | None:
        if share.device != "host":
            return "not posix-fd/fabric: not offered, the memory is not from gpushare.allocate(device=N)"
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
        return Opened(mapping=Mapped.cuda(cuda_vmm.import_device(desc, how.device, readonly=share.readonly,
                                                                 timeout=how.timeout)))


PATH = PosixFd()
