"""The cuda-ipc path: CUDA memory not from VMM, on one node.

Memory from ``cudaMalloc``/``cuMemAlloc`` goes through legacy CUDA IPC.
Memory from a stream-ordered pool cannot; when its pool was made exportable
(POSIX file descriptors, as cuda.core's ``DeviceMemoryResource`` with
``ipc_enabled=True`` makes it), it goes through the pool's own export: the
pool's fd, served by the fd broker once per pool, and the allocation's
export data (:class:`~gpushare.CudaPoolBufferDescriptor`).

The exporter takes the IPC handle of the whole base allocation that contains
the buffer (``cuMemGetAddressRange``) and sends the offset along.  Opening a
handle costs about a millisecond, so the importer opens each base allocation
once and shares the mapping among every buffer imported from it; the handle
is closed when the last of them is closed.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

from .._cuda import _copies, _driver, vmm
from .._descriptors import CudaIpcBufferDescriptor, CudaPoolBufferDescriptor
from .._errors import (
    ClosedError,
    CUDAError,
    GpuShareError,
    InvalidInputError,
    UnsupportedError,
)
from .._process import check_same_node, node_identity
from . import broker
from .base import (
    OTHER_CUDA,
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
    same_node,
)
from .broker import fetch_fds

__all__ = ["export_ipc", "import_ipc", "import_pool", "map_ipc", "map_pool", "open_handle_count", "base_allocation"]

_lock = threading.Lock()
#: (exporter pid, handle bytes, device) -> [base pointer, mapped size, users]
_opened: dict[tuple[int, bytes, int], list[int]] = {}
_Ref: type | None = None


def open_handle_count() -> int:
    """How many base allocations this process has open through CUDA IPC,
    legacy handles and imported pool allocations together."""
    with _lock:
        return len(_opened) + len(_imported_ptrs)


def _pointer_and_size(obj: Any) -> tuple[int, int]:
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        itemsize = int(cai["typestr"][2:])
        strides = cai.get("strides")
        if strides is not None:
            expected = []
            step = itemsize
            for dim in reversed(shape):
                expected.append(step)
                step *= dim
            if tuple(reversed(expected)) != tuple(strides) and math.prod(shape) > 1:
                raise InvalidInputError("only C-contiguous arrays can be exported through CUDA IPC")
        return int(cai["data"][0]), math.prod(shape) * itemsize
    if hasattr(obj, "handle") and hasattr(obj, "size") and getattr(obj, "is_device_accessible", False):
        return int(obj.handle), int(obj.size)
    raise InvalidInputError(
        f"cannot export {type(obj).__name__}: expected a cuda.core Buffer or an object "
        "with __cuda_array_interface__"
    )


def _ipc_kind(drv: Any, ptr: int) -> Any:
    """How CUDA IPC exports the memory at ``ptr`` (its device's context
    current): True through legacy IPC, a pool handle through that pool's
    own export, None not at all (virtual memory not from gpushare.allocate)."""
    attrs = drv.CUpointer_attribute
    capable = _driver.check(drv.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr),
                            "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)")
    if int(capable):
        return True
    pool = _driver.check(drv.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr),
                         "cuPointerGetAttribute(MEMPOOL_HANDLE)")
    return pool if pool is not None and int(pool) else None


def base_allocation(ptr: int, device: int) -> tuple[int, int] | None:
    """(base, size) of the allocation CUDA IPC exports for CUDA memory at
    ``ptr`` on ``device``: the ``cudaMalloc`` block (a CuPy pool chunk,
    a torch caching-allocator segment) or the pool allocation; None for
    memory it cannot export (virtual memory not from gpushare.allocate)."""
    drv = _driver.driver()
    with _driver.on_device(device):
        if _ipc_kind(drv, ptr) is None:
            return None
        base, size = _driver.check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    return int(base), int(size)


def export_ipc(obj: Any) -> CudaIpcBufferDescriptor:
    """The legacy CUDA IPC descriptor of a device buffer or array.

    Raises
    ------
    UnsupportedError
        For memory legacy IPC cannot export: memory from a stream-ordered
        pool (``cudaMallocAsync``, cuda.core's ``Device.allocate``, torch's
        expandable segments) or CUDA virtual memory not from
        :func:`gpushare.allocate`.
    """
    drv = _driver.driver()
    ptr, size = _pointer_and_size(obj)
    hint = getattr(obj, "device_id", None)
    ordinal = _driver.pointer_ordinal(ptr, hint if isinstance(hint, int) and hint >= 0 else None)
    with _driver.on_device(ordinal):
        kind = _ipc_kind(drv, ptr)
        if kind is None:
            raise UnsupportedError(
                "legacy CUDA IPC cannot export this memory: it is CUDA virtual memory not from "
                "gpushare.allocate; allocate it with gpushare.allocate(size, device=N) to share it on "
                "this node, or share it over ucx-rma"
            )
        if kind is not True:
            return _export_pool(drv, kind, ptr, size, ordinal)
        base, base_size = _driver.check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        handle = _driver.check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    return CudaIpcBufferDescriptor._from_fields(
        _driver.bytes_of(handle, 64),
        int(base_size),
        ptr - int(base),
        size,
        ordinal,
        _driver.device_uuid(ordinal),
        os.getpid(),
        node_identity(),
    )


#: pool handle -> (its broker descriptor, the fd the broker serves)
_pools: dict[int, Any] = {}


def _export_pool(drv: Any, pool: Any, ptr: int, size: int, ordinal: int) -> CudaPoolBufferDescriptor:
    """Describe pool memory through the pool's own export (context pushed)."""
    t = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    with _lock:
        entry = _pools.get(int(pool))
        if entry is None or entry[0].pid != os.getpid():
            res = drv.cuMemPoolExportToShareableHandle(pool, t, 0)
            if res[0] != drv.CUresult.CUDA_SUCCESS:
                raise UnsupportedError(
                    "this memory comes from a stream-ordered memory pool that was not made exportable "
                    "(cudaMallocAsync's default pool, cuda.core Device.allocate, torch expandable segments "
                    f"[{res[0].name}]): legacy CUDA IPC cannot share it. Allocate "
                    "from an exportable pool (cuda.core DeviceMemoryResource with ipc_enabled=True), or "
                    "with gpushare.allocate(size, device=N), or share it over ucx-rma"
                )
            fd = int(res[1])
            try:
                _, desc = broker.publish([fd], device=ordinal, sizes=(1,), size=1,
                                         owner_uuid=_driver.device_uuid(ordinal))
            except BaseException:
                os.close(fd)
                raise
            entry = (desc, fd)  # served, and the fd kept, for the life of this process
            _pools[int(pool)] = entry
    desc = entry[0]
    base, base_size = _driver.check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    data = _driver.check(drv.cuMemPoolExportPointer(base), "cuMemPoolExportPointer")
    return CudaPoolBufferDescriptor._from_fields(
        desc.address, desc.export_id, desc.token, desc.pid, desc.node, ordinal, desc.owner_uuid,
        _driver.bytes_of(data, 64), int(base_size), ptr - int(base), size,
    )


