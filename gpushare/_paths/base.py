"""Plain data the paths share: facts about this process, an exporter's
grant, an importer's opened path, and the helpers several paths use."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import _control
from .._cuda import _driver
from .._buffers import LocalBuffer
from .._descriptors import _rebuild
from .._errors import GpuShareError, InvalidInputError, WaitTimeoutError
from .._process import node_key, process_state
from . import broker

if TYPE_CHECKING:
    from .._exporter.lifetimes import Export
    from .._exporter.sessions import Session
    from .._importer import Lease
    from .._connection import Connection
    from .._share import Share


@dataclass(frozen=True)
class Here:
    """Facts about the importing process that decide which paths it can take."""

    #: This process's node (and network namespace) key.
    node: str
    #: This process's id.
    pid: int
    #: Whether this very process exported the share (and still serves it).
    exported_here: bool = False
    #: Why this process cannot map CUDA memory, or None.
    cuda_reason: str | None = None
    #: What each path found about this process (:meth:`Path.facts`), by path
    #: name: ``(name, facts)`` pairs, for the paths with something to say.
    facts: tuple[tuple[str, Hashable], ...] = ()

    def fact(self, name: str) -> Hashable:
        """What path ``name`` found about this process (None: nothing)."""
        for key, value in self.facts:
            if key == name:
                return value
        return None


@dataclass(frozen=True)
class Kind:
    """A kind of memory a path may serve (``gpushare doctor`` asks, for each,
    which path a peer would get)."""

    label: str
    cuda: bool


ALLOCATED_HOST = Kind("host memory from gpushare.allocate", False)
OTHER_HOST = Kind("other host memory (a NumPy array)", False)
ALLOCATED_CUDA = Kind("CUDA memory from gpushare.allocate", True)
OTHER_CUDA = Kind("other CUDA memory (CuPy pool, torch)", True)
#: Every kind, in the order ``gpushare doctor`` lists them.
KINDS = (ALLOCATED_HOST, OTHER_HOST, ALLOCATED_CUDA, OTHER_CUDA)


@dataclass
class Memory:
    """What :func:`gpushare.export` offers: the buffer the mapped paths
    serve (a gpushare.allocate buffer where the memory lies in one), its
    kind, and the paths offered so far (fastest first)."""

    obj: Any
    memory_type: str
    readonly: bool
    strided: bool
    offered: list[str] = field(default_factory=list)


@dataclass
class Offer:
    """A path's offer: the descriptor it hands importers, and the share's own
    fd registration ``(export_id, fds)`` where it has one."""

    descriptor: Any = None
    registration: tuple[int, list[int]] | None = None


@dataclass
class Grant:
    """What the exporter answers to an open of one path: the payload, the fds
    sent with it, and what ends the lease (called with the export's lock held)."""

    payload: dict
    fds: list[int] = field(default_factory=list)
    on_end: Any = None
    state: Any = None
    path: Any = None  # set by the exporter: the path that made it
    #: A bundle's lease: the grant of each of its allocations, in order.
    parts: list | None = None


@dataclass(slots=True)
class Opened:
    """An importer's side of an open path: a mapping or a transport (or, for
    same-process, the exporter's own object)."""

    mapping: Any = None
    transport: Any = None
    target: Any = None


class Mapped:
    """Shared memory mapped into this process (the :class:`Mapping` a mapped
    view holds): host memory (a HostBuffer) or CUDA memory (a cuda.core
    Buffer on this process's device ``device``)."""

    __slots__ = ("address", "buffer", "device", "streams")

    def __init__(self, buffer: Any, device: Any, address: int) -> None:
        self.buffer = buffer
        self.device = device
        self.address = address
        #: CUDA memory: a consumer named a stream of its own (to ``__dlpack__``):
        #: closing waits for the whole context's work, not only the legacy stream's
        self.streams = False

    @classmethod
    def host(cls, buf: Any) -> Mapped:
        return cls(buf, "host", buf.ptr)

    @classmethod
    def cuda(cls, buf: Any) -> Mapped:
        return cls(buf, int(buf.memory_resource.device_id), int(buf.handle))  # this process's ordinal

    @property
    def readonly(self) -> bool:
        """Mapped read-only (a sealed host buffer, a read-only CUDA mapping)."""
        return bool(getattr(self.buffer, "readonly", False))

    def local(self, offset: int, nbytes: int) -> LocalBuffer:
        if self.device == "host":
            return LocalBuffer(self.address + offset, nbytes, "host", False, self.buffer)
        return LocalBuffer(self.address + offset, nbytes, "cuda", False, self.buffer, device=self.device)

    def memoryview(self) -> memoryview:
        return self.buffer.memoryview()

    def grant(self, ordinal: int) -> None:
        """Let device ``ordinal`` of this process reach the memory too (a copy runs there)."""
        grant = getattr(getattr(self.buffer, "memory_resource", None), "grant", None)
        if grant is not None:
            grant(ordinal)

    def used_on(self, stream: int) -> None:
        """A consumer queues work on the memory on ``stream`` (a handle)."""
        if stream != _driver.LEGACY_STREAM:
            self.streams = True

    def close(self) -> None:
        if self.device != "host":
            # a kernel or copy still queued on the memory would fault once it is gone
            _driver.wait_for_consumers(self.device, self.streams)
        self.buffer.close()


@dataclass(frozen=True)
class Options:
    """How an importer opens: the device to map on, the seconds left,
    prefault, and for a bundle the allocation (its index) being opened."""

    device: int | None = None
    timeout: float = 10.0
    prefault: bool = False
    part: int | None = None


class ControlOp(Protocol):
    """A control operation a path serves on the exporter's control
    connection, on the service thread."""

    def __call__(self, session: Session, conn: Connection, rid: Any, msg: dict) -> None: ...


class Path(Protocol):
    """One way to share memory between two processes, in one module of
    :mod:`gpushare._paths` with a ``PATH`` object and one entry in
    :data:`gpushare._paths.PATHS`.  A path subclasses this protocol and so
    inherits the defaults of its optional members (a path with nothing to
    add keeps them)."""

    name: str
    rank: int
    #: One line for ``view.why``.
    reason: str
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
    #: True: it serves a strided (not C-contiguous) array as it is.
    maps_strided: bool
    #: True: only the exporting process itself takes it: the exporter's own
    #: object, with no lease and no message.
    in_process: bool = False
    #: True: it reaches processes on other nodes too.
    cross_node: bool = False
    #: True: a network transport, slow next to a same-node path: taking it to
    #: a same-node exporter unasked deserves a ``SlowPathWarning``.
    network: bool = False
    #: The kinds of memory it may serve (what ``gpushare doctor`` reports).
    serves: frozenset[Kind] = frozenset()
    #: The handle type a device must support for it (CUDA memory), or None.
    device_handle: str | None = None

    # exporter side
    def offer(self, memory: Memory) -> Offer | None: ...
    def serve(self, export: Export, session: Session) -> Grant | None: ...
    #: File descriptors an open sends with its grant (the most, to a same-node importer).
    def grant_fds(self, export: Export) -> int: ...

    def holder(self, obj: Any, memory_type: str, span: tuple[int, int]) -> tuple[Any, int] | None:
        """The buffer of this path's own (from gpushare.allocate) that holds
        ``span`` (address, nbytes) of ``obj``, another object over it, and
        the span's offset in it; None where there is none."""
        return None

    def cliques(self, devices: list[Any]) -> list[str | None] | None:
        """The NVLink fabric clique a share of memory on each of ``devices``
        carries (None: this path adds none)."""
        return None

    def control_ops(self) -> dict[str, ControlOp]:
        """The control operations it serves beyond ``open`` and ``close``, by name."""
        return {}

    def stop(self) -> None:
        """The exporter stops: end what this path has under way in this process."""
        return None

    def on_seal(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` whenever memory this path serves is sealed read-only."""
        return None

    # importer side
    def facts(self, share: Share, near: bool) -> Hashable:
        """What this process is, as far as this path cares, for ``share``
        (``near``: its exporter is on this node); kept in :attr:`Here.facts`."""
        return None

    def warm(self) -> None:
        """Prepare this process (load a library) while the exporter prepares its offer."""
        return None

    def not_offered(self, share: Share) -> str | None: ...
    def unavailable(self, share: Share, here: Here) -> str | None: ...
    def open(self, share: Share, grant: dict, fds: list[int], lease: Lease | None, how: Options) -> Opened: ...


def same_node(share: Share, here: Here) -> bool:
    return share.node == here.node


def cuda_unavailable(here: Here) -> str | None:
    if here.cuda_reason is None:
        return None
    return f"this process cannot map CUDA memory ({here.cuda_reason.split(' (')[0]})"


def own_registration(fds: list[int], *, device: Any, sizes: tuple[int, ...], size: int, owner_uuid: str | None,
                     readonly: bool = False) -> Offer:
    """Serve duplicates of ``fds`` under a token of this share's own.

    The share's registration is independent of the buffer's: revoking or
    retiring the share revokes it (and closes the duplicates) without
    touching other exports of the same buffer.  For a read-only share the
    duplicates are the memfds opened again read-only: an importer can map
    them only read-only, and cannot make its mapping writable.
    """
    dups: list[int] = []
    try:
        for fd in fds:
            dups.append(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC) if readonly else os.dup(fd))
        _, desc = broker.publish(dups, device=device, sizes=sizes, size=size, owner_uuid=owner_uuid)
    except BaseException:
        for fd in dups:
            os.close(fd)
        raise
    return Offer(desc, (desc.export_id, dups))


def descriptor_of(share: Share, payload: dict, kinds: tuple[type, ...]) -> Any:
    """The descriptor of a mapped offer, checked against the share."""
    fields = payload.get("descriptor")
    if not isinstance(fields, tuple) or not fields:
        raise InvalidInputError("exporter sent a malformed descriptor")
    desc = _rebuilt(fields)
    if not isinstance(desc, kinds):
        raise InvalidInputError(f"exporter sent a {type(desc).__name__} with a {payload.get('path', 'mapped')} offer")
    size = getattr(desc, "size", None)
    # A share of part of a buffer maps the whole buffer and views its part.
    if not isinstance(size, int) or size < share.offset + share.nbytes:
        raise InvalidInputError(f"descriptor is {size if size is not None else '?'} bytes; the share says "
                                f"{share.nbytes} at offset {share.offset}")
    return desc


#: Descriptors rebuilt from an exporter's fields: fields -> (those fields, the descriptor).
#: A further open of a share gets the same fields again.
_rebuilt_from: dict[tuple, tuple[tuple, Any]] = {}
_REBUILT_MAX = 256


def _rebuilt(fields: tuple) -> Any:
    """``_rebuild(*fields)``, validated once for fields seen before (the very
    same values of the very same types: ``True`` is not ``1`` here)."""
    try:
        hit = _rebuilt_from.get(fields)
    except TypeError:  # something unhashable: validated (and refused) below
        hit = None
    if hit is not None and _same(hit[0], fields):
        return hit[1]
    desc = _rebuild(*fields)
    if hit is None:
        if len(_rebuilt_from) >= _REBUILT_MAX:
            _rebuilt_from.clear()
        try:
            _rebuilt_from[fields] = (fields, desc)
        except TypeError:  # unhashable, yet valid: not remembered
            pass
    return desc


def _same(a: tuple, b: tuple) -> bool:
    """Equal tuples whose items are of the same types, nested tuples too."""
    if a != b or list(map(type, a)) != list(map(type, b)):
        return False
    return all(_same(x, y) for x, y in zip(a, b, strict=True) if type(x) is tuple)


def descriptor_payload(export: Any, name: str) -> dict:
    """The payload of a grant of ``name``: the export's descriptor for it,
    made once per export (a descriptor never changes), its bytes already
    as the control channel writes them."""
    made = export.payloads.get(name)
    if made is None:
        desc = export.descriptors[name]
        made = export.payloads[name] = {"descriptor": _control.encode([desc.handle_type, *desc._fields()])}
    return made


def no_fds(name: str, fds: list[int]) -> None:
    if fds:
        raise InvalidInputError(f"exporter sent file descriptors with a {name} offer")


def exporter_exited(share: Share) -> bool | None:
    """True when the exporting process is gone (checked on its node only), False
    when it runs, None when this process cannot tell (another node)."""
    if share.node != node_key():
        return None
    state = process_state(share.exporter_pid)
    return state is None or state in ("Z", "X")  # gone, or exited and not yet reaped by its parent


class Paced:
    """One request made of several, started at most ``window`` at a time: the
    next starts as an earlier one completes (in ``wait``, ``done`` and
    ``await``, in the caller's thread), so a batch of any size stays within
    what the exporter lets one connection have under way.  After a failure
    nothing more starts; the error is the first failure's.  ``wait``,
    ``done``, ``exception`` and ``await``, as the requests it is made of."""

    __slots__ = ("_error", "_inflight", "_next", "_starts", "_what", "_window")

    def __init__(self, starts: list[Callable[[], Any]], window: int, what: str) -> None:
        self._starts: list[Callable[[], Any] | None] = list(starts)
        self._window, self._what = window, what
        self._next = 0
        self._inflight: collections.deque[Any] = collections.deque()
        self._error: BaseException | None = None
        self._pump()

    def _pump(self) -> None:
        """Retire completed requests (oldest first) and start more, up to the window."""
        while self._inflight and self._inflight[0].done():
            exc = self._inflight.popleft().exception()
            if exc is not None and self._error is None:
                self._error = exc
        while self._error is None and self._next < len(self._starts) and len(self._inflight) < self._window:
            start, self._starts[self._next] = self._starts[self._next], None  # started: the request holds its buffers
            self._next += 1
            try:
                self._inflight.append(start())  # type: ignore[misc]
            except GpuShareError as exc:
                self._error = exc

    def _finished(self) -> bool:
        return not self._inflight and (self._error is not None or self._next == len(self._starts))

    def done(self) -> bool:
        self._pump()
        return self._finished()

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until every part completes; raise the first error.

        Raises
        ------
        WaitTimeoutError
            If ``timeout`` seconds pass first; what started stays in flight
            (its buffers in use) until it ends, and the rest starts on the
            next ``wait``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            if self._finished():
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            oldest = self._inflight[0]
            try:
                oldest.wait(left)
            except WaitTimeoutError:
                raise WaitTimeoutError(f"{self._what} did not finish within {timeout} s; what started stays in "
                                       "flight, and its buffers in use, until it ends") from None
            except GpuShareError:
                if not oldest.done():
                    raise  # the peer is gone: nothing will complete it
        if self._error is not None:
            raise self._error

    def __await__(self) -> Any:
        while True:
            self._pump()
            if self._finished():
                break
            oldest = self._inflight[0]
            try:
                yield from oldest.__await__()
            except GpuShareError:
                if not oldest.done():
                    raise  # the peer is gone: nothing will complete it
        if self._error is not None:
            raise self._error
