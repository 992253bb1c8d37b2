"""A process that runs gpushare's CUDA code against the CUDA driver stand-in.

Started by ``tests/test_cudadriver.py`` with ``LD_LIBRARY_PATH`` naming the
stand-in's ``libcuda.so.1`` (and, per test, ``CUDA_VISIBLE_DEVICES``); the
pytest process itself never loads it.  Each handler is one step of a test;
the raw driver calls here stand in for what CuPy or torch would do, which
need the real CUDA runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from _procs import in_thread


def drv() -> Any:
    from cuda.bindings import driver

    return driver


def ok(result: tuple, what: str) -> Any:
    d = drv()
    err, rest = result[0], result[1:]
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err.name}")
    return rest[0] if len(rest) == 1 else (rest or None)


def setup() -> dict:
    ok(drv().cuInit(0), "cuInit")
    return {"_handlers": HANDLERS, "_reply": {"pid": os.getpid()}, "views": {}, "bufs": {}, "shares": {}}


# -- contexts ------------------------------------------------------------------


def current_device(state: dict) -> int | None:
    """The device of this thread's current context, or None."""
    d = drv()
    ctx = ok(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        return None
    return int(ok(d.cuCtxGetDevice(), "cuCtxGetDevice"))


def make_current(state: dict, ordinal: int) -> None:
    """What CuPy or torch does for ``cuda.set_device(ordinal)``."""
    from cuda.core import Device

    Device(ordinal).set_current()


def uuid_of(state: dict, ordinal: int) -> str:
    from cuda.core import Device

    return str(Device(ordinal).uuid)


def device_count(state: dict) -> int:
    return int(ok(drv().cuDeviceGetCount(), "cuDeviceGetCount"))


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """Push the device's primary context, as a CUDA runtime user has one."""
    d = drv()
    ctx = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(ordinal), "cuDeviceGet")), "cuDevicePrimaryCtxRetain")
    ok(d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        d.cuCtxPopCurrent()


# -- memory --------------------------------------------------------------------


def allocate(state: dict, name: str, size: int, device: int = 0, chunk_size: int | None = None,
             fill: int | None = None) -> int:
    """gs.allocate device memory; optionally fill it (synchronously)."""
    import gpushare as gs

    buf = gs.allocate(size, device=device, chunk_size=chunk_size)
    state["bufs"][name] = buf
    if fill is not None:
        write(state, name, 0, bytes([fill]) * size)
    return int(buf.handle)


def legacy_alloc(state: dict, name: str, size: int, fill: int) -> None:
    """cuMemAlloc memory (as CuPy's and torch's caching allocators get it)."""
    from cuda.core import Buffer, Device

    d = drv()
    dev = Device(0)
    dev.set_current()
    ptr = int(ok(d.cuMemAlloc(size), "cuMemAlloc"))
    ok(d.cuMemsetD8(ptr, fill, size), "cuMemsetD8")
    ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
    state["bufs"][name] = Buffer.from_handle(ptr, size)


def expandable_alloc(state: dict, name: str, chunk: int, count: int, posix: bool = True) -> int:
    """What torch's expandable segments do: one reservation, ``count``
    allocations of ``chunk`` bytes (exportable as POSIX fds where ``posix``)
    mapped back to back into it, readable and writable on device 0; every
    byte set to its offset's low byte.  Returns the reservation's address."""
    from cuda.core import Device

    d = drv()
    Device(0).set_current()
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    t = d.CUmemAllocationHandleType
    prop.requestedHandleTypes = t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if posix else t.CU_MEM_HANDLE_TYPE_NONE
    va = int(ok(d.cuMemAddressReserve(chunk * count, 0, 0, 0), "cuMemAddressReserve"))
    handles = []
    for i in range(count):
        handles.append(ok(d.cuMemCreate(chunk, prop, 0), "cuMemCreate"))
        ok(d.cuMemMap(va + i * chunk, chunk, 0, handles[-1], 0), "cuMemMap")
    access = d.CUmemAccessDesc()
    access.location = prop.location
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(d.cuMemSetAccess(va, chunk * count, [access], 1), "cuMemSetAccess")
    pattern = (np.arange(chunk * count, dtype=np.uint64) & 0xFF).astype(np.uint8)
    ok(d.cuMemcpyHtoD(va, pattern, pattern.nbytes), "cuMemcpyHtoD")
    ok(d.cuCtxSynchronize(), "cuCtxSynchronize")  # from pageable memory the copy may still be under way
    state.setdefault("segments", {})[name] = (va, handles)
    return va


def expandable_tensor(state: dict, name: str, segment: str, offset: int, n: int) -> int:
    """A tensor torch places in an expandable segment: ``n`` bytes at ``offset``."""
    va, _ = state["segments"][segment]
    state["bufs"][name] = _CudaArray(va + offset, n, None)
    return va + offset


def pool_alloc(state: dict, name: str, size: int) -> None:
    """cuda.core's Device.allocate: memory from the device's stream-ordered pool."""
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    buf = dev.allocate(size, stream=stream)
    stream.sync()
    state["bufs"][name] = buf


def ipc_pool_alloc(state: dict, name: str, size: int, offset: int, fill: int) -> None:
    """Memory from an exportable pool (cuda.core's IPC-enabled resource),
    ``offset`` bytes into its allocation, filled synchronously."""
    from cuda.core import Buffer, Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    mr = DeviceMemoryResource(dev, options=DeviceMemoryResourceOptions(ipc_enabled=True, max_size=64 << 20))
    stream = dev.create_stream()
    whole = mr.allocate(size + offset, stream=stream)
    stream.sync()
    state.setdefault("keep", []).append((mr, whole, stream))
    part = Buffer.from_handle(int(whole.handle) + offset, size, owner=whole)
    state["bufs"][name] = part
    write(state, name, 0, bytes([fill]) * size)


def helper_allocate(state: dict, name: str, size: int) -> None:
    """The allocation helper the ``gpu`` tests use."""
    import _rma_gpu_peer

    state["bufs"][name] = _rma_gpu_peer.allocate(size)


def write(state: dict, name: str, offset: int, data: bytes) -> None:
    """Synchronous host-to-device write into a buffer of this process."""
    d = drv()
    buf = state["bufs"][name]
    src = np.frombuffer(data, np.uint8).copy()
    ordinal = buf.memory_resource.device_id if buf.memory_resource is not None else 0
    with on_device(ordinal):
        ok(d.cuMemcpyHtoD(int(buf.handle) + offset, src.ctypes.data, len(src)), "cuMemcpyHtoD")
        ok(d.cuCtxSynchronize(), "cuCtxSynchronize")


def read_ptr(address: int, n: int, ordinal: int = 0) -> bytes:
    d = drv()
    out = np.zeros(n, np.uint8)
    with on_device(ordinal):
        ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
        ok(d.cuMemcpyDtoH(out.ctypes.data, address, n), "cuMemcpyDtoH")
    return out.tobytes()


def read(state: dict, name: str, offset: int, n: int) -> bytes:
    buf = state["bufs"][name]
    ordinal = buf.memory_resource.device_id if buf.memory_resource is not None else 0
    return read_ptr(int(buf.handle) + offset, n, ordinal)


def rdma_flag(state: dict, name: str) -> int:
    """allocFlags.gpuDirectRDMACapable of a buffer's first allocation."""
    d = drv()
    buf = state["bufs"][name]
    handle = ok(d.cuMemRetainAllocationHandle(int(buf.handle)), "cuMemRetainAllocationHandle")
    try:
        prop = ok(d.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
        return int(prop.allocFlags.gpuDirectRDMACapable)
    finally:
        d.cuMemRelease(handle)


def close_buf(state: dict, name: str) -> None:
    state["bufs"].pop(name).close()


# -- same-node API -------------------------------------------------------------


def export_buffer(state: dict, name: str, handle_type: str | None = None) -> Any:
    import gpushare as gs

    return gs.export_buffer(state["bufs"][name], handle_type=handle_type)


def import_buffer(state: dict, name: str, desc: Any, device: int | None = None, readonly: bool = False) -> dict:
    import gpushare as gs

    buf = gs.import_buffer(desc, device=device, readonly=readonly)
    state["bufs"][name] = buf
    return {"device": buf.memory_resource.device_id, "size": buf.size, "current": current_device(state)}


def ipc_handles(state: dict) -> int:
    from gpushare._paths.cuda_ipc import open_handle_count

    return open_handle_count()


def vmm_mappings(state: dict) -> int:
    from gpushare._cuda.vmm import mapping_count

    return mapping_count()


# -- sharing API ---------------------------------------------------------------


def export(state: dict, name: str, kwargs: dict | None = None) -> Any:
    import gpushare as gs

    share = gs.export(state["bufs"][name], **(kwargs or {}))
    state["shares"][name] = share
    return share


def open_view(state: dict, name: str, share: Any, kwargs: dict | None = None) -> dict:
    import warnings

    import gpushare as gs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        view = gs.open(share, **(kwargs or {}))
    state["views"][name] = view
    return {"path": view.path, "why": view.why, "device": view.device, "current": current_device(state),
            "dlpack_device": view.__dlpack_device__(),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def view_get(state: dict, name: str, offset: int, n: int, where: str = "here") -> bytes:
    """view.get into pageable host memory, in this thread, a new thread, or asyncio."""
    view = state["views"][name]
    out = bytearray(n)
    if where == "here":
        view.get(out, offset)
    elif where == "thread":
        in_thread(lambda: view.get(out, offset))
    else:
        asyncio.run(view.get_async(out, offset, timeout=30))
    return bytes(out)


def view_put(state: dict, name: str, offset: int, data: bytes, where: str = "here") -> None:
    view = state["views"][name]
    if where == "here":
        view.put(data, offset)
    elif where == "thread":
        in_thread(lambda: view.put(data, offset))
    else:
        asyncio.run(view.put_async(data, offset, timeout=30))


class _CudaArray:
    """A device array as CuPy or torch presents one: a pointer, a shape and
    the stream its pending work is on (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, n: int, stream: int | None) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": stream}


def put_from_stream(state: dict, name: str, value: int, n: int, mode: str) -> None:
    """Fill a device buffer with an asynchronous memset on a non-default
    stream, then put it into the view without synchronising: the put must
    come after the memset (``mode``: the stream passed as ``stream=``, or
    named by the array interface)."""
    from cuda.core import Device

    d = drv()
    view = state["views"][name]
    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    src = dev.allocate(n, stream=s)
    ok(d.cuMemsetD8Async(int(src.handle), value, n, int(s.handle)), "cuMemsetD8Async")
    if mode == "stream":
        view.put(src, 0, stream=s)
    else:
        view.put(_CudaArray(int(src.handle), n, int(s.handle)), 0)
    state.setdefault("keep", []).append((src, s))


def get_to_device(state: dict, name: str, n: int) -> bytes:
    """view.get into device memory on a non-default stream, then read it back."""
    from cuda.core import Device

    view = state["views"][name]
    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    dst = dev.allocate(n, stream=s)
    view.get(dst, 0, stream=s)
    out = read_ptr(int(dst.handle), n, 0)
    state.setdefault("keep", []).append((dst, s))
    return out


def take_dlpack(state: dict, name: str) -> dict:
    """What a consumer (CuPy, torch) does with __dlpack__: keeps the tensor."""
    from cuda.core.utils import StridedMemoryView

    view = state["views"][name]
    smv = StridedMemoryView(view, stream_ptr=-1)
    state.setdefault("consumers", []).append(smv)
    return {"ptr": int(smv.ptr), "readonly": bool(smv.readonly), "device": int(smv.device_id),
            "shape": tuple(smv.shape)}


def take_cai(state: dict, name: str) -> dict:
    """What CuPy's asarray does with __cuda_array_interface__: keeps the view."""
    view = state["views"][name]
    cai = view.__cuda_array_interface__
    state.setdefault("consumers", []).append(view)
    return {"ptr": int(cai["data"][0]), "readonly": bool(cai["data"][1])}


def drop_consumers(state: dict) -> None:
    import gc

    state.pop("consumers", None)
    gc.collect()


def read_at(state: dict, address: int, n: int, ordinal: int = 0) -> bytes:
    return read_ptr(address, n, ordinal)


def write_at(state: dict, address: int, data: bytes, ordinal: int = 0) -> str:
    """A synchronous write to a device address; returns the driver's answer."""
    d = drv()
    src = np.frombuffer(data, np.uint8).copy()
    with on_device(ordinal):
        (err,) = d.cuMemcpyHtoD(address, src.ctypes.data, len(src))
        if err == d.CUresult.CUDA_SUCCESS:
            (err,) = d.cuCtxSynchronize()
        return err.name


def access_flags(state: dict, name: str, ordinal: int) -> str:
    """cuMemGetAccess of a view's mapping for a device."""
    d = drv()
    view = state["views"][name]
    loc = d.CUmemLocation()
    loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    flags = ok(d.cuMemGetAccess(loc, view._mapped.address), "cuMemGetAccess")
    return d.CUmemAccess_flags(int(flags)).name


def close_view(state: dict, name: str, where: str = "here") -> None:
    view = state["views"].pop(name)
    if where == "here":
        view.close()
    elif where == "thread":
        in_thread(view.close)
    else:  # the garbage collector, in a thread with no context current
        import gc

        del view
        in_thread(gc.collect)


def view_closed(state: dict, name: str) -> bool:
    return state["views"][name].closed


def imex_channel(state: dict, directory: str) -> None:
    """An IMEX channel this process can open, as a node with IMEX has one
    (the stand-in's fabric handles need no more than that)."""
    from gpushare._cuda import fabric

    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, "channel0"), "a").close()  # noqa: SIM115 - just the file
    fabric.IMEX_CHANNELS = directory


def capabilities(state: dict) -> dict:
    import gpushare as gs

    return gs.capabilities()


def ucx_transports(state: dict) -> list[str]:
    """The transports of this process's UCX worker (the region server's)."""
    from gpushare._ucx._node import node_config

    return node_config()["TLS"].split(",")


# -- typed arrays and channels ------------------------------------------------------


def _described(arr: Any) -> dict:
    cai = arr.__cuda_array_interface__
    return {"type": type(arr).__name__, "shape": tuple(cai["shape"]), "typestr": cai["typestr"],
            "readonly": bool(cai["data"][1]), "ptr": int(cai["data"][0]), "dlpack": arr.__dlpack_device__()}


def new_array(state: dict, name: str, shape: tuple, dtype: str, zeros: bool, fill: int | None = None) -> dict:
    """gs.zeros or gs.empty on device 0; optionally fill its bytes (an int:
    every byte; bytes: the whole array)."""
    import gpushare as gs

    arr = (gs.zeros if zeros else gs.empty)(shape, dtype, device=0)
    state["bufs"][name] = arr
    if isinstance(fill, bytes):
        write_at(state, arr.ptr, fill)
    elif fill is not None:
        with on_device(0):
            ok(drv().cuMemsetD8(arr.ptr, fill, arr.nbytes), "cuMemsetD8")
            ok(drv().cuCtxSynchronize(), "cuCtxSynchronize")
    out = _described(arr)
    out["bytes"] = read_ptr(arr.ptr, arr.nbytes)
    return out


class _CaiSlice:
    """Part of a CUDA array (or of a gs.allocate buffer), as CuPy or torch
    would hand it over: only ``__cuda_array_interface__``, holding the
    memory it is part of."""

    def __init__(self, base: Any, byte_offset: int, shape: tuple, typestr: str) -> None:
        self.base = base
        ptr = base.ptr if hasattr(base, "ptr") else int(base.handle)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": None, "version": 3,
                                         "data": (ptr + byte_offset, False), "stream": None}


