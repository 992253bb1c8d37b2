"""The sharing paths behind one interface, fastest first.

Each path is one object (:class:`Path`) in a module of its own: what it
can offer for a buffer at export (:meth:`Path.offer`), how the exporter
serves an open of it (:meth:`Path.serve`), why an importer cannot take it
(:meth:`Path.not_offered`, :meth:`Path.unavailable`) and how the importer
turns a grant into a :class:`Mapping` (the view maps the memory) or a
:class:`Transport` (the view copies through it).  :data:`PATHS` lists them,
fastest first; :func:`candidates` orders them for one share in one process
from plain facts about that process (:class:`Here`), and :func:`explain`
says why in one line.

Adding a path is one module with a ``PATH`` object (a class that
subclasses :class:`Path`) and one entry in :data:`PATHS`: the names a
share's offers may carry, in the order of a bundle manifest's bits, are
``PATHS``' (:func:`names`, which :func:`gpushare._types.path_names`
asks).  Nothing above this package names a path: it asks a
path's traits (``mapped``, ``holds_memory``, ``in_process``, ``network``...).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .. import _buffers, _types
from .._errors import InvalidInputError
from . import cma, cuda_ipc, fabric, host_fd, posix_fd, same_process, ucx_rma
from .base import ControlOp, Here, Memory, Path
from .broker import release_registrations

if TYPE_CHECKING:
    from .._buffers import LocalBuffer
    from .._share import Share

__all__ = ["Mapping", "Transport", "offers", "PATHS", "by_name", "offered", "facts", "needs_cuda", "cliques", "control_op",
           "holder", "base_allocation", "stop", "on_seal", "warm", "slow_alone", "candidates", "explain", "path_list"]


class Mapping(Protocol):
    """What a mapped view holds: the memory mapped into this process."""

    device: int | Literal["host"]
    readonly: bool

    def local(self, offset: int, nbytes: int) -> LocalBuffer: ...
    def memoryview(self) -> memoryview: ...
    def close(self) -> None: ...


class Transport(Protocol):
    """What a copied view (cma, ucx-rma) moves its bytes through."""

    #: Items of a batch with equal keys travel together (:meth:`batch`).
    batch_key: Hashable
    #: Whether it copies to and from host memory only.
    host_only: bool

    # ``span(buf, offset, writable, stream=None)`` resolves and checks a buffer
    # against the view; ``check(buf, offset, writable)`` only checks it.
    def get(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None: ...
    def put(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None: ...
    async def get_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None: ...
    async def put_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None: ...
    def batch(self, items: list, direction: str) -> list: ...
    def close(self) -> None: ...


#: Every path, fastest first.  Adding a path is a module with a ``PATH``
#: object and one entry here.
PATHS: tuple[Path, ...] = (same_process.PATH, fabric.PATH, posix_fd.PATH, cuda_ipc.PATH, host_fd.PATH,
                           cma.PATH, ucx_rma.PATH)
_by_name: tuple[tuple[Path, ...], dict[str, Path]] = ((), {})


def _names() -> dict[str, Path]:
    """The paths by name (remade when :data:`PATHS` changes)."""
    global _by_name
    paths, named = _by_name
    if paths is not PATHS:
        named = {p.name: p for p in PATHS}
        _by_name = (PATHS, named)
    return named


def by_name(name: str) -> Path:
    """The path called ``name``."""
    return _names()[name]


def offered(share: Share) -> list[Path]:
    """The paths ``share`` offers, fastest first."""
    return [p for p in PATHS if p.name in share.offers]


def facts(share: Share, near: bool) -> tuple[tuple[str, Any], ...]:
    """What each path ``share`` offers finds about this process (for :class:`Here`)."""
    found = []
    for path in offered(share):
        fact = path.facts(share, near)
        if fact is not None:
            found.append((path.name, fact))
    return tuple(found)


def needs_cuda(share: Share, near: bool) -> bool:
    """Whether a path ``share`` offers would map its CUDA memory in this process."""
    return share.device != "host" and (near or any(p.mapped and p.cross_node for p in offered(share)))


def cliques(parts: list[tuple[tuple[str, ...], Any]]) -> list[str | None]:
    """The NVLink fabric clique the share of each ``(offers, device)`` carries, or None."""
    out: list[str | None] = [None] * len(parts)
    for path in PATHS:
        which = [i for i, (names, _) in enumerate(parts) if path.name in names]
        found = path.cliques([parts[i][1] for i in which]) if which else None
        for i, clique in zip(which, found or (), strict=False):
            if out[i] is None:
                out[i] = clique
    return out


def holder(obj: Any, memory_type: str, span: tuple[int, int]) -> tuple[Any, int] | None:
    """The gpushare.allocate buffer that holds ``span`` of ``obj`` (another
    object over it), and the span's offset in it; None where there is none."""
    for path in PATHS:
        found = path.holder(obj, memory_type, span)
        if found is not None:
            return found
    return None