class _Use:
    """One importer's use of an opened base allocation (released once)."""

    __slots__ = ("key", "ordinal", "done")

    def __init__(self, key: tuple, ordinal: int) -> None:
        self.key = key
        self.ordinal = ordinal
        self.done = False


def _released(unuse: Callable[[Any], None], what: str) -> Callable[[Any], None]:
    """A release of a use that ``unuse`` ends: called from close() or the
    garbage collector, so a driver failure is a warning (``what`` failed),
    never an exception."""

    def release(use: Any) -> None:
        try:
            unuse(use)
        except CUDAError as exc:
            warnings.warn(f"{what} failed: {exc}", ResourceWarning, 2)

    return release


def _ref_class() -> type:
    """cuda.core's memory resource over a :class:`_Use` (or a
    :class:`_PoolUse`, with its ``release``), for the ``Buffer``
    :func:`import_ipc` and :func:`import_pool` return (made, with cuda.core,
    only when asked for)."""
    global _Ref
    if _Ref is not None:
        return _Ref
    from cuda.core import MemoryResource

    class IpcRef(MemoryResource):  # type: ignore[misc]
        """One importer's use of an opened base allocation."""

        def __init__(self, use: Any, release: Any = _release) -> None:
            self.use = use
            self.release = release

        def allocate(self, size: int, *, stream: Any = None) -> Any:
            raise UnsupportedError("imported CUDA IPC memory cannot allocate")

        def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
            self.release(self.use)

        def grant(self, ordinal: int) -> None:
            """Let device ``ordinal`` reach the memory too (pool memory: see :class:`_PoolUse`)."""
            grant = getattr(self.use, "grant", None)
            if grant is not None:
                grant(ordinal)

        is_device_accessible = property(lambda self: True)
        is_host_accessible = property(lambda self: False)
        is_managed = property(lambda self: False)
        device_id = property(lambda self: self.use.ordinal)

    _Ref = IpcRef
    return _Ref


