"""A process that runs gpushare's UCX side with CUDA memory against the CUDA
driver stand-in (``tests/test_cudadriver_ucx.py``).

It serves the handlers of ``_cudadriver_peer`` and these.  No handler leaves
a context current: the thread that calls gpushare has none, as in a fresh
process of a user who never touched a CUDA runtime.  Raw driver calls stand
in for what CuPy or torch would do.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from typing import Any

import _cudadriver_peer as base
from _cudadriver_peer import current_device, drv, ok, on_device, read_ptr


def setup() -> dict:
    state = base.setup()
    state["_handlers"] = {**base.HANDLERS, **HANDLERS}
    state["devs"] = {}
    return state


# -- UCX CUDA memory ---------------------------------------------------------------


def agent_cuda_memory(state: dict, n: int) -> dict:
    """A gpushare.ucx Agent and CUDA memory UCX allocates for it, made with no
    context current; its address and remote key for a peer."""
    from gpushare import ucx

    before = current_device(state)
    agent = ucx.Agent()
    mh = agent.create_memory_handle(n, memory_type="cuda")
    state["agent"], state["mh"] = agent, mh
    return {"before": before, "after": current_device(state), "memory_type": mh.memory_type,
            "base": mh.base_address, "size": mh.size, "address": agent.address,
            "key": mh.create_remote_key().serialize(), "ordinal": pointer_device(state, mh.base_address)}


def pointer_device(state: dict, address: int) -> int | None:
    """The device of a pointer the driver knows, or None (freed or unknown)."""
    d = drv()
    err, value = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address)
    return int(value) if err == d.CUresult.CUDA_SUCCESS else None


def close_agent(state: dict) -> None:
    state.pop("mh").close()
    state.pop("agent").close()


def agent_connect(state: dict, address: bytes, key: bytes) -> None:
    from gpushare import ucx

    agent = ucx.Agent()
    ep = agent.connect(address)
    state["agent"], state["ep"], state["rk"] = agent, ep, ep.unpack_remote_key(key)


def memtype_try(state: dict, value: str) -> dict:
    """Make an Agent whose config asks for ``MEMTYPE_CACHE=value``: its error
    (type and words) or None, and the process's one setting (libucs' global
    option) before and after, with a first Agent open throughout."""
    from gpushare import ucx

    def setting() -> str:
        libucs = ctypes.CDLL("libucs.so.0")
        out = ctypes.create_string_buffer(32)
        libucs.ucs_global_opts_get_value.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        if libucs.ucs_global_opts_get_value(b"MEMTYPE_CACHE", out, len(out)) != 0:
            raise RuntimeError("ucs_global_opts_get_value failed")
        return out.value.decode()

    first = ucx.Agent()
    out: dict[str, Any] = {"env": os.environ.get("UCX_MEMTYPE_CACHE"), "before": setting(), "error": None}
    try:
        ucx.Agent(config={"UCX_MEMTYPE_CACHE": value}).close()
    except Exception as exc:  # noqa: BLE001 - its type and words go home
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["after"] = setting()
    first.close()
    return out


# -- device memory with work pending on a stream ---------------------------------------


class _CudaArray:
    """A device array as CuPy or torch presents one (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, n: int, stream: int | None) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": stream}


