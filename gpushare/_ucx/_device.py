"""CUDA memory around UCX calls: the device's primary context, and the
producer's work ordered before a transfer.

UCX's ``cuda_copy`` transport (UCX 1.21) needs an *active* primary context
on the memory's device for everything it does with CUDA memory:

- allocation (``ucp_mem_map`` with ``UCP_MEM_MAP_ALLOCATE``) uses the calling
  thread's current context, else the first device whose primary context is
  active, else fails ("no active cuda primary context for memory
  allocation"): ``UCX_CUDA_COPY_RETAIN_PRIMARY_CTX`` defaults to ``n``;
- registration asks for the allocation's range and sets
  ``CU_CTX_SYNC_MEMOPS`` under the device's primary context, which it pushes
  only when it is already active;
- copies (staging for TCP, the region server's copies into and out of CUDA
  regions, in the calling thread or the progress thread) push the device's
  primary context only when it is active, and fail for pool and VMM memory
  otherwise.

So gpushare retains the device's primary context once per process
(:func:`gpushare._cuda._driver.on_device`, kept until exit, as the CUDA
runtime does) before any of these, and pushes it around the calls made in
the calling thread; the caller's current context is left as it was.

UCX copies on streams of its own (non-blocking ones, which do not wait for
the legacy default stream), so a transfer from or to CUDA memory waits
first, in the calling thread, for the work queued on the stream the caller
names (``stream=``) and the one the buffer's producer names
(``__cuda_array_interface__``'s ``stream``), or on the legacy default
stream when neither is named, as the mapped paths order their copies.  A
DLPack producer is asked to order its work before that stream when the
buffer is resolved (:func:`resolve`).  A get completes only once UCX's copy
has landed in the destination (UCX completes a request after the copy's
event or a stream synchronisation), so work the caller queues afterwards
sees the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

from .. import _buffers
from .._cuda import _await, _copies, _driver

__all__ = ["consumer_stream", "ordinal_of", "on_memory_device", "order_before", "order_before_async", "resolve"]


def consumer_stream(stream: Any) -> int | None:
    """The raw handle of a ``stream=`` argument (``None`` stays ``None``)."""
    if stream is None:
        return None
    return _driver.stream_handle(stream)


def resolve(obj: Any, *, writable: bool, stream: int | None) -> _buffers.LocalBuffer:
    """:func:`gpushare._buffers.resolve` for a transfer: a CUDA DLPack
    producer orders its pending work before ``stream`` (the legacy default
    stream when ``None``), which :func:`order_before` then waits for."""
    return _buffers.resolve(obj, writable=writable, stream=_driver.LEGACY_STREAM if stream is None else stream)


def ordinal_of(local: _buffers.LocalBuffer) -> int:
    """The device of a CUDA buffer of this process (asked of the driver
    once, then kept in ``local.device``)."""
    if local.device is None:
        local.device = _driver.pointer_ordinal(local.address)
    return int(local.device)


_NOTHING = contextlib.nullcontext()


def on_memory_device(local: _buffers.LocalBuffer | None,
                     ordinal: int | None = None) -> contextlib.AbstractContextManager[Any]:
    """Push the primary context of the device of CUDA buffer ``local`` (or of
    device ``ordinal``) for a ``with`` block; nothing for host memory."""
    if ordinal is None and (local is None or local.memory_type != "cuda"):
        return _NOTHING
    return _driver.on_device(ordinal_of(local) if ordinal is None else ordinal)


def _streams(local: _buffers.LocalBuffer, stream: int | None) -> list[int]:
    """The streams whose queued work a transfer of ``local`` follows: the
    caller's and the producer's, else the legacy default stream."""
    return [s for s in dict.fromkeys((stream, local.stream)) if s is not None] or [_driver.LEGACY_STREAM]


def order_before(local: _buffers.LocalBuffer, stream: int | None) -> None:
    """Wait for the work a transfer of CUDA buffer ``local`` must follow:
    what is queued on ``stream`` (the caller's) and on ``local.stream`` (the
    producer's), or on the legacy default stream when neither is named.
    Retains the device's primary context (see the module notes).  Nothing
    for host memory."""
    if local.memory_type != "cuda":
        return
    drv = _driver.driver()
    with _driver.on_device(ordinal_of(local)):
        for s in _streams(local, stream):
            _driver.check(drv.cuStreamSynchronize(s), "cuStreamSynchronize (the work before a ucx-rma transfer)")


async def order_before_async(local: _buffers.LocalBuffer, stream: int | None) -> None:
    """:func:`order_before` for asyncio: an event is recorded on each of those streams and
    awaited without blocking the loop: a host function queued behind it wakes the loop through
    its eventfd (:mod:`gpushare._cuda._await`, whose slow poll, 1 ms doubling to 10 ms, only
    covers a driver that runs host functions late)."""
    if local.memory_type != "cuda":
        return
    drv = _driver.driver()
    ordinal = ordinal_of(local)
    no_timing = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
    events: list[Any] = []
    try:
        with _driver.on_device(ordinal):
            for s in _streams(local, stream):
                events.append(_driver.check(drv.cuEventCreate(no_timing), "cuEventCreate"))
                _driver.check(drv.cuEventRecord(events[-1], s), "cuEventRecord (the work before a ucx-rma transfer)")
        await asyncio.sleep(0)  # the loop runs its other tasks while the work drains
        for event in events:
            await _await.until(functools.partial(_complete, ordinal, event),
                               functools.partial(_copies.notify_after, ordinal, event))
    finally:
        if events:
            with _driver.on_device(ordinal):
                for event in events:
                    drv.cuEventDestroy(event)


def _complete(ordinal: int, event: Any) -> bool:
    """Whether the work before ``event`` has completed (raises its failure; ``_await.until``
    hands it to the awaiting task)."""
    drv = _driver.driver()
    with _driver.on_device(ordinal):
        (err,) = drv.cuEventQuery(event)
    if err == drv.CUresult.CUDA_ERROR_NOT_READY:
        return False
    _driver.check((err,), "cuEventQuery (the work before a ucx-rma transfer)")
    return True