def _last_use(ref: Any, table: dict, count: int) -> Any:
    """End use ``ref`` (once) of its entry in ``table``, whose item
    ``count`` counts the uses: the entry, taken out of the table, when that
    was the last use; else None.  Called with ``_lock`` held."""
    if ref.done:
        return None
    ref.done = True
    entry = table.get(ref.key)
    if entry is None:
        return None
    entry[count] -= 1
    if entry[count]:
        return None
    del table[ref.key]
    return entry


def _unuse(ref: Any) -> None:
    drv = _driver.driver()
    with _lock:
        entry = _last_use(ref, _opened, 2)
        if entry is not None:
            # gpushare's own copies on the memory land first.  Any thread may
            # get here (close, finalizers, the garbage collector): the handle
            # belongs to the device's context.
            _copies.wait_for_copies(entry[0], entry[1])
            with _driver.on_device(ref.ordinal):
                _driver.check(drv.cuIpcCloseMemHandle(entry[0]), "cuIpcCloseMemHandle")


def import_ipc(desc: CudaIpcBufferDescriptor, device: int | None, *, readonly: bool = False) -> Any:
    """Open (or reuse) the base allocation and return a cuda.core ``Buffer``
    of the described range (:func:`gpushare.import_buffer`)."""
    address, use = _open_ipc(desc, device, readonly)
    from cuda.core import Buffer

    with _driver.on_device(use.ordinal):  # cuda.core records the current context's stream for the free
        return Buffer.from_handle(address, desc.size, mr=_ref_class()(use))


def map_ipc(desc: CudaIpcBufferDescriptor, device: int | None, *, readonly: bool = False) -> Any:
    """:func:`import_ipc` for a view: the range as a
    :class:`gpushare._cuda._driver.DeviceMemory` (no cuda.core on the way)."""
    address, use = _open_ipc(desc, device, readonly)
    return _driver.DeviceMemory(address, desc.size, use.ordinal, functools.partial(_release, use))


