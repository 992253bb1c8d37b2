"""Plain-data descriptors for same-node sharing.

A descriptor says where an exported buffer's physical memory can be fetched
from; it is made by :func:`gpushare.export_buffer` and turned back into memory
by :func:`gpushare.import_buffer`.  Descriptors hold only bytes, integers and
strings, are immutable, and pickle through ``__reduce__`` to a constructor that
validates every field again, because a descriptor that crossed a process
boundary is untrusted.  Nothing here loads a driver.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import Any, TypeVar, cast, dataclass_transform

from ._errors import InvalidInputError
from ._types import OLD_HANDLE_TYPES
from ._types import integer as _integer
from ._types import text as _text

__all__ = [
    "FABRIC_HANDLE_BYTES",
    "MAX_ALLOCATIONS",
    "MAX_SIZE",
    "CudaIpcBufferDescriptor",
    "CudaPoolBufferDescriptor",
    "PosixFdBufferDescriptor",
    "VirtualMemoryFabricBufferDescriptor",
    "cuda_core_fabric_descriptor_class",
]

#: Bytes in one CUDA fabric handle (``CUmemFabricHandle``).
FABRIC_HANDLE_BYTES = 64
#: Most physical allocations one descriptor may name.
MAX_ALLOCATIONS = 1 << 16
#: Every size (one allocation, their sum, the buffer) is below this.
MAX_SIZE = 1 << 63
#: The one format of :class:`PosixFdBufferDescriptor` this version reads.
POSIX_FD_FORMAT = 1
_MAX_TOKEN_BYTES = 32
_MAX_SUN_PATH = 107
_MAX_DEVICE = 1 << 16
_MAX_PID = 1 << 31


def _size_list(sizes: object, what: str = "allocation size") -> tuple[int, ...]:
    items = _bounded_items(sizes, "sizes")
    out = []
    for i, raw in enumerate(items):
        value = _integer(raw, f"{what} {i}")
        if value <= 0:
            raise InvalidInputError(f"{what} {i} is {value}; expected a positive integer")
        if value >= MAX_SIZE:
            raise InvalidInputError(f"{what} {i} is {value}; expected less than 2**63")
        out.append(value)
    total = sum(out)
    if total >= MAX_SIZE:
        raise InvalidInputError(f"allocation sizes add up to {total}; expected less than 2**63")
    return tuple(out)


def _bounded_items(items: object, what: str) -> list[Any]:
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        raise InvalidInputError(f"{what} is a single {type(items).__name__}; expected an iterable of them")
    try:
        iterator = iter(items)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidInputError(f"{what} is {type(items).__name__}; expected an iterable") from None
    out = list(itertools.islice(iterator, MAX_ALLOCATIONS + 1))
    if len(out) > MAX_ALLOCATIONS:
        raise InvalidInputError(f"{what} has more than {MAX_ALLOCATIONS} entries")
    if not out:
        raise InvalidInputError(f"{what} is empty; expected one entry per physical allocation")
    return out


def _buffer_size(size: object, sizes: tuple[int, ...]) -> int:
    total = sum(sizes)
    if size is None:
        return total
    value = _integer(size, "buffer size")
    if not 0 <= value <= total:
        raise InvalidInputError(
            f"buffer size is {value}; expected between 0 and {total}, the sum of the allocation sizes"
        )
    return value


def _blob64(value: object, what: str) -> None:
    if not isinstance(value, bytes):
        raise InvalidInputError(f"{what} is {type(value).__name__}; expected 64 bytes")
    if len(value) != 64:
        raise InvalidInputError(f"{what} is {len(value)} bytes; expected 64")


def _span_in(base_size: object, offset: object, size: object, what: str) -> tuple[int, int, int]:
    """(allocation size, offset, size) of a buffer that must lie inside it."""
    (base,) = _size_list([base_size], f"{what} size")
    offset_i = _integer(offset, "offset")
    size_i = _integer(size, "buffer size")
    if offset_i < 0 or size_i < 0 or offset_i + size_i > base:
        raise InvalidInputError(
            f"buffer of {size_i} bytes at offset {offset_i} does not fit in the {what} of {base} bytes"
        )
    return base, offset_i, size_i


def _ordinal(device: object) -> int:
    device_i = _integer(device, "device")
    if not 0 <= device_i < _MAX_DEVICE:
        raise InvalidInputError(f"device is {device_i}; expected 0 to {_MAX_DEVICE - 1}")
    return device_i


class _Frozen:
    """What every descriptor shares: no direct construction, no assignment or
    deletion of an attribute, pickling through :func:`_rebuild`, equality and
    hash by its fields.  Each descriptor is a :func:`_descriptor` dataclass
    over it."""

    __slots__ = ()

    #: What to call instead of the class, for its refusal of direct construction.
    _MADE_BY = "gpushare.export_buffer()"

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(f"{type(self).__name__} cannot be constructed directly; use {self._MADE_BY}")

    @classmethod
    def _new(cls, **fields: Any) -> Any:
        """An instance with ``fields`` set: its validating constructor's last step."""
        self = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    handle_type: str
    #: The field names, in the order the validating constructor takes them
    #: (the pickled form): set by :func:`_descriptor` from the declaration order.
    _FIELDS: tuple[str, ...] = ()

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    @classmethod
    def _from_fields(cls, *fields: Any) -> Any:
        raise NotImplementedError

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.handle_type, *self._fields()))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._fields()))


