"""Steps for tests/test_cudadriver_order.py, in processes on the CUDA driver
stand-in: every handler of ``tests/_cudadriver_peer.py`` plus the ones
below, which leave work queued (on the stand-in, queued work runs only when
something synchronises: what gpushare does not wait for shows)."""

from __future__ import annotations

import gc
from typing import Any

import _cudadriver_peer as base
from _cudadriver_peer import drv, ok, read_ptr


def setup() -> dict:
    state = base.setup()
    state["_handlers"] = {**base.HANDLERS, **HANDLERS}
    return state


class _TorchLike:
    """A tensor as torch presents one: ``__cuda_array_interface__`` version 2
    (no stream), and DLPack, which orders the work queued on its current
    stream before the stream the consumer names."""

    def __init__(self, ptr: int, n: int, stream: int) -> None:
        self._ptr, self._n, self._stream = ptr, n, stream
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, **_: Any) -> Any:
        from gpushare import _dlpack

        d = drv()
        if stream is not None and stream != -1 and stream != self._stream:
            event = ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            ok(d.cuEventRecord(event, self._stream), "cuEventRecord")
            ok(d.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")
            ok(d.cuEventDestroy(event), "cuEventDestroy")
        return _dlpack.capsule(self._ptr, (self._n,), "|u1", (2, 0), readonly=False, owner=self,
                               max_version=max_version)


def _stream(kind: str) -> int:
    """A stream of the user's: the legacy default stream (0), a blocking
    stream, or a non-blocking one."""
    d = drv()
    if kind == "legacy":
        return 0
    flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING if kind == "non-blocking" else d.CUstream_flags.CU_STREAM_DEFAULT
    return int(ok(d.cuStreamCreate(flags), "cuStreamCreate"))


def export_with_queued_work(state: dict, name: str, n: int, value: int, how: str) -> Any:
    """cuMemAlloc memory (CuPy's and torch's kind) filled with 0x01, then a
    memset to ``value`` queued on a stream of the producer's and not waited
    for, then exported: ``how`` says what the exported object tells of that
    stream (``cai``: a version 3 array interface naming it; ``legacy``: the
    work is on the legacy stream, which the interface names; ``torch``: a
    torch-like tensor whose current stream it is; ``allocate``: a
    ``gs.allocate`` buffer, which names no stream, its work on the legacy
    stream)."""
    from cuda.core import Device

    import gpushare as gs

    d = drv()
    Device(0).set_current()
    if how == "allocate":
        buf = gs.allocate(n, device=0)
        ptr = int(buf.handle)
    else:
        ptr = int(ok(d.cuMemAlloc(n), "cuMemAlloc"))
    ok(d.cuMemsetD8(ptr, 1, n), "cuMemsetD8")
    ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
    stream = _stream("legacy" if how in ("legacy", "allocate") else "non-blocking")
    ok(d.cuMemsetD8Async(ptr, value, n, stream), "cuMemsetD8Async")
    obj: Any
    if how == "cai":
        obj = base._CudaArray(ptr, n, stream)
    elif how == "legacy":
        obj = base._CudaArray(ptr, n, 1)
    elif how == "torch":
        obj = _TorchLike(ptr, n, stream)
    else:
        obj = buf
    share = gs.export(obj, lifetime="revoked")
    state.setdefault("keep", []).append(obj)
    state["shares"][name] = share
    return share


def read_view(state: dict, name: str, n: int) -> bytes:
    """The view's bytes, read on a stream of the reader's own."""
    view = state["views"][name]
    return read_ptr(int(view.__cuda_array_interface__["data"][0]), n, view.device)


def copy_out_then_close(state: dict, name: str, n: int, kind: str, consumer: str) -> dict:
    """A user's copy out of the mapping, queued on a stream of ``kind`` and
    not waited for; the view closed, and every reference to the memory the
    user held dropped (``consumer``: how the user took it, ``cai`` or
    ``dlpack`` with that stream); then the user's stream synchronised: did
    the copy read the memory (its bytes), or fault (the memory gone)?"""
    from cuda.core import Device

    from gpushare import _dlpack

    d = drv()
    view = state["views"].pop(name)
    Device(view.device).set_current()
    stream = _stream(kind)
    dst = int(ok(d.cuMemAlloc(n), "cuMemAlloc"))
    ok(d.cuMemsetD8(dst, 0, n), "cuMemsetD8")
    ok(d.cuCtxSynchronize(), "cuCtxSynchronize")
    if consumer == "dlpack":
        held: Any = _dlpack.borrow(view, stream=stream or 1)
        src = held.address
    else:
        held = view
        src = int(view.__cuda_array_interface__["data"][0])
    ok(d.cuMemcpyDtoDAsync(dst, src, n, stream), "cuMemcpyDtoDAsync")
    mappings = base.vmm_mappings(state) + base.ipc_handles(state)
    view.close()
    del held, view
    gc.collect()
    unmapped = base.vmm_mappings(state) + base.ipc_handles(state) < mappings
    err = d.cuStreamSynchronize(stream)[0]
    out = {"unmapped": unmapped, "sync": err.name, "bytes": read_ptr(dst, n, 0)[:8] if err == d.CUresult.CUDA_SUCCESS
           else None}
    if stream:
        d.cuStreamDestroy(stream)
    return out


HANDLERS = {"export_with_queued_work": export_with_queued_work, "read_view": read_view,
            "copy_out_then_close": copy_out_then_close}