def slice_array(state: dict, name: str, of: str, byte_offset: int, shape: tuple, typestr: str) -> dict:
    """A view of part of array ``of`` (by byte offset), kept as ``name``."""
    part = state["bufs"][name] = _CaiSlice(state["bufs"][of], byte_offset, shape, typestr)
    cai = part.__cuda_array_interface__
    return {"shape": cai["shape"], "typestr": cai["typestr"], "ptr": cai["data"][0]}


def view_array(state: dict, name: str) -> dict:
    """What CuPy sees of a view: __cuda_array_interface__, and DLPack's dtype."""
    from gpushare import _dlpack

    view = state["views"][name]
    out = _described(view)
    tensor = _dlpack.borrow(view, stream=-1)
    out["dl"] = (tensor.dtype, tensor.shape, tensor.readonly)
    out["bytes"] = read_ptr(out["ptr"], view.nbytes)
    del tensor
    return out


def mp_dumps(state: dict, names: list[str]) -> bytes:
    """A message of the named buffers and arrays as a gpushare.multiprocessing
    Queue carries it (``ForkingPickler.dumps`` with the reducers registered)."""
    import importlib
    from multiprocessing.reduction import ForkingPickler

    importlib.import_module("gpushare.multiprocessing")  # registers the reducers
    return bytes(ForkingPickler.dumps({name: state["bufs"][name] for name in names}))