_D = TypeVar("_D", bound=_Frozen)


# Type checkers see a frozen dataclass: its fields are read-only attributes.
@dataclass_transform(frozen_default=True)
def _descriptor(cls: type[_D]) -> type[_D]:
    """A frozen, slotted dataclass of ``cls``, whose fields (declared in the
    pickled form's order: never reorder them) are its attributes.

    The dataclass makes no ``__init__`` (the class refuses direct construction;
    its validating classmethod builds it), no ``repr`` and no equality (the
    descriptor's own); the frozen dataclass's ``__setattr__``/``__delattr__``
    give way to :class:`_Frozen`'s, which say "is immutable" as descriptors
    always have (a frozen dataclass's ``FrozenInstanceError`` says "cannot
    assign to field").
    """
    made = dataclasses.dataclass(frozen=True, init=False, repr=False, eq=False, slots=True)(cls)
    del made.__setattr__, made.__delattr__
    made._FIELDS = tuple(f.name for f in dataclasses.fields(cast(Any, made)))
    return made


def cuda_core_fabric_descriptor_class() -> type | None:
    """cuda.core's own ``VirtualMemoryFabricBufferDescriptor`` where the
    installed cuda.core has one, else ``None``.  Imports cuda.core lazily."""
    try:
        import cuda.core
    except ImportError:
        return None
    return getattr(cuda.core, "VirtualMemoryFabricBufferDescriptor", None)


