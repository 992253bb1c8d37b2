"""The same-process path: the exporting process opens its own share and gets
its own object back (no mapping, no copy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import KINDS, Here, Memory, Offer, Opened, Options, Path, same_node

if TYPE_CHECKING:
    from .._share import Share


class SameProcess(Path):
    name = "same-process"
    rank = 0
    mapped = True
    holds_memory = True
    reopens = False
    maps_strided = True
    in_process = True
    serves = frozenset(KINDS)
    reason = "this process exported it; the original object is handed back"

    def offer(self, memory: Memory) -> Offer | None:
        return Offer()

    def grant_fds(self, export: Any) -> int:
        return 0

    def serve(self, export: Any, session: Any) -> None:
        return None  # never over the control channel: the exporting process opens it itself

    def not_offered(self, share: Share) -> str | None:
        return None

    def unavailable(self, share: Share, here: Here) -> str | None:
        near = same_node(share, here)
        if share.exporter_pid != here.pid or not near or not here.exported_here:
            return f"exporter is process {share.exporter_pid}" + ("" if near else " on another node")
        return None

    def open(self, share: Share, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        return Opened(target=grant["target"])


PATH: Path = SameProcess()
