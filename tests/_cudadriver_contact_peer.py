"""More steps for processes on the CUDA driver stand-in, used by
``tests/test_cudadriver_contact.py``: every handler of
``tests/_cudadriver_peer.py`` plus the ones below.  The raw driver calls
stand in for what torch, CuPy or a user's own kernels would queue.
"""

from __future__ import annotations

import os
from typing import Any

import _cudadriver_peer as base
import numpy as np
from _cudadriver_peer import drv, ok


def setup() -> dict:
    state = base.setup()
    state["_handlers"] = {**base.HANDLERS, **HANDLERS}
    return state


def _nonblocking_stream() -> Any:
    d = drv()
    return ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")


def _read_on_own_stream(ptr: int, n: int) -> bytes:
    """Read device memory through a fresh non-blocking stream, so that no
    other stream's pending work runs (the stand-in runs queued work only at
    synchronisation points); the caller's context is current."""
    d = drv()
    s = _nonblocking_stream()
    out = np.zeros(n, np.uint8)
    try:
        ok(d.cuMemcpyDtoHAsync(out.ctypes.data, ptr, n, s), "cuMemcpyDtoHAsync")
        ok(d.cuStreamSynchronize(s), "cuStreamSynchronize")
    finally:
        d.cuStreamDestroy(s)
    return out.tobytes()


class TorchLikeTensor:
    """A CUDA tensor as torch presents one: ``__cuda_array_interface__``
    version 2 (no stream) and DLPack, whose ``__dlpack__(stream=s)`` makes
    ``s`` wait for the work on the tensor's current stream, as torch's does."""

    def __init__(self, ptr: int, n: int, device: int, current_stream: Any) -> None:
        self.ptr, self.n, self.device, self.current = ptr, n, device, current_stream
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        from gpushare import _dlpack

        d = drv()
        if stream is not None and stream != -1:
            event = ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            ok(d.cuEventRecord(event, self.current), "cuEventRecord")
            ok(d.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")
            d.cuEventDestroy(event)
        return _dlpack.capsule(self.ptr, (self.n,), "|u1", (2, self.device), readonly=False, owner=self,
                               max_version=max_version)


def put_torch_like(state: dict, name: str, value: int, n: int) -> dict:
    """Fill a tensor with a memset queued on its (non-blocking) current
    stream, then ``view.put`` it with no stream: the put must come after the
    memset.  Also reports how gpushare resolved the tensor."""
    from cuda.core import Device

    from gpushare import _buffers

    d = drv()
    view = state["views"][name]
    Device(0).set_current()
    current = _nonblocking_stream()
    ptr = int(ok(d.cuMemAlloc(n), "cuMemAlloc"))
    ok(d.cuMemsetD8Async(ptr, value, n, current), "cuMemsetD8Async")
    tensor = TorchLikeTensor(ptr, n, 0, current)
    lb = _buffers.resolve(tensor, writable=False, stream=1)
    resolved = {"memory_type": lb.memory_type, "device": lb.device, "address": lb.address, "nbytes": lb.nbytes}
    lb.release()
    view.put(tensor, 0)
    state.setdefault("keep", []).append((tensor, current))
    return resolved


def close_with_copy_in_flight(state: dict, name: str, data: bytes, unrelated: int, drop: bool = False) -> dict:
    """Queue unrelated work (a memset on a stream of its own into memory of
    its own) and a put into the view on another stream, close the view with
    the put still queued (its request dropped first, if ``drop``), then look
    whether the unrelated work ran."""
    import gc

    from cuda.core import Device

    d = drv()
    view = state["views"][name]
    n = 4096
    Device(view.device).set_current()
    scratch = int(ok(d.cuMemAlloc(n), "cuMemAlloc"))
    ok(d.cuMemsetD8(scratch, 0, n), "cuMemsetD8")
    ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
    user_stream = _nonblocking_stream()
    ok(d.cuMemsetD8Async(scratch, unrelated, n, user_stream), "cuMemsetD8Async")
    copy_stream = _nonblocking_stream()
    src = np.frombuffer(data, np.uint8).copy()
    # What a put_async given up on, or a put past its timeout, leaves: the
    # copy queued.  (Not queried: on the stand-in a query runs the work.)
    request = view._copy(src, 0, "put", copy_stream)
    if drop:
        del request, src
        gc.collect()
        request = None
    view.close()
    before = _read_on_own_stream(scratch, n)
    ok(d.cuStreamSynchronize(user_stream), "cuStreamSynchronize(the unrelated stream)")
    after = _read_on_own_stream(scratch, n)
    out = {"unrelated_at_close": before[:8], "unrelated_later": after[:8],
           "request_done": True if request is None else request.done()}
    if drop:  # the dropped request's copy, complete since the close, goes at the next copy's look
        from gpushare._cuda import _copies

        _copies._retire_orphans()
        out["inflight_after"] = _copies.inflight_copies()
    for s in (user_stream, copy_stream):
        d.cuStreamDestroy(s)
    d.cuMemFree(scratch)
    return out


def zeros_beside_pending_work(state: dict, n: int, unrelated: int) -> dict:
    """gs.zeros on device 0 while unrelated memsets are queued on a blocking
    and a non-blocking stream of the user's: the zeros are there on return,
    and the unrelated work has not run."""
    from cuda.core import Device

    import gpushare as gs

    d = drv()
    Device(0).set_current()
    scratch = int(ok(d.cuMemAlloc(2 * 4096), "cuMemAlloc"))
    ok(d.cuMemsetD8(scratch, 0, 2 * 4096), "cuMemsetD8")
    ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
    blocking = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_DEFAULT), "cuStreamCreate")
    nonblocking = _nonblocking_stream()
    ok(d.cuMemsetD8Async(scratch, unrelated, 4096, blocking), "cuMemsetD8Async")
    ok(d.cuMemsetD8Async(scratch + 4096, unrelated, 4096, nonblocking), "cuMemsetD8Async")
    arr = gs.zeros((n,), "uint8", device=0)
    out = {"zeros": _read_on_own_stream(arr.ptr, n) == b"\0" * n,
           "unrelated_at_return": _read_on_own_stream(scratch, 8) + _read_on_own_stream(scratch + 4096, 8)}
    ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
    out["unrelated_later"] = _read_on_own_stream(scratch, 8) + _read_on_own_stream(scratch + 4096, 8)
    for s in (blocking, nonblocking):
        d.cuStreamDestroy(s)
    d.cuMemFree(scratch)
    state["bufs"]["zeros"] = arr
    return out