def mp_loads(state: dict, data: bytes) -> dict:
    """Unpickle a message as the other end of the Queue does (which imports
    gpushare.multiprocessing by itself); keep what came and say what it is."""
    import pickle

    got = pickle.loads(data)
    out = {}
    for name, obj in got.items():
        state["bufs"][name] = obj
        ptr = int(obj.handle) if hasattr(obj, "handle") else obj.ptr
        size = int(obj.size) if hasattr(obj, "handle") else obj.nbytes
        out[name] = {"type": f"{type(obj).__module__.split('.')[0]}.{type(obj).__name__}", "ptr": ptr,
                     "bytes": read_ptr(ptr, size)}
    return out


def mp_outstanding(state: dict) -> int:
    """Bundles this process sent that a receiver still holds."""
    import gc
    import sys

    gc.collect()
    return sys.modules["gpushare.multiprocessing"].outstanding()


def drop_buf(state: dict, name: str) -> None:
    """Let go of what a message brought (the lease ends once it is collected)."""
    import gc

    obj = state["bufs"].pop(name)
    if hasattr(obj, "close"):
        obj.close()
    del obj
    gc.collect()


def channel_create(state: dict, shape: tuple, dtype: str, slots: int) -> Any:
    import gpushare as gs

    state["producer"] = gs.channel(shape, dtype, consumers=1, slots=slots, device=0)
    return state["producer"].handle