def base_allocation(address: int, device: int) -> tuple[int, int] | None:
    """(base, size) of the CUDA allocation that CUDA memory at ``address``
    lies in, as a path exports it whole (a ``cudaMalloc`` block, a pool
    allocation), or None."""
    return cuda_ipc.base_allocation(address, device)


def control_op(op: object) -> ControlOp | None:
    """The path's handler of control operation ``op`` (from a peer: anything), or None."""
    if not isinstance(op, str):
        return None
    for path in PATHS:
        handler = path.control_ops().get(op)
        if handler is not None:
            return handler
    return None


def stop() -> None:
    """The exporter stops: each path ends what it has under way."""
    for path in PATHS:
        path.stop()


def on_seal(hook: Callable[[], None]) -> None:
    """Call ``hook()`` whenever memory a path serves is sealed read-only."""
    for path in PATHS:
        path.on_seal(hook)


def warm(names: list[str]) -> None:
    """Let the paths ``names`` prepare this process while the exporter prepares its offer."""
    for name in dict.fromkeys(names):
        by_name(name).warm()


def slow_alone(name: str) -> bool:
    """Whether path ``name`` is slow next to a same-node path (a network transport)."""
    return by_name(name).network


def path_list(value: Any, what: str) -> list[str]:
    """Path names given as an iterable or one comma-separated str, checked."""
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    try:
        items = list(value)
    except TypeError:
        raise InvalidInputError(f"{what} must be a list of path names or a comma-separated str") from None
    for p in items:
        if p not in _names():
            raise InvalidInputError(f"{what} names unknown path {p!r}; paths are {', '.join(_names())}")
    return items


def candidates(share: Share, here: Here, prefer: list[str], exclude: list[str]
               ) -> tuple[list[str], list[str], list[str]]:
    """(ordered candidates, reasons for the paths left out, the natural best order)."""
    left_out: list[str] = []
    natural: list[str] = []
    for path in PATHS:
        if path.name not in share.offers:
            why = path.not_offered(share)
            if why is not None:
                left_out.append(why)
            continue
        why_not = path.unavailable(share, here)
        if why_not is not None:
            left_out.append(f"not {path.name}: {why_not}")
            continue
        natural.append(path.name)
    order = [p for p in prefer if p in natural] + [p for p in natural if p not in prefer]
    if order and natural and order[0] != natural[0]:
        left_out.append(f"{order[0]} preferred by the caller over {natural[0]}")
    for p in exclude:
        if p in order:
            order.remove(p)
            left_out.append(f"not {p}: excluded by the caller")
    return order, left_out, natural


def explain(path: str, left_out: list[str], failures: list[str]) -> str:
    """``view.why``: the path taken, why, what failed before and what was left out."""
    return "; ".join([f"{path}: {by_name(path).reason}"] + failures + left_out)


def offers(memory: Memory, wanted: list[str] | None) -> tuple[list[str], dict[str, Any], list]:
    """The paths that can serve ``memory`` (and are ``wanted``), fastest
    first; the descriptors of the mapped ones; the share's own fd
    registrations (the caller releases them when the export fails)."""
    descs: dict[str, Any] = {}
    regs: list = []
    try:
        for path in PATHS:
            if wanted is not None and path.name not in wanted:
                continue
            offer = path.offer(memory)
            if offer is None:
                continue
            memory.offered.append(path.name)
            if offer.descriptor is not None:
                descs[path.name] = offer.descriptor
            if offer.registration is not None:
                regs.append(offer.registration)
        if memory.strided and not any(by_name(p).maps_strided and p in descs for p in memory.offered):
            raise InvalidInputError(
                f"array is not C-contiguous; {_buffers._CONTIGUOUS_FIX} (strided arrays are shared as they are "
                "only over gpushare.allocate host memory, such as gpushare.empty arrays)"
            )
        if wanted is not None and not memory.offered:
            raise InvalidInputError(f"none of the paths {sorted(wanted)} can serve this memory" + (
                " (a strided array goes only where it is mapped: same-process, and host-fd for "
                "gpushare.allocate memory; share numpy.ascontiguousarray(a) for the others)" if memory.strided
                else ""))
    except BaseException:
        release_registrations(regs)
        raise
    return memory.offered, descs, regs


_names_of: tuple[tuple[Path, ...], tuple[str, ...]] = ((), ())


def names() -> tuple[str, ...]:
    """The paths' names, fastest first (made again when ``PATHS`` changes)."""
    global _names_of
    paths, made = _names_of
    if paths is not PATHS:
        made = tuple(p.name for p in PATHS)
        _names_of = (PATHS, made)
    return made


_types.set_path_names(names)