@_descriptor
class VirtualMemoryFabricBufferDescriptor(_Frozen):
    """Plain-data descriptor of a CUDA virtual-memory buffer exported with
    fabric handles.

    Each physical allocation contributes one opaque 64-byte handle, in address
    order.  Plain pickle, multiprocessing, or a transport of your own can carry
    it; :meth:`from_handles` rebuilds one from handles received outside
    gpushare, :func:`gpushare.import_buffer` imports it.  This is the contract
    of cuda.core's class of the same name: where the installed cuda.core has
    that class, :func:`gpushare.import_buffer` accepts its instances and
    :meth:`to_cuda_core` produces one.

    Nothing is pinned: a fabric descriptor parked in a queue does not retain
    the memory.  The exporter must keep the buffer alive until every importer
    has imported it; an imported allocation then holds its own driver
    references.  Importing a stale or forged handle fails with a driver error.

    Attributes
    ----------
    handle_type : str
        Always ``"fabric"``.
    handles : tuple[bytes, ...]
        One opaque 64-byte fabric handle per allocation, in address order.
    sizes : tuple[int, ...]
        Size of each physical allocation, in address order; the sum is at
        least ``size``.
    size : int
        The buffer size.
    owner_uuid : str or None
        The exporting device's UUID, if the exporter supplied it.
    """

    #: One opaque 64-byte fabric handle per allocation, in address order.
    handles: tuple[bytes, ...]
    #: Size of each physical allocation, in address order.
    sizes: tuple[int, ...]
    #: The buffer size in bytes.
    size: int
    #: The exporting device's UUID, if supplied by the exporter.
    owner_uuid: str | None

    handle_type = "fabric"

    _MADE_BY = "VirtualMemoryFabricBufferDescriptor.from_handles() or gpushare.export_buffer()"

    @classmethod
    def from_handles(
        cls,
        handles: Iterable[bytes],
        sizes: Iterable[int],
        *,
        size: int | None = None,
        owner_uuid: str | None = None,
    ) -> VirtualMemoryFabricBufferDescriptor:
        """Build a descriptor from fabric handles received through a transport
        of your own.

        Parameters
        ----------
        handles : Iterable[bytes]
            One opaque 64-byte handle per physical allocation, in address order.
        sizes : Iterable[int]
            One positive allocation size per handle, in the same order.
        size : int, optional
            Buffer size, between zero and the sum of ``sizes``; the sum by default.
        owner_uuid : str, optional
            Exporting device's UUID, used to identify the owner in error messages.

        Returns
        -------
        VirtualMemoryFabricBufferDescriptor

        Raises
        ------
        ValueError
            (:class:`gpushare.InvalidInputError`) If counts differ, a handle is
            not 64 bytes, an allocation size is not a positive integer below
            2**63, or the buffer size is outside the allocation sizes.
        """
        raw = _bounded_items(handles, "handles")
        checked = []
        for i, handle in enumerate(raw):
            if not isinstance(handle, (bytes, bytearray, memoryview)):
                raise InvalidInputError(
                    f"handle {i} is {type(handle).__name__}; expected {FABRIC_HANDLE_BYTES} bytes"
                )
            data = bytes(handle)
            if len(data) != FABRIC_HANDLE_BYTES:
                raise InvalidInputError(f"handle {i} is {len(data)} bytes; expected {FABRIC_HANDLE_BYTES}")
            checked.append(data)
        sizes_t = _size_list(sizes)
        if len(sizes_t) != len(checked):
            raise InvalidInputError(
                f"{len(checked)} handles but {len(sizes_t)} sizes; expected one size per handle"
            )
        return cls._new(handles=tuple(checked), sizes=sizes_t, size=_buffer_size(size, sizes_t),
                        owner_uuid=_text(owner_uuid, "owner_uuid"))

    @classmethod
    def _from_fields(
        cls, handles: Any, sizes: Any, size: Any, owner_uuid: Any
    ) -> VirtualMemoryFabricBufferDescriptor:
        return cls.from_handles(handles, sizes, size=size, owner_uuid=owner_uuid)

    @classmethod
    def _coerce(cls, other: object) -> VirtualMemoryFabricBufferDescriptor:
        """Ours as is; cuda.core's class of the same name re-validated into ours."""
        if isinstance(other, cls):
            return other
        theirs = cuda_core_fabric_descriptor_class()
        if theirs is not None and isinstance(other, theirs):
            return cls.from_handles(other.handles, other.sizes, size=other.size, owner_uuid=other.owner_uuid)
        raise InvalidInputError(f"expected a VirtualMemoryFabricBufferDescriptor, got {type(other).__name__}")

    def to_cuda_core(self) -> Any:
        """The same descriptor as cuda.core's own class, for
        ``Buffer.from_ipc_descriptor()``.

        Raises
        ------
        ImportError
            If the installed cuda.core has no ``VirtualMemoryFabricBufferDescriptor``
            (cuda.core 1.2 has none; import with :func:`gpushare.import_buffer`).
        """
        theirs = cuda_core_fabric_descriptor_class()
        if theirs is None:
            raise ImportError(
                "the installed cuda.core has no VirtualMemoryFabricBufferDescriptor; "
                "upgrade cuda-core, or import with gpushare.import_buffer()"
            )
        return theirs.from_handles(self.handles, self.sizes, size=self.size, owner_uuid=self.owner_uuid)


