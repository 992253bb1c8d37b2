"""The fabric path: CUDA virtual memory mapped through fabric handles, within
one NVLink fabric clique where an IMEX channel is present."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._cuda import vmm
from .._cuda.fabric import cliques as fabric_cliques
from .._descriptors import VirtualMemoryFabricBufferDescriptor
from .._errors import GpuShareError
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
)

if TYPE_CHECKING:
    from .._share import Share


class Fabric(Path):
    name = "fabric"
    rank = 1
    mapped = True
    holds_memory = True
    reopens = False
    maps_strided = False
    cross_node = True
    serves = frozenset({ALLOCATED_CUDA})
    device_handle = "fabric"
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

    def cliques(self, devices: list[Any]) -> list[str | None] | None:
        found = fabric_cliques()[0]
        return [found.get(d) if isinstance(d, int) else None for d in devices]

    def serve(self, export: Any, session: Any) -> Grant:
        return Grant(descriptor_payload(export, self.name))

    def not_offered(self, share: Share) -> str | None:
        return None  # said once for both VMM paths, by posix-fd

    def facts(self, share: Share, near: bool) -> tuple[tuple[str, ...], str | None] | None:
        """This node's fabric cliques, and why there are none."""
        if share.fabric is None:
            return None
        found, why_not = fabric_cliques()
        return tuple(found.values()), why_not

    def unavailable(self, share: Share, here: Here) -> str | None:
        if share.fabric is None:
            return "the exporter did not report a fabric clique"
        found = here.fact(self.name)
        cliques, why_not = found if isinstance(found, tuple) else ((), None)
        if why_not is not None:
            return why_not
        if share.fabric not in cliques:
            return "not in the exporter's fabric clique"
        return cuda_unavailable(here)

    def open(self, share: Share, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        no_fds(self.name, fds)
        desc = descriptor_of(share, grant, (VirtualMemoryFabricBufferDescriptor,))
        return Opened(mapping=Mapped.cuda(vmm.map_device(desc, how.device, readonly=share.readonly)))


PATH: Path = Fabric()
