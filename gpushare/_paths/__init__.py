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

Adding a path is one module with a ``PATH`` object, one entry in
:data:`PATHS` and its name in :data:`gpushare._types.PathName`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .. import _buffers
from .._errors import InvalidInputError
from .._types import PATH_NAMES, PathName
from . import cma, cuda_ipc, fabric, host_fd, posix_fd, same_process, ucx_rma
from .base import Grant, Here, Mapped, Memory, Offer, Opened, Options
from .broker import release_registrations

if TYPE_CHECKING:
    from .._buffers import LocalBuffer
    from .._share import Share

__all__ = ["Path", "Mapping", "Transport", "Here", "Grant", "Mapped", "Memory", "Offer", "Opened", "Options",
           "offers", "PATHS", "by_name", "candidates", "explain", "path_list"]


class Path(Protocol):
    name: PathName
    rank: int
    #: True: the view maps the memory; False: it copies through a Transport.
    mapped: bool
    #: True: the mapping holds the memory itself, so an array over it (a
    #: DLPack tensor) stays valid after the exporter frees or loses its
    #: object (the pages, or the CUDA physical allocation, live while the
    #: mapping does).  Legacy CUDA IPC memory goes when its exporter frees it.
    holds_memory: bool
    #: True: a closed view's lease and mapping may serve a further open of a
    #: share that lives until revoked, with no message to the exporter
    #: (:mod:`gpushare._reopen`): host memory whose mapping holds it and
    #: needs nothing of the opening thread (CUDA mappings depend on the
    #: device the open asks for: not kept).
    reopens: bool
    #: One line for ``view.why``.
    reason: str

    # exporter side
    def offer(self, memory: Any) -> Any | None: ...
    def serve(self, export: Any, session: Any) -> Grant: ...
    #: File descriptors an open sends with its grant (the most, to a same-node importer).
    def grant_fds(self, export: Any) -> int: ...

    # importer side
    def not_offered(self, share: Share) -> str | None: ...
    def unavailable(self, share: Share, here: Here) -> str | None: ...
    def open(self, share: Share, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened: ...


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


#: Every path, fastest first.
PATHS: tuple[Path, ...] = (same_process.PATH, fabric.PATH, posix_fd.PATH, cuda_ipc.PATH, host_fd.PATH,
                           cma.PATH, ucx_rma.PATH)
_BY_NAME = {p.name: p for p in PATHS}
if tuple(_BY_NAME) != PATH_NAMES:
    raise ImportError("gpushare._paths.PATHS and gpushare._types.PATH_NAMES disagree")


def by_name(name: str) -> Path:
    """The path called ``name``."""
    return _BY_NAME[name]


def path_list(value: Any, what: str) -> list[str]:
    """Path names given as an iterable or one comma-separated str, checked."""
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    try:
        items = list(value)
    except TypeError:
        raise InvalidInputError(f"{what} must be a list of path names or a comma-separated str") from None
    for p in items:
        if p not in _BY_NAME:
            raise InvalidInputError(f"{what} names unknown path {p!r}; paths are {', '.join(PATH_NAMES)}")
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
    return "; ".join([f"{path}: {_BY_NAME[path].reason}"] + failures + left_out)


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
        if memory.strided and not any(_BY_NAME[p].maps_strided and p in descs for p in memory.offered):
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
