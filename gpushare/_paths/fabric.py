"""The fabric path: CUDA virtual memory mapped through fabric handles, within
one NVLink fabric clique where an IMEX channel is present."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._cuda import vmm
from .._descriptors import VirtualMemoryFabricBufferDescriptor
from .._errors import GpuShareError
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
)

if TYPE_CHECKING:
    from .._share import Share


class Fabric:
    name = "fabric"
    rank = 1
    mapped = True
    holds_memory = True
    reopens = False
    maps_strided = False
    reason = "same fabric clique with an IMEX channel"

    def offer(self, memory: Memory) -> Offer | None:
        if memory.memory_type != "cuda" or not vmm.is_vmm_buffer(memory.obj):
            return None
        try:
            return Offer(vmm.export_fabric(memory.obj))
        except GpuShareError:
            return None  # not supported here (no fabric): not offered

    def grant_fds(self, export: Any) -> int:
        return 0

    def serve(self, export: Any, session: Any) -> Grant:
        return Grant(descriptor_payload(export, self.name))

    def not_offered(self, share: Share) -> str | None:
        return None  # said once for both VMM paths, by posix-fd

    def unavailable(self, share: Share, here: Here) -> str | None:
        if share.fabric is None:
            return "the exporter did not report a fabric clique"
        if here.fabric_reason is not None:
            return here.fabric_reason
        if share.fabric not in here.fabric_cliques:
            return "not in the exporter's fabric clique"
        return cuda_unavailable(here)

    def open(self, share: Share, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        no_fds(self.name, fds)
        desc = descriptor_of(share, grant, (VirtualMemoryFabricBufferDescriptor,))
        return Opened(mapping=Mapped.cuda(vmm.map_device(desc, how.device, readonly=share.readonly)))


PATH = Fabric()
