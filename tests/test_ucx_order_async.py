"""The producer's work awaited before an async ucx-rma transfer of CUDA memory
(``gpushare._ucx._device.order_before_async``): a failure of the event, or of asking about it,
is raised by the awaiting task and never inside the event loop's callbacks, where it would
leave the task waiting.  The driver is a small stub here (the CUDA driver stand-in has no way
to fail an event); the stand-in tests in test_cudadriver_ucx.py check the ordering itself."""

from __future__ import annotations

import asyncio
import contextlib
import types

import pytest

from gpushare._errors import CUDAError
from gpushare._ucx import _device

CUresult = pytest.importorskip("cuda.bindings.driver").CUresult


class _Driver:
    CUresult = CUresult
    CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)

    def __init__(self, query):
        self.query = query
        self.created, self.destroyed = [], []

    def cuEventCreate(self, flags):
        self.created.append(object())
        return CUresult.CUDA_SUCCESS, self.created[-1]

    def cuEventRecord(self, event, stream):
        return (CUresult.CUDA_SUCCESS,)

    def cuEventQuery(self, event):
        return self.query()

    def cuEventDestroy(self, event):
        self.destroyed.append(event)


def _check(result, what):
    if result[0] != CUresult.CUDA_SUCCESS:
        raise CUDAError(result[0].name, what)
    return result[1] if len(result) == 2 else None


@pytest.fixture
def stub(monkeypatch):
    def install(query):
        drv = _Driver(query)
        monkeypatch.setattr(_device, "_driver", types.SimpleNamespace(
            driver=lambda: drv, on_device=lambda ordinal: contextlib.nullcontext(), check=_check,
            LEGACY_STREAM=1))
        notified = []
        monkeypatch.setattr(_device, "_copies", types.SimpleNamespace(
            notify_after=lambda ordinal, event, fd: notified.append(event)))
        return drv, notified

    return install


def _local():
    return types.SimpleNamespace(memory_type="cuda", device=0, stream=7)


def _await_order(timeout=10):
    async def main():
        await asyncio.wait_for(_device.order_before_async(_local(), 5), timeout)

    asyncio.run(main())


def test_a_failed_event_is_raised_by_the_awaiting_task(stub):
    answers = iter([(CUresult.CUDA_ERROR_NOT_READY,), (CUresult.CUDA_ERROR_LAUNCH_FAILED,)])
    drv, notified = stub(lambda: next(answers, (CUresult.CUDA_ERROR_LAUNCH_FAILED,)))
    with pytest.raises(CUDAError, match="CUDA_ERROR_LAUNCH_FAILED"):
        _await_order()
    assert len(drv.created) == 2  # the caller's stream and the producer's
    assert sorted(map(id, drv.destroyed)) == sorted(map(id, drv.created))


def test_a_query_that_raises_is_raised_by_the_awaiting_task(stub):
    def query():
        raise RuntimeError("the driver went away")

    drv, notified = stub(query)
    with pytest.raises(RuntimeError, match="went away"):
        _await_order()
    assert sorted(map(id, drv.destroyed)) == sorted(map(id, drv.created))


def test_work_not_yet_done_is_awaited_through_the_notification(stub):
    """Pending at first: the task asks for a notification per event and is woken by it (the
    stub's 'host function' writes the eventfd), with no answer of the poll needed."""
    state = {"done": False}
    drv, notified = stub(lambda: (CUresult.CUDA_SUCCESS,) if state["done"] else (CUresult.CUDA_ERROR_NOT_READY,))

    async def main():
        from gpushare._cuda import _await

        loop = asyncio.get_running_loop()

        def host_function_runs():
            state["done"] = True
            import os
            os.eventfd_write(_await._by_loop[loop].fd, 1)

        task = asyncio.ensure_future(_device.order_before_async(_local(), 5))
        while not notified:
            await asyncio.sleep(0)
        assert not task.done()
        host_function_runs()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert notified