def channel_send(state: dict, fill: int) -> int:
    """Acquire a CUDA slot, fill it on the device, publish."""
    producer = state["producer"]
    arr = producer.acquire(timeout=30)
    with on_device(0):
        ok(drv().cuMemsetD8(arr.ptr, fill, arr.nbytes), "cuMemsetD8")
        ok(drv().cuCtxSynchronize(), "cuCtxSynchronize")  # written before it is published
    return producer.publish()


def channel_close(state: dict) -> None:
    state.pop("producer").close(timeout=30)


def channel_join(state: dict, handle: Any) -> dict:
    import gpushare as gs

    state["consumer"] = gs.subscribe(handle, timeout=30)
    return {"paths": state["consumer"].paths, "zero_copy": state["consumer"].zero_copy}


def channel_wait(state: dict) -> dict:
    import gpushare as gs

    try:
        with state["consumer"].wait(timeout=30) as step:
            out = _described(step.array)
            out["step"] = step.step
            out["bytes"] = read_ptr(step.array.ptr, step.array.nbytes)
            return out
    except gs.ClosedError as exc:
        state.pop("consumer").close()
        return {"closed": str(exc)}


HANDLERS = {name: fn for name, fn in globals().items()
            if callable(fn) and not name.startswith("_") and name not in ("drv", "ok", "setup", "read_ptr", "on_device", "in_thread")
            and getattr(fn, "__module__", None) == __name__}