class _DLPackArray:
    """A device array that speaks DLPack only and orders its pending work
    (on ``stream``) before the stream its consumer names, as CuPy and torch do."""

    def __init__(self, ptr: int, n: int, stream: Any) -> None:
        self.ptr, self.n, self.stream = ptr, n, stream
        self.asked: list[Any] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        from gpushare import _dlpack

        self.asked.append(stream)
        if stream is not None and stream != -1 and self.stream is not None:
            d = drv()
            with on_device(0):
                ev = ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING.value), "cuEventCreate")
                ok(d.cuEventRecord(ev, self.stream), "cuEventRecord")
                ok(d.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")
                ok(d.cuEventDestroy(ev), "cuEventDestroy")
        return _dlpack.capsule(self.ptr, (self.n,), "|u1", (2, 0), readonly=False, owner=self,
                               max_version=max_version)


def pending(state: dict, name: str, n: int, value: int, where: str) -> None:
    """Device memory on device 0 (zeros) with a memset to ``value`` queued but
    not run: on a new non-blocking stream (``where="stream"``) or on the
    legacy default stream (``"legacy"``).  No context is current afterwards."""
    d = drv()
    with on_device(0):
        ptr = int(ok(d.cuMemAlloc(n), "cuMemAlloc"))
        stream = None
        if where == "stream":
            stream = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        ok(d.cuMemsetD8Async(ptr, value, n, stream if stream is not None else 0), "cuMemsetD8Async")
    state["devs"][name] = (ptr, n, stream)


def _buffer(state: dict, name: str, mode: str) -> tuple[Any, int | None]:
    """The device memory ``name`` as a transfer's buffer, and ``stream=``:
    ``"cai"``: the array interface names the stream of its pending work;
    ``"stream"``: the caller passes that stream; ``"dlpack"``: a DLPack
    producer orders it before the stream its consumer names; ``"legacy"``:
    nothing is named (the work is on the legacy default stream)."""
    ptr, n, stream = state["devs"][name]
    handle = None if stream is None else int(stream)
    if mode == "dlpack":
        return _DLPackArray(ptr, n, stream), None
    if mode == "cai":
        return _CudaArray(ptr, n, handle), None
    if mode == "stream":
        return _CudaArray(ptr, n, None), handle
    return _CudaArray(ptr, n, None), None


def dev_read(state: dict, name: str) -> bytes:
    """The device memory's bytes, after every queued work of the context."""
    ptr, n, _ = state["devs"][name]
    return read_ptr(ptr, n)


def dev_read_now(state: dict, name: str) -> bytes:
    """The device memory's bytes as work queued now sees them: a copy on a
    new non-blocking stream, which waits for nothing else queued (UCX's
    streams included), and only that stream synchronised."""
    import numpy as np

    d = drv()
    ptr, n, _ = state["devs"][name]
    out = np.zeros(n, np.uint8)
    with on_device(0):
        s = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        try:
            ok(d.cuMemcpyDtoHAsync(out.ctypes.data, ptr, n, s), "cuMemcpyDtoHAsync")
            ok(d.cuStreamSynchronize(s), "cuStreamSynchronize")
        finally:
            d.cuStreamDestroy(s)
    return out.tobytes()


def transfer(state: dict, api: str, op: str, name: str, mode: str, target: Any = None) -> dict:
    """One get or put between device memory ``name`` and the peer over ``api``:
    ``view``/``view_async``/``batch`` (a ucx-rma view ``target``), ``peer``
    (the region server client; ``target`` = (address, region id, key)),
    ``agent`` (gpushare.ucx, connected by :func:`agent_connect`) or
    ``agent_batch`` (the same, a batch of one item).  Reports
    the thread's current device afterwards."""
    import gpushare as gs

    buf, stream = _buffer(state, name, mode)
    kw = {} if stream is None else {"stream": stream}
    if api in ("view", "view_async", "batch"):
        view = state["views"][target]
        if api == "view":
            (view.get if op == "get" else view.put)(buf, 0, **kw)
        elif api == "view_async":
            asyncio.run((view.get_async if op == "get" else view.put_async)(buf, 0, timeout=30, **kw))
        else:
            (gs.get_batch if op == "get" else gs.put_batch)([(view, 0, buf)]).wait(30)
    elif api == "peer":
        from gpushare._ucx._peer import client

        address, rid, key = target
        peer = client().connect(address)
        (peer.get if op == "get" else peer.put)(rid, key, 0, buf, 30, **kw)
    elif api == "agent_batch":
        ep, rk = state["ep"], state["rk"]
        (ep.mem_get_batch if op == "get" else ep.mem_put_batch)([(buf, rk.base_address)], rk, **kw).wait(30)
        ep.flush().wait(30)
    else:
        ep, rk = state["ep"], state["rk"]
        (ep.mem_get if op == "get" else ep.mem_put)(buf, rk.base_address, rk, **kw).wait(30)
        ep.flush().wait(30)
    return {"current": current_device(state)}


def async_transfer_beside(state: dict, op: str, name: str, mode: str, target: Any) -> str:
    """A ucx-rma view's ``get_async``/``put_async`` of device memory ``name``
    beside another task of the same event loop, which looks (once) at the
    stream of the memory's pending work: ``"pending"`` when that task ran
    while the work was still queued (the transfer did not block the loop
    waiting for it), ``"done"`` otherwise."""
    d = drv()
    buf, stream = _buffer(state, name, mode)
    kw = {} if stream is None else {"stream": stream}
    view = state["views"][target]
    seen: list[str] = []

    class Watched(type(buf)):  # type: ignore[misc]
        """``buf``, noting when the transfer first reads its interface."""

        read = False

        @property
        def __cuda_array_interface__(self) -> dict:
            Watched.read = True
            return self._cai

    watched = Watched.__new__(Watched)
    watched._cai = buf.__cuda_array_interface__

    async def beside() -> None:
        for _ in range(10_000):  # until the transfer has begun: it read the buffer
            if Watched.read:
                break
            await asyncio.sleep(0)
        with on_device(0):
            (err,) = d.cuStreamQuery(state["devs"][name][2])
        seen.append("pending" if err == d.CUresult.CUDA_ERROR_NOT_READY else "done")

    async def both() -> None:
        await asyncio.gather((view.get_async if op == "get" else view.put_async)(watched, 0, timeout=30, **kw),
                             beside())

    asyncio.run(both())
    return seen[0]


# -- the region server -------------------------------------------------------------------


def serve(state: dict, name: str) -> tuple:
    """Serve buffer ``name`` of this process (see ``allocate``) in the region server."""
    from gpushare._ucx._server import server

    region = server().add_region(state["bufs"][name])
    state.setdefault("regions", []).append(region)
    rid, key = region.grant()
    return server().address, rid, key


def batch_refusal(state: dict, names: list) -> str:
    """What a put batch of device memory ``names`` (or ``"host"``: 8 bytes of host memory) after a
    first item of device memory says when refused: its error's message."""
    import gpushare

    ep, rk = state["ep"], state["rk"]
    items = [(bytes(8) if name == "host" else _buffer(state, name, "legacy")[0], rk.base_address) for name in names]
    try:
        ep.mem_put_batch(items, rk).wait(30)
    except gpushare.InvalidInputError as exc:
        return str(exc)
    return "accepted"


def put_batch_of(state: dict, names: list, mode: str) -> None:
    """A put batch of device memory ``names`` (each as ``mode`` presents it) to consecutive
    ranges of the peer's key, then a flush."""
    ep, rk = state["ep"], state["rk"]
    items, at = [], rk.base_address
    for name in names:
        items.append((_buffer(state, name, mode)[0], at))
        at += state["devs"][name][1]
    ep.mem_put_batch(items, rk).wait(30)
    ep.flush().wait(30)


def plan_of(state: dict, names: list, mode: str) -> None:
    """A prepared put batch of device memory ``names`` (as put_batch_of lays them out), kept."""
    ep, rk = state["ep"], state["rk"]
    items, at = [], rk.base_address
    for name in names:
        items.append((_buffer(state, name, mode)[0], at))
        at += state["devs"][name][1]
    state["plan"] = ep.prepare_put_batch(items, rk)


def post_plan(state: dict) -> None:
    """Post the kept plan, then flush."""
    state["plan"].post().wait(30)
    state["ep"].flush().wait(30)


def requeue(state: dict, name: str, value: int) -> None:
    """Queue another memset of device memory ``name`` to ``value`` on its stream (not run)."""
    d = drv()
    ptr, n, stream = state["devs"][name]
    with on_device(0):
        ok(d.cuMemsetD8Async(ptr, value, n, stream if stream is not None else 0), "cuMemsetD8Async")


def pending_on(state: dict, name: str, n: int, ordinal: int) -> None:
    """Device memory on device ``ordinal``, nothing queued; no context is current afterwards."""
    d = drv()
    with on_device(ordinal):
        state["devs"][name] = (int(ok(d.cuMemAlloc(n), "cuMemAlloc")), n, None)


def fill_at(state: dict, address: int, data: bytes) -> None:
    base.write_at(state, address, data)


HANDLERS = {name: fn for name, fn in globals().items()
            if callable(fn) and not name.startswith("_") and name not in ("setup", "drv", "ok", "on_device",
                                                                          "read_ptr", "current_device")
            and getattr(fn, "__module__", None) == __name__}
