"""Device bytes for the ``gpu`` tests, and the other process of
``tests/test_gpu_paths.py`` and ``tests/test_gpu_kernels.py``.

Device memory is not CPU-accessible: bytes go in and out with driver copies
under the device's pushed primary context, synchronised, and nothing here
reads a device pointer with the CPU.  No helper leaves a context current.
The peer serves the commands of ``tests/_share_peer.py`` and the GPU ones
below.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import _cudadriver_peer
import _share_peer


def htod(address: int, data: Any, device: int = 0) -> None:
    """Copy host bytes to device memory of ``device``; landed on return."""
    from gpushare._cuda import _driver as _cuda

    src = np.frombuffer(bytes(data), np.uint8) if not isinstance(data, np.ndarray) else data
    drv = _cuda.driver()
    with _cuda.on_device(device):  # gpushare leaves no context current: push one
        _cuda.check(drv.cuMemcpyHtoD(int(address), src.ctypes.data, src.nbytes), "cuMemcpyHtoD")
        # A pageable source is only staged when the call returns.
        _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")


def dtoh(address: int, n: int, device: int = 0) -> bytes:
    """The ``n`` bytes at a device pointer of ``device``, after the device's earlier work."""
    from gpushare._cuda import _driver as _cuda

    out = np.empty(n, np.uint8)
    drv = _cuda.driver()
    with _cuda.on_device(device):
        _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        _cuda.check(drv.cuMemcpyDtoH(out.ctypes.data, int(address), n), "cuMemcpyDtoH")
    return out.tobytes()


def memset(address: int, value: int, n: int, device: int = 0) -> None:
    """Set ``n`` bytes of device memory to ``value``; landed on return."""
    from gpushare._cuda import _driver as _cuda

    drv = _cuda.driver()
    with _cuda.on_device(device):
        _cuda.check(drv.cuMemsetD8(int(address), value, n), "cuMemsetD8")
        _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")


def current_context() -> int | None:
    """The calling thread's current context handle, or None."""
    from gpushare._cuda import _driver as _cuda

    drv = _cuda.driver()
    ctx = _cuda.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    return None if ctx is None or int(ctx) == 0 else int(ctx)