@_descriptor
class PosixFdBufferDescriptor(_Frozen):
    """Plain-data descriptor of a buffer whose physical allocations are file
    descriptors held by the exporting process.

    The descriptor itself holds no file descriptor.  It names the exporter's
    broker (a Unix socket on this node) and carries an unguessable token; the
    broker hands one file descriptor per physical allocation, with
    ``SCM_RIGHTS``, to a process of the same user (or root) that presents the
    token.  Host buffers share memfds this way, CUDA virtual memory its POSIX
    file-descriptor handles.  Made by :func:`gpushare.export_buffer`; carried
    by pickle; imported by :func:`gpushare.import_buffer`.

    Attributes
    ----------
    handle_type : str
        Always ``"posix-fd"``.
    version : int
        Format version (1).
    address : str
        The broker's Unix-socket address; a leading ``"\\0"`` means the
        abstract namespace.
    export_id : int
        The export's number within that broker.
    token : bytes
        32 random bytes; whoever holds them may map the memory.
    pid : int
        The exporting process.
    node : str
        The exporting node's identity (boot id and host name).
    device : str or int
        ``"host"``, or the exporting CUDA device's ordinal.
    sizes : tuple[int, ...]
        Size of each physical allocation, in address order.
    size : int
        The buffer size; at most the sum of ``sizes``.
    owner_uuid : str or None
        The exporting CUDA device's UUID, ``None`` for host memory.
    """

    #: Format version.
    version: int
    #: The broker's Unix-socket address.
    address: str
    #: The export's number within its broker.
    export_id: int
    #: The 32-byte secret that grants the import.
    token: bytes
    #: The exporting process id.
    pid: int
    #: The exporting node's identity.
    node: str
    #: "host" or a CUDA device ordinal.
    device: str | int
    #: Size of each physical allocation, in order.
    sizes: tuple[int, ...]
    #: The buffer size in bytes.
    size: int
    #: The exporting device's UUID, or None.
    owner_uuid: str | None

    handle_type = "posix-fd"

    @classmethod
    def _from_fields(
        cls,
        version: object,
        address: object,
        export_id: object,
        token: object,
        pid: object,
        node: object,
        device: object,
        sizes: object,
        size: object,
        owner_uuid: object,
    ) -> PosixFdBufferDescriptor:
        """The validating constructor; unpickling goes through it."""
        version_i = _integer(version, "descriptor format version")
        if version_i != POSIX_FD_FORMAT:
            raise InvalidInputError(
                f"descriptor format version {version_i} is not supported; "
                f"this gpushare reads version {POSIX_FD_FORMAT}"
            )
        if not isinstance(address, str):
            raise InvalidInputError(f"broker address is {type(address).__name__}; expected a str")
        try:
            encoded = address.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise InvalidInputError("broker address is not encodable text (a lone surrogate)") from None
        if not encoded or len(encoded) > _MAX_SUN_PATH:
            raise InvalidInputError(f"broker address is {len(encoded)} bytes; expected 1 to {_MAX_SUN_PATH}")
        if b"\0" in encoded[1:] or address == "\0":
            raise InvalidInputError("broker address has a NUL byte after its first character")
        export_i = _integer(export_id, "export id")
        if not 0 <= export_i < MAX_SIZE:
            raise InvalidInputError(f"export id is {export_i}; expected 0 to 2**63 - 1")
        if not isinstance(token, bytes):
            raise InvalidInputError(f"token is {type(token).__name__}; expected bytes")
        if len(token) != _MAX_TOKEN_BYTES:
            raise InvalidInputError(f"token is {len(token)} bytes; expected {_MAX_TOKEN_BYTES}")
        pid_i = _integer(pid, "exporter pid")
        if not 0 < pid_i < _MAX_PID:
            raise InvalidInputError(f"exporter pid is {pid_i}; expected 1 to 2**31 - 1")
        node_s = _text(node, "node identity", optional=False)
        if device != "host":
            if isinstance(device, str):
                raise InvalidInputError(f"device is {device!r}; expected 'host' or a device ordinal")
            device = _integer(device, "device")
            if not 0 <= device < _MAX_DEVICE:
                raise InvalidInputError(f"device is {device}; expected 'host' or 0 to {_MAX_DEVICE - 1}")
        sizes_t = _size_list(sizes)
        return cls._new(version=version_i, address=address, export_id=export_i, token=token, pid=pid_i, node=node_s,
                        device=device, sizes=sizes_t, size=_buffer_size(size, sizes_t),
                        owner_uuid=_text(owner_uuid, "owner_uuid"))

    def __repr__(self) -> str:
        # The token is a secret: never print it.
        return (
            f"PosixFdBufferDescriptor(device={self.device!r}, allocations={len(self.sizes)}, "
            f"size={self.size}, pid={self.pid}, export_id={self.export_id})"
        )