def _open_ipc(desc: CudaIpcBufferDescriptor, device: int | None, readonly: bool) -> tuple[int, _Use]:
    """Open (or reuse) the base allocation: the described range's address, and this use of it."""
    check_same_node(desc)
    if readonly:
        raise UnsupportedError(
            "legacy CUDA IPC maps memory writable only; a read-only share cannot be opened over cuda-ipc"
        )
    if desc.pid == os.getpid():
        raise UnsupportedError(
            "a CUDA IPC handle cannot be opened in the process that exported it; use the original buffer"
        )
    drv = _driver.driver()
    ordinal = _driver.import_ordinal(desc.owner_uuid, device)
    key = (desc.pid, desc.handle, ordinal)
    with _driver.on_device(ordinal), _lock:
        entry = _opened.get(key)
        if entry is None:
            handle = _driver.set_bytes(drv.CUipcMemHandle(), desc.handle)
            flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            base = int(_driver.check(drv.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle"))
            try:
                _, real = _driver.check(drv.cuMemGetAddressRange(base), "cuMemGetAddressRange")
            except BaseException:
                drv.cuIpcCloseMemHandle(base)
                raise
            entry = [base, int(real), 0]
            _opened[key] = entry
        if desc.offset + desc.size > entry[1]:
            if entry[2] == 0:
                del _opened[key]
                drv.cuIpcCloseMemHandle(entry[0])
            raise InvalidInputError(
                f"buffer of {desc.size} bytes at offset {desc.offset} does not fit in the "
                f"opened allocation of {entry[1]} bytes"
            )
        entry[2] += 1
        return entry[0] + desc.offset, _Use(key, ordinal)


#: (exporter pid, broker export id) -> [imported pool handle, pointers imported from it,
#: the pool's resident device here (None when this process does not see it), other devices granted access]
_imported_pools: dict[tuple[int, int], list[Any]] = {}
#: (exporter pid, broker export id, export data) -> [pointer, users, pool key, device, size]
_imported_ptrs: dict[tuple[int, int, bytes], list[Any]] = {}


def import_pool(desc: CudaPoolBufferDescriptor, device: int | None, *, readonly: bool = False,
                timeout: float | None = None) -> Any:
    """Import pool memory: the pool once per exporter's pool, each allocation
    once; a cuda.core ``Buffer`` of the described range whose close frees
    the imported pointer (and the pool with its last pointer)."""
    address, use = _open_pool(desc, device, readonly, timeout)
    from cuda.core import Buffer

    with _driver.on_device(use.ordinal):  # cuda.core records the current context's stream for the free
        return Buffer.from_handle(address, desc.size, mr=_ref_class()(use, _release_pool))


def map_pool(desc: CudaPoolBufferDescriptor, device: int | None, *, readonly: bool = False,
             timeout: float | None = None) -> Any:
    """:func:`import_pool` for a view: the range as a
    :class:`gpushare._cuda._driver.DeviceMemory` (no cuda.core on the way)."""
    address, use = _open_pool(desc, device, readonly, timeout)
    return _driver.DeviceMemory(address, desc.size, use.ordinal, functools.partial(_release_pool, use),
                                resource=use)


def _open_pool(desc: CudaPoolBufferDescriptor, device: int | None, readonly: bool,
               timeout: float | None) -> tuple[int, _PoolUse]:
    """Import (or reuse) the pool and the allocation: the described range's address, and this use of it."""
    check_same_node(desc)
    if readonly:
        raise UnsupportedError("imported pool memory is mapped writable only; a read-only share cannot use it")
    if desc.pid == os.getpid():
        raise UnsupportedError("pool memory cannot be imported by the process that exported it; use the original")
    drv = _driver.driver()
    ordinal = _driver.import_ordinal(desc.owner_uuid, device)
    pool_key = (desc.pid, desc.export_id)
    ptr_key = (desc.pid, desc.export_id, desc.export_data)
    t = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    with _driver.on_device(ordinal), _lock:
        pool_entry = _imported_pools.get(pool_key)
        if pool_entry is None:
            (fd,) = fetch_fds(desc.address, desc.export_id, desc.token, 1, pid=desc.pid,
                              **({} if timeout is None else {"timeout": timeout}))
            try:
                pool = _driver.check(drv.cuMemPoolImportFromShareableHandle(fd, t, 0),
                                   "cuMemPoolImportFromShareableHandle")
            finally:
                os.close(fd)
            pool_entry = [pool, 0, _driver.ordinal_of_uuid(desc.owner_uuid), set()]
            _imported_pools[pool_key] = pool_entry
        try:
            _grant_pool(drv, pool_entry, ordinal)
        except BaseException:
            if pool_entry[1] == 0:
                del _imported_pools[pool_key]
                drv.cuMemPoolDestroy(pool_entry[0])
            raise
        entry = _imported_ptrs.get(ptr_key)
        if entry is None:
            data = _driver.set_bytes(drv.CUmemPoolPtrExportData(), desc.export_data)
            try:
                ptr = int(_driver.check(drv.cuMemPoolImportPointer(pool_entry[0], data), "cuMemPoolImportPointer"))
                _, real = _driver.check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
                if desc.offset + desc.size > int(real):
                    drv.cuMemFree(ptr)
                    raise InvalidInputError(
                        f"buffer of {desc.size} bytes at offset {desc.offset} does not fit in the "
                        f"imported allocation of {int(real)} bytes"
                    )
            except BaseException:
                if pool_entry[1] == 0:
                    del _imported_pools[pool_key]
                    drv.cuMemPoolDestroy(pool_entry[0])
                raise
            entry = [ptr, 0, pool_key, ordinal, int(real)]
            _imported_ptrs[ptr_key] = entry
            pool_entry[1] += 1
        entry[1] += 1
        return entry[0] + desc.offset, _PoolUse(ptr_key, ordinal)


def _grant_pool(drv: Any, pool_entry: list[Any], ordinal: int) -> None:
    """Give device ``ordinal`` read-write access to an imported pool (under
    ``_lock``).  Memory imported from a pool is accessible from its resident
    device only; every other device, in the importing process, needs
    ``cuMemPoolSetAccess`` there (access granted in the exporter does not
    carry over)."""
    pool, _, resident, granted = pool_entry
    if ordinal == resident or ordinal in granted:
        return
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _driver.check(drv.cuMemPoolSetAccess(pool, [desc], 1), f"cuMemPoolSetAccess(device {ordinal})")
    granted.add(ordinal)


def _unuse_pool(ref: Any) -> None:
    drv = _driver.driver()
    with _lock:
        entry = _last_use(ref, _imported_ptrs, 1)
        if entry is None:
            return
        pool_entry = _imported_pools.get(entry[2])
        # gpushare's own copies on the memory land before it is freed (a
        # view waited for its consumers' work before: Mapped.close).
        _copies.wait_for_copies(entry[0], entry[4])
        with _driver.on_device(entry[3]):
            _free_imported(drv, entry[0])
            if pool_entry is not None:
                pool_entry[1] -= 1
                if pool_entry[1] == 0:
                    del _imported_pools[entry[2]]
                    _driver.check(drv.cuMemPoolDestroy(pool_entry[0]), "cuMemPoolDestroy(imported pool)")


def _free_imported(drv: Any, ptr: int) -> None:
    """Free an imported pool pointer (its device's context current).
    ``cuMemFree`` would synchronise the whole context, waiting for the user's
    work on every stream; a stream-ordered free on a stream of its own waits
    for nothing else, and is complete on return, as the exporter's own free
    of the allocation must come after every importer's."""
    with _driver.own_stream() as stream:
        _driver.check(drv.cuMemFreeAsync(ptr, stream), "cuMemFreeAsync(imported pool pointer)")


class _PoolUse(_Use):
    """One importer's use of an imported pool allocation (released once),
    which can be granted to more devices."""

    __slots__ = ()

    @property
    def device_id(self) -> int:
        return self.ordinal

    def grant(self, ordinal: int) -> None:
        """Give device ``ordinal`` access too, so a copy on it can touch the memory."""
        drv = _driver.driver()
        with _lock:
            if self.done:
                raise ClosedError("the imported pool memory is closed")
            entry = _imported_ptrs.get(self.key)
            pool_entry = None if entry is None else _imported_pools.get(entry[2])
            if pool_entry is not None:
                _grant_pool(drv, pool_entry, ordinal)


_release = _released(_unuse, "closing a CUDA IPC handle")
_release_pool = _released(_unuse_pool, "freeing imported pool memory")


class CudaIpc(Path):
    """The cuda-ipc path: CUDA memory not from gpushare.allocate (a legacy IPC
    handle, or its stream-ordered pool's export) mapped on this node."""

    name = "cuda-ipc"
    rank = 3
    mapped = True
    holds_memory = False
    reopens = False
    maps_strided = False
    serves = frozenset({OTHER_CUDA})
    device_handle = "cuda-ipc"
    reason = ("same node; CUDA memory not from gpushare.allocate, mapped through CUDA IPC "
              "(a legacy handle, or its pool's export)")

    def offer(self, memory: Memory) -> Offer | None:
        if memory.memory_type != "cuda" or vmm.is_vmm_buffer(memory.obj):
            return None
        try:
            return Offer(export_ipc(memory.obj))
        except GpuShareError:
            return None

    def grant_fds(self, export: Any) -> int:
        return 0

    def serve(self, export: Any, session: Any) -> Grant:
        return Grant(descriptor_payload(export, self.name))

    def not_offered(self, share: Any) -> str | None:
        if share.device != "host" and "posix-fd" not in share.offers:
            return ("not cuda-ipc: not offered; legacy CUDA IPC cannot export memory from a "
                    "stream-ordered pool (cudaMallocAsync, cuda.core Device.allocate) or VMM")
        return None

    def unavailable(self, share: Any, here: Here) -> str | None:
        if not same_node(share, here):
            return "exporter is on another node (or network namespace)"
        if share.readonly:
            return "legacy CUDA IPC maps memory writable only, and this share is read-only"
        return cuda_unavailable(here)

    def open(self, share: Any, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        no_fds(self.name, fds)
        desc = descriptor_of(share, grant, (CudaIpcBufferDescriptor, CudaPoolBufferDescriptor))
        if isinstance(desc, CudaIpcBufferDescriptor):
            return Opened(mapping=Mapped.cuda(map_ipc(desc, how.device, readonly=share.readonly)))
        return Opened(mapping=Mapped.cuda(map_pool(desc, how.device, readonly=share.readonly,
                                                   timeout=how.timeout)))


PATH: Path = CudaIpc()