def pattern(n: int, seed: int = 1) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class DeviceArray:
    """Device memory as CuPy or torch hand it over: a pointer, a size and the
    stream its pending work is on (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, n: int, owner: Any = None, stream: int | None = None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (int(ptr), False),
                                         "version": 3, "strides": None, "stream": stream}


def legacy_alloc(n: int, device: int = 0) -> DeviceArray:
    """``cuMemAlloc`` memory (what CuPy's and torch's allocators get), freed
    when the returned array is collected."""
    import weakref

    from gpushare._cuda import _driver as _cuda

    drv = _cuda.driver()
    with _cuda.on_device(device):
        ptr = int(_cuda.check(drv.cuMemAlloc(n), "cuMemAlloc"))
    arr = DeviceArray(ptr, n)

    def free() -> None:
        with _cuda.on_device(device):
            drv.cuMemFree(ptr)

    weakref.finalize(arr, free)
    return arr


# ------------------------------------------------------------------ the peer


def setup() -> dict:
    state = _share_peer.setup()
    state["_handlers"] = HANDLERS
    state["_reply"]["context"] = None  # set by the commands that touch CUDA
    return state


def _context(state: dict) -> int | None:
    return current_context()


def _visible(state: dict) -> dict:
    """What this process sees: its devices' UUIDs, in ordinal order."""
    from gpushare._cuda import _driver as _cuda

    return {"uuids": [_cuda.device_uuid(i) for i in range(_cuda.device_count())],
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _view_device(state: dict, name: str) -> Any:
    return state["views"][name].device


def _get_into_device(state: dict, name: str, offset: int, n: int) -> bytes:
    """view.get into device memory of gpushare's (device to device), read back."""
    import gpushare as gs

    dst = gs.allocate(n, device=0)
    try:
        state["views"][name].get(dst, offset)
        return dtoh(int(dst.handle), n)
    finally:
        dst.close()


def _put_from_device(state: dict, name: str, offset: int, data: bytes) -> None:
    import gpushare as gs

    src = gs.allocate(len(data), device=0)
    try:
        htod(int(src.handle), data)
        state["views"][name].put(src, offset)
    finally:
        src.close()


def _async_on_stream(state: dict, name: str, n: int, seed: int) -> dict:
    """put_async from, then get_async into, device memory on a cuda.core
    stream, with no synchronisation of the stream by this code in between:
    the put's source is filled by a copy queued on the stream, and the get's
    bytes are read by a copy queued on it afterwards."""
    from _procs import in_thread

    return in_thread(lambda: _async_in_thread(state["views"][name], n, seed))


def _async_in_thread(view: Any, n: int, seed: int) -> dict:
    import asyncio

    from cuda.core import Device, StreamOptions

    import gpushare as gs
    from gpushare._cuda import _driver as _cuda

    data = np.frombuffer(pattern(n, seed), np.uint8).copy()
    back = np.zeros(n, np.uint8)
    dev = Device(0)
    # cuda.core streams need a current device, as user code sets it; in a
    # thread of its own, so the peer's other commands run with none.
    dev.set_current()
    stream = dev.create_stream(options=StreamOptions(nonblocking=True))
    src, dst = gs.allocate(n, device=0), gs.allocate(n, device=0)
    drv = _cuda.driver()
    h = int(stream.handle)
    try:
        # Queued, not landed: the put must come after it on the stream.
        _cuda.check(drv.cuMemcpyHtoDAsync(int(src.handle), data.ctypes.data, n, h), "cuMemcpyHtoDAsync")

        async def run() -> None:
            await view.put_async(src, stream=stream, timeout=60)
            await view.get_async(dst, stream=stream, timeout=60)

        asyncio.run(run())
        _cuda.check(drv.cuMemcpyDtoHAsync(back.ctypes.data, int(dst.handle), n, h), "cuMemcpyDtoHAsync")
        stream.sync()
        return {"put": data.tobytes() == back.tobytes(), "got": back.tobytes()}
    finally:
        stream.sync()
        src.close()
        dst.close()
        stream.close()


def _export_legacy(state: dict, n: int, fill: int, kwargs: dict | None = None) -> Any:
    """cuMemAlloc memory filled with ``fill``, exported; kept while this process lives."""
    import gpushare as gs

    arr = legacy_alloc(n)
    memset(arr.__cuda_array_interface__["data"][0], fill, n)
    state.setdefault("exported", []).append(arr)
    return gs.export(arr, **(kwargs or {}))


def _export_legacy_desc(state: dict, n: int, fill: int) -> Any:
    """The same, as a buffer descriptor (gs.export_buffer)."""
    import gpushare as gs

    arr = legacy_alloc(n)
    memset(arr.__cuda_array_interface__["data"][0], fill, n)
    state.setdefault("exported", []).append(arr)
    return gs.export_buffer(arr)


def _ucx_cuda_alloc(state: dict, n: int) -> dict:
    """gpushare.ucx allocates ``n`` bytes of CUDA memory (this process having
    made no context current); what it got, and whether bytes go in and out."""
    from cuda.bindings import driver as drv

    from gpushare import ucx
    from gpushare._cuda import _driver as _cuda

    before = current_context()
    agent = ucx.Agent()
    try:
        with agent.create_memory_handle(n, memory_type="cuda") as mh:
            after = current_context()
            _cuda.driver()
            kind = _cuda.check(drv.cuPointerGetAttribute(
                drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, mh.base_address), "MEMORY_TYPE")
            data = pattern(n, 2)
            htod(mh.base_address, data)
            ok = dtoh(mh.base_address, n) == data
            return {"before": before, "after": after, "memory_type": mh.memory_type, "size": mh.size,
                    "pointer_type": drv.CUmemorytype(int(kind)).name, "bytes_ok": ok}
    finally:
        agent.close()


def _export_pool(state: dict, n: int, offset: int, fill: int) -> Any:
    """``n`` bytes ``offset`` into an allocation of an exportable pool
    (cuda.core's DeviceMemoryResource with ipc_enabled=True), filled with
    ``fill``, exported; the pool is made in a thread of its own, so this
    process's main thread keeps no current context."""
    from _procs import in_thread

    import gpushare as gs

    state.setdefault("bufs", {})
    in_thread(lambda: _cudadriver_peer.ipc_pool_alloc(state, "pool", n, offset, fill))
    part = state["bufs"].pop("pool")
    state.setdefault("exported", []).append(part)
    share = gs.export(part, lifetime="revoked")
    state.setdefault("shares", []).append(share)
    return share


def _pointer(obj: Any) -> int:
    cai = getattr(obj, "__cuda_array_interface__", None)
    return int(cai["data"][0]) if cai is not None else int(obj.handle)


def _read_exported(state: dict, index: int, offset: int, n: int) -> bytes:
    return dtoh(_pointer(state["exported"][index]) + offset, n)


def _revoke_exported(state: dict, index: int) -> None:
    state["shares"][index].revoke()


def _import_read(state: dict, name: str, desc: Any, n: int) -> bytes:
    """Import a buffer descriptor (kept as ``name``); its first ``n`` bytes."""
    import gpushare as gs

    buf = gs.import_buffer(desc)
    state.setdefault("bufs", {})[name] = buf
    return dtoh(int(buf.handle), n, buf.device_id)


def _read_buf(state: dict, name: str, n: int) -> bytes:
    buf = state["bufs"][name]
    return dtoh(int(buf.handle), n, buf.device_id)


def _close_buf(state: dict, name: str) -> None:
    state["bufs"].pop(name).close()


def _import_error(state: dict, desc: Any) -> str:
    """What importing ``desc`` raises (its type and message), or "imported"."""
    import gpushare as gs

    try:
        gs.import_buffer(desc).close()
    except gs.GpuShareError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "imported"


def _open_error(state: dict, share: Any, timeout: float) -> str:
    import gpushare as gs

    try:
        gs.open(share, timeout=timeout).close()
    except gs.GpuShareError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "opened"


# -- kernels (CuPy, torch): only where a real CUDA runtime runs them ---------------


_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


def _busy(cupy: Any, stream: Any, seconds: float = 0.2) -> None:
    """Queue a kernel that keeps ``stream`` busy for about ``seconds`` (the
    GPU's global nanosecond timer): work queued after it runs that much later."""
    kernel = cupy.RawKernel(_SPIN, "spin")
    with stream:
        kernel((1,), (1,), (np.uint64(int(seconds * 1e9)),))


def _rma_stream_put(state: dict, name: str, n: int, value: int) -> None:
    """A kernel fills a CuPy array on a non-blocking stream behind a busy
    kernel; view.put of it, ordered by the array's own stream (its
    ``__cuda_array_interface__``), with nothing synchronised first."""
    import cupy

    view = state["views"][name]
    s = cupy.cuda.Stream(non_blocking=True)
    _busy(cupy, s)
    with s:
        src = cupy.full(n, value, dtype=cupy.uint8)  # queued on s, behind the spin
        view.put(src)  # the array's stream (named by its interface) orders the put
    s.synchronize()


def _rma_stream_get(state: dict, name: str, n: int) -> dict:
    """view.get into a CuPy array on a non-blocking stream whose earlier
    kernel writes the array (the get must come after it), then a kernel on
    that stream reads what the get brought (it must come after the get)."""
    import cupy

    view = state["views"][name]
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        dst = cupy.empty(n, dtype=cupy.uint8)
        _busy(cupy, s)
        dst.fill(0x5A)  # queued behind the spin; the get must land after it
        view.get(dst, stream=s)
        total = dst.sum(dtype=cupy.uint64)  # queued on s: must see the get's bytes
        first = dst[:16].copy()
    s.synchronize()
    return {"sum": int(total), "first": cupy.asnumpy(first).tobytes()}


def _cupy_sum(state: dict, name: str) -> int:
    import cupy

    a = cupy.asarray(state["views"][name]).reshape(-1).view(cupy.uint8)
    total = int(a.sum(dtype=cupy.uint64))
    del a
    return total


def _cupy_write_fault(state: dict, name: str) -> str:
    """A CuPy kernel writes a read-only mapped view (through its pointer, as
    any CUDA code could): what the CUDA runtime reports.  The context is
    then unusable, as a GPU leaves it: run this only in a throwaway process."""
    import cupy

    view = state["views"][name]
    ptr, readonly = view.__cuda_array_interface__["data"]
    mem = cupy.cuda.UnownedMemory(ptr, view.nbytes, view, 0)
    a = cupy.ndarray((view.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    try:
        a.fill(1)
        cupy.cuda.runtime.deviceSynchronize()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"readonly={readonly}: {exc}"
    return f"readonly={readonly}: the write completed"


def _dlpack_into_torch_and_cupy(state: dict) -> dict:
    """A gs.empty CUDA array into torch and CuPy through DLPack: torch
    writes, CuPy reads and writes, torch reads; the array is then exported
    (kept while this process lives).  In a peer, so that the test process
    keeps no current context from torch or CuPy."""
    import cupy
    import torch

    import gpushare as gs

    a = gs.empty((8, 256), "int32", device=0)
    t = torch.from_dlpack(a)
    out: dict = {"torch": (tuple(t.shape), str(t.dtype), t.device.type)}
    t.fill_(3)
    t[1, 5] = 1000
    c = cupy.from_dlpack(a)
    out["cupy"] = (tuple(c.shape), str(c.dtype))
    out["same_memory"] = t.data_ptr() == c.data.ptr == a.ptr
    out["cupy_sum"] = int(c.sum())  # CuPy's kernel after torch's, on the legacy stream
    c[0, 0] = 5
    cupy.cuda.runtime.deviceSynchronize()
    out["torch_reads"] = int(t[0, 0])
    out["share"] = gs.export(a, lifetime="revoked")
    state.setdefault("exported", []).append((a, t, c))
    return out


def _torch_export_expandable(state: dict, n: int, value: int) -> Any:
    """A torch CUDA tensor from the caching allocator's expandable segments
    (PYTORCH_CUDA_ALLOC_CONF is set in this process's environment before
    torch loads), exported."""
    import torch

    import gpushare as gs

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" not in conf:
        raise RuntimeError(f"PYTORCH_CUDA_ALLOC_CONF={conf!r}: expandable segments are not on")
    t = torch.full((n,), value, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    state.setdefault("exported", []).append(t)
    return gs.export(t, lifetime="revoked")


def _torch_busy_read_then_close(state: dict, name: str) -> dict:
    """torch takes the view through DLPack; a kernel that keeps the stream
    busy, then a sum over the memory, are queued; the tensor is dropped and
    the view closed (unmapped) with both still queued.  The sum must come
    out, the context sound."""
    import torch

    view = state["views"].pop(name)
    t = torch.from_dlpack(view)
    torch.cuda._sleep(int(5e8))  # about 0.3 s on an H200
    total = t.to(torch.int64).sum()
    del t
    view.close()
    del view
    return {"sum": int(total.item())}


def _torch_export_with_pending_fill(state: dict, n: int, value: int) -> Any:
    """A torch CUDA tensor whose fill is queued behind a kernel that keeps
    the stream busy, exported at once: no synchronisation of the caller's."""
    import torch

    import gpushare as gs

    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))
    t.fill_(value)
    share = gs.export(t, lifetime="revoked")
    state.setdefault("exported", []).append(t)
    return share


HANDLERS = dict(_share_peer.HANDLERS)
HANDLERS.update({
    "torch_busy_read_then_close": _torch_busy_read_then_close,
    "torch_export_with_pending_fill": _torch_export_with_pending_fill,
    "context": _context,
    "visible": _visible,
    "view_device": _view_device,
    "get_into_device": _get_into_device,
    "put_from_device": _put_from_device,
    "async_on_stream": _async_on_stream,
    "export_legacy": _export_legacy,
    "export_legacy_desc": _export_legacy_desc,
    "ucx_cuda_alloc": _ucx_cuda_alloc,
    "export_pool": _export_pool,
    "read_exported": _read_exported,
    "revoke_exported": _revoke_exported,
    "import_read": _import_read,
    "read_buf": _read_buf,
    "close_buf": _close_buf,
    "import_error": _import_error,
    "open_error": _open_error,
    "channel_join": _cudadriver_peer.channel_join,  # driver copies only: as on the stand-in
    "channel_wait": _cudadriver_peer.channel_wait,
    "rma_stream_put": _rma_stream_put,
    "rma_stream_get": _rma_stream_get,
    "cupy_sum": _cupy_sum,
    "cupy_write_fault": _cupy_write_fault,
    "dlpack_into_torch_and_cupy": _dlpack_into_torch_and_cupy,
    "torch_export_expandable": _torch_export_expandable,
})