@_descriptor
class CudaIpcBufferDescriptor(_Frozen):
    """Plain-data descriptor of CUDA memory not from VMM (a CuPy pool array,
    a torch tensor), shared with a legacy CUDA IPC handle.

    The handle names the whole base allocation that contains the buffer; the
    buffer is ``size`` bytes at ``offset`` into it.  Made by
    :func:`gpushare.export_buffer` (``handle_type="cuda-ipc"``), imported by
    :func:`gpushare.import_buffer` in another process on the same node.

    Attributes
    ----------
    handle_type : str
        Always ``"cuda-ipc"``.
    handle : bytes
        The 64-byte ``CUipcMemHandle`` of the base allocation.
    base_size : int
        Size of the base allocation.
    offset : int
        Where the buffer starts in the base allocation.
    size : int
        The buffer size; ``offset + size <= base_size``.
    device : int
        The exporting device's ordinal.
    owner_uuid : str or None
        The exporting device's UUID.
    pid : int
        The exporting process.
    node : str
        The exporting node's identity.
    """

    #: The base allocation's 64-byte IPC handle.
    handle: bytes
    #: Size of the base allocation.
    base_size: int
    #: The buffer's offset in the base allocation.
    offset: int
    #: The buffer size in bytes.
    size: int
    #: The exporting device's ordinal.
    device: int
    #: The exporting device's UUID, or None.
    owner_uuid: str | None
    #: The exporting process id.
    pid: int
    #: The exporting node's identity.
    node: str

    handle_type = "cuda-ipc"

    @classmethod
    def _from_fields(
        cls,
        handle: object,
        base_size: object,
        offset: object,
        size: object,
        device: object,
        owner_uuid: object,
        pid: object,
        node: object,
    ) -> CudaIpcBufferDescriptor:
        _blob64(handle, "handle")
        base, offset_i, size_i = _span_in(base_size, offset, size, "base allocation")
        device_i = _ordinal(device)
        pid_i = _integer(pid, "exporter pid")
        if not 0 < pid_i < _MAX_PID:
            raise InvalidInputError(f"exporter pid is {pid_i}; expected 1 to 2**31 - 1")
        return cls._new(handle=handle, base_size=base, offset=offset_i, size=size_i, device=device_i,
                        owner_uuid=_text(owner_uuid, "owner_uuid"), pid=pid_i,
                        node=_text(node, "node identity", optional=False))

    def __repr__(self) -> str:
        return (
            f"CudaIpcBufferDescriptor(device={self.device}, offset={self.offset}, "
            f"size={self.size}, pid={self.pid})"
        )


