"""Helpers for processes that run against the CUDA driver stand-in.

Test code running in a child process does ``from standin_child import *``
(``tests/_standin_run.py`` prepends that line).  Never imported by
the pytest process itself.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

from cuda.bindings import driver as drv

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = f"import sys; sys.path.insert(0, {HERE!r}); from standin_child import *\n"
GRAN = 2 << 20


def ok(res):
    """The values of a driver call, or RuntimeError naming its error."""
    if not isinstance(res, tuple):
        res = (res,)
    if res[0] != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(res[0].name)
    rest = res[1:]
    return rest[0] if len(rest) == 1 else (rest or None)


def err(res) -> str:
    """The name of a driver call's result code."""
    return (res[0] if isinstance(res, tuple) else res).name


def setup(ordinal: int = 0):
    """cuInit, then make the primary context of ``ordinal`` current."""
    ok(drv.cuInit(0))
    dev = ok(drv.cuDeviceGet(ordinal))
    ctx = ok(drv.cuDevicePrimaryCtxRetain(dev))
    ok(drv.cuCtxSetCurrent(ctx))
    return dev, ctx


def raw(struct, n: int = 64) -> bytes:
    """The bytes of a driver struct (an IPC handle, pointer export data...)."""
    return ctypes.string_at(int(struct.getPtr()), n)


def filled(struct, data: bytes):
    """``struct`` with its first ``len(data)`` bytes set from ``data``."""
    ctypes.memmove(int(struct.getPtr()), data, len(data))
    return struct


def peek(ptr: int, n: int) -> bytes:
    """The bytes at a device pointer right now, before other queued work runs:
    a copy on a stream of its own (non-blocking, so it waits for no other
    stream) in the current context.  The CPU cannot read device memory."""
    s = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    buf = ctypes.create_string_buffer(n)
    try:
        ok(drv.cuMemcpyDtoHAsync(ctypes.addressof(buf), int(ptr), n, s))
        ok(drv.cuStreamSynchronize(s))
    finally:
        drv.cuStreamDestroy(s)
    return buf.raw


def dtoh(ptr: int, n: int) -> bytes:
    buf = ctypes.create_string_buffer(n)
    ok(drv.cuMemcpyDtoH(ctypes.addressof(buf), int(ptr), n))
    return buf.raw


def htod(ptr: int, data: bytes) -> None:
    ok(drv.cuMemcpyHtoD(int(ptr), data, len(data)))


def vmm_prop(ordinal: int = 0, handle_types: int = 1, rdma: bool = False):
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = handle_types
    prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
    return prop


def access(ordinal: int, flags) -> drv.CUmemAccessDesc:
    d = drv.CUmemAccessDesc()
    d.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = ordinal
    d.flags = flags
    return d


def pool_props(ordinal: int = 0, handle_types: int = 1) -> drv.CUmemPoolProps:
    """Properties of a device pool (``handle_types`` 1: exportable as a POSIX fd)."""
    props = drv.CUmemPoolProps()
    props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = handle_types
    props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = ordinal
    return props


POSIX = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
FABRIC = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
RW = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
RO = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ


def vmm_map(handle, size: int, *grants) -> int:
    """Reserve, map ``handle`` and grant ``(ordinal, flags)`` pairs; the address."""
    va = ok(drv.cuMemAddressReserve(size, 0, 0, 0))
    ok(drv.cuMemMap(va, size, 0, handle, 0))
    if grants:
        ok(drv.cuMemSetAccess(va, size, [access(o, f) for o, f in grants], len(grants)))
    return int(va)


def _run_peer(code: str, pass_fds, timeout: float, env: dict) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env)
    return subprocess.run(
        [sys.executable, "-c", HEADER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        pass_fds=tuple(pass_fds),
        env=e,
    )


def pool_flags(pool, ordinal: int) -> int:
    """cuMemPoolGetAccess of ``pool`` for device ``ordinal``."""
    return int(ok(drv.cuMemPoolGetAccess(pool, access(ordinal, RW).location)))


def copy_on(ordinal: int, dst: int, src: int, n: int) -> str:
    """A device-to-device copy in device ``ordinal``'s primary context (left
    current), synchronised: the driver's answer."""
    setup(ordinal)
    r = err(drv.cuMemcpyDtoDAsync(dst, src, n, 0))
    return r if r != "CUDA_SUCCESS" else err(drv.cuCtxSynchronize())


def peer(code: str, pass_fds=(), timeout: float = 60, **env: str) -> str:
    """Run ``code`` in another process on the same stand-in; its stdout."""
    r = _run_peer(code, pass_fds, timeout, env)
    if r.returncode != 0:
        raise RuntimeError(f"peer exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def peer_status(code: str, pass_fds=(), timeout: float = 60, **env: str) -> tuple[int, str]:
    """Run ``code`` in another process on the same stand-in; its exit status
    (negative: the signal that killed it) and its stdout."""
    r = _run_peer(code, pass_fds, timeout, env)
    return r.returncode, r.stdout