def put_from_device(state: dict, name: str, ordinal: int, data: bytes) -> None:
    """view.put from memory of device ``ordinal`` on a stream of that device:
    the copy runs there, whatever device the view is mapped on."""
    from cuda.core import Device

    d = drv()
    view = state["views"][name]
    dev = Device(ordinal)
    dev.set_current()
    stream = dev.create_stream()
    src = dev.allocate(len(data), stream=stream)
    host = np.frombuffer(data, np.uint8).copy()
    ok(d.cuMemcpyHtoDAsync(int(src.handle), host.ctypes.data, len(data), int(stream.handle)), "cuMemcpyHtoDAsync")
    view.put(src, 0, stream=stream)
    state.setdefault("keep", []).append((src, stream, host))


def primary_active(state: dict, ordinal: int) -> int:
    """Whether device ``ordinal``'s primary context is retained in this process."""
    d = drv()
    dev = ok(d.cuDeviceGet(ordinal), "cuDeviceGet")
    _, active = ok(d.cuDevicePrimaryCtxGetState(dev), "cuDevicePrimaryCtxGetState")
    return int(active)


def pool_access(state: dict, name: str, ordinal: int) -> str:
    """cuMemPoolGetAccess, for device ``ordinal``, of the pool that a
    buffer of this process (imported pool memory) comes from."""
    d = drv()
    buf = state["bufs"][name]
    attr = d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE
    pool = ok(d.cuPointerGetAttribute(attr, int(buf.handle)), "cuPointerGetAttribute(MEMPOOL_HANDLE)")
    loc = d.CUmemLocation()
    loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    flags = ok(d.cuMemPoolGetAccess(pool, loc), "cuMemPoolGetAccess")
    return d.CUmemAccess_flags(int(flags)).name


def capabilities_with(state: dict, directory: str, entries: list[str]) -> dict:
    """gs.capabilities() with the IMEX channel directory at ``directory``
    holding ``entries`` (empty files; none: the directory does not exist)."""
    import gpushare as gs
    from gpushare._cuda import fabric

    if entries:
        os.makedirs(directory, exist_ok=True)
        for e in entries:
            open(os.path.join(directory, e), "a").close()  # noqa: SIM115 - just the file
    fabric.IMEX_CHANNELS = directory
    return gs.capabilities()


HANDLERS = {name: fn for name, fn in globals().items()
            if callable(fn) and not name.startswith("_") and name not in ("drv", "ok", "setup")
            and getattr(fn, "__module__", None) == __name__ and not isinstance(fn, type)}