@_descriptor
class CudaPoolBufferDescriptor(_Frozen):
    """Plain-data descriptor of CUDA memory from an exportable stream-ordered
    pool (for example cuda.core's ``DeviceMemoryResource`` made with
    ``ipc_enabled=True``), which legacy CUDA IPC cannot share.

    The pool's POSIX file descriptor is served by the exporter's fd broker
    (``address``, ``export_id``, ``token``, ``pid`` and ``node`` say where
    and how to fetch it, as for :class:`PosixFdBufferDescriptor`);
    ``export_data`` is the 64-byte
    ``CUmemPoolPtrExportData`` of the allocation that holds the buffer, which
    is ``size`` bytes at ``offset`` into that allocation of ``base_size``
    bytes.  Made by :func:`gpushare.export_buffer` (``handle_type="cuda-ipc"``),
    imported by :func:`gpushare.import_buffer` in another process on the same
    node.

    Attributes
    ----------
    handle_type : str
        Always ``"cuda-pool"``.
    device : int
        The exporting device's ordinal.
    owner_uuid : str or None
        The exporting device's UUID.
    export_data : bytes
        The allocation's 64-byte pool export data.
    base_size, offset, size : int
        The allocation's size, and the buffer's place in it.
    """

    #: The exporter's fd broker socket.
    address: str
    #: The pool's entry in the broker.
    export_id: int
    #: The 32-byte token the broker asks for.
    token: bytes
    #: The exporting process id.
    pid: int
    #: The exporting node's identity.
    node: str
    #: The exporting device's ordinal.
    device: int
    #: The exporting device's UUID, or None.
    owner_uuid: str | None
    #: The allocation's 64-byte pool export data.
    export_data: bytes
    #: Size of the allocation that holds the buffer.
    base_size: int
    #: The buffer's offset in that allocation.
    offset: int
    #: The buffer size in bytes.
    size: int

    handle_type = "cuda-pool"

    @classmethod
    def _from_fields(
        cls,
        address: object,
        export_id: object,
        token: object,
        pid: object,
        node: object,
        device: object,
        owner_uuid: object,
        export_data: object,
        base_size: object,
        offset: object,
        size: object,
    ) -> CudaPoolBufferDescriptor:
        _blob64(export_data, "export data")
        base, offset_i, size_i = _span_in(base_size, offset, size, "allocation")
        device_i = _ordinal(device)
        # The pool's broker entry is validated as a one-fd POSIX-fd descriptor.
        pool = PosixFdBufferDescriptor._from_fields(
            POSIX_FD_FORMAT, address, export_id, token, pid, node, device_i, (base,), base, owner_uuid
        )
        return cls._new(address=pool.address, export_id=pool.export_id, token=pool.token, pid=pool.pid,
                        node=pool.node, device=pool.device, owner_uuid=pool.owner_uuid, export_data=export_data,
                        base_size=base, offset=offset_i, size=size_i)

    def __repr__(self) -> str:
        return (
            f"CudaPoolBufferDescriptor(device={self.device}, offset={self.offset}, "
            f"size={self.size}, pid={self.pid}, export_id={self.export_id})"
        )


def _rebuild(handle_type: object, *fields: object) -> Any:
    """The unpickling constructor of every descriptor: validates it all again."""
    kinds: dict[object, Any] = {
        cls.handle_type: cls
        for cls in (VirtualMemoryFabricBufferDescriptor, PosixFdBufferDescriptor, CudaIpcBufferDescriptor,
                    CudaPoolBufferDescriptor)
    }
    if isinstance(handle_type, str):  # pickles made before the hyphenated spelling
        handle_type = OLD_HANDLE_TYPES.get(handle_type, handle_type)
    cls = kinds.get(handle_type) if isinstance(handle_type, str) else None
    if cls is None:
        raise InvalidInputError(f"unknown descriptor handle type {handle_type!r:.40}")
    if len(fields) != len(cls._FIELDS):
        raise InvalidInputError(
            f"{handle_type} descriptor has {len(fields)} fields; expected {len(cls._FIELDS)}"
        )
    return cls._from_fields(*fields)
