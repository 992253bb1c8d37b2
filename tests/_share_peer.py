"""The other process of the sharing-API tests: opens shares it is sent."""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

from _procs import idle_cpu


def setup() -> dict:
    return {"_handlers": HANDLERS, "views": {}, "_reply": {"pid": os.getpid()}}


def _open(state: dict, name: str, share: Any, kwargs: dict | None = None) -> dict:
    import gpushare as gs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        view = gs.open(share, **(kwargs or {}))
    state["views"][name] = view
    return {"path": view.path, "why": view.why, "nbytes": view.nbytes,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def _get(state: dict, name: str, offset: int, n: int) -> bytes:
    out = bytearray(n)
    state["views"][name].get(out, offset)
    return bytes(out)


def _put(state: dict, name: str, offset: int, data: bytes) -> None:
    state["views"][name].put(data, offset)


def _digest(state: dict, name: str) -> str:
    view = state["views"][name]
    out = bytearray(view.nbytes)
    view.get(out)
    return hashlib.sha256(out).hexdigest()


def _array_write(state: dict, name: str, index: int, value: int) -> None:
    import numpy as np

    a = np.asarray(state["views"][name])
    a.reshape(-1).view(np.uint8)[index] = value
    del a


def _cupy_write(state: dict, name: str, index: int, value: int) -> None:
    import cupy

    a = cupy.asarray(state["views"][name])
    a.reshape(-1).view(cupy.uint8)[index] = value
    cupy.cuda.runtime.deviceSynchronize()
    del a


def _cupy_stream_roundtrip(state: dict, name: str, value: int) -> dict:
    """CuPy on a non-default stream: read the view zero-copy, then fill a
    CuPy array on the stream and put it without synchronising first."""
    import cupy

    view = state["views"][name]
    with cupy.cuda.Stream(non_blocking=True) as s:
        seen = int(cupy.asarray(view).view(cupy.uint8).sum(dtype=cupy.uint64))
        src = cupy.full(view.nbytes, value, dtype=cupy.uint8)  # queued on s
        view.put(src, stream=s)
    return {"sum": seen, "device": view.device}


def _torch_sum(state: dict, name: str) -> int:
    import torch

    t = torch.from_dlpack(state["views"][name])
    return int(t.to(torch.int64).sum())


def _torch_read(state: dict, name: str) -> dict:
    """Read a view into torch: a copy with ``view.get`` into a tensor of the
    share's dtype (named for DLPack-only dtypes), and, where the path maps
    memory, ``torch.from_dlpack`` of the view, into which it then writes 7
    at element 0 (as the share's dtype)."""
    import torch

    view = state["views"][name]
    dtype = getattr(torch, view.share.dtype_name) if view.share.dtype_name else {
        "<f4": torch.float32, "<i8": torch.int64, "<f8": torch.float64, "|u1": torch.uint8}[view.typestr]
    copy = torch.empty(view.shape, dtype=dtype)
    view.get(copy)
    out = {"copy": (str(copy.dtype), tuple(copy.shape), copy.view(torch.uint8).numpy().tobytes()), "mapped": None}
    if view.path not in ("cma", "ucx-rma"):
        mapped = torch.from_dlpack(view)
        out["mapped"] = (str(mapped.dtype), tuple(mapped.shape), mapped.view(torch.uint8).numpy().tobytes())
        mapped.view(-1)[0] = 7
        del mapped
    return out


def _get_in_thread(state: dict, name: str, offset: int, n: int) -> bytes:
    from _procs import in_thread

    out = bytearray(n)
    in_thread(lambda: state["views"][name].get(out, offset))
    return bytes(out)


def _per_call(fn: Any, iters: int) -> float:
    import time

    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _open_close(state: dict, share: Any, iters: int) -> float:
    """Seconds per gs.open + close of ``share`` (benchmarks)."""
    import gpushare as gs

    return _per_call(lambda: gs.open(share).close(), iters)


def _import_close(state: dict, desc: Any, iters: int) -> float:
    """Seconds per gs.import_buffer + close of ``desc`` (benchmarks)."""
    import gpushare as gs

    return _per_call(lambda: gs.import_buffer(desc).close(), iters)


def _import_desc(state: dict, desc: Any) -> bytes:
    import gpushare as gs

    buf = gs.import_buffer(desc)
    try:
        return bytes(buf.memoryview()[:4])
    finally:
        buf.close()


def _views(state: dict) -> list[str]:
    return sorted(state["views"])


def _close(state: dict, name: str) -> None:
    state["views"].pop(name).close()


def _stop_broker(state: dict) -> None:
    from gpushare._paths.broker import get_broker

    get_broker().stop()


def _export(state: dict, kind: str, size: int, kwargs: dict | None = None) -> Any:
    import numpy as np

    import gpushare as gs

    if kind in ("host", "host4k"):  # host4k: ordinary pages whatever the system's huge-page settings
        obj = gs.allocate(size, device="host", huge_pages="auto" if kind == "host" else False)
        np.asarray(obj)[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    else:
        obj = np.arange(size, dtype=np.uint64).astype(np.uint8)
    state.setdefault("exported", []).append(obj)
    return gs.export(obj, **(kwargs or {}))


def _die(state: dict) -> None:
    os._exit(4)


def sockets(pid: int | str = "self") -> int:
    """Sockets (of any kind) the process holds open."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _ucx_messages(state: dict) -> int:
    from gpushare._ucx import _server

    return _server.server().stats()["messages"]


def _stats(state: dict) -> dict:
    """Threads, fds and gpushare's own tables in this process."""
    import threading

    from gpushare import _importer
    from gpushare._exporter import registry
    from gpushare._paths import broker

    exporter = registry._instance.current()
    importer = _importer._instance.current()
    b = broker._service.current()
    return {
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "sockets": sockets(),
        "exporter": exporter.stats() if exporter else None,
        "importer": importer.stats() if importer else None,
        "broker": len(b) if b else 0,
        "cpu_s": sum(os.times()[:2]),
        "rss_kib": _rss_kib(),
    }


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _open_many(state: dict, name: str, shares: list, count: int, kwargs: dict | None = None) -> list[str]:
    """Open ``count`` views of each share (kept under ``name``); their paths."""
    import gpushare as gs

    views = state["views"].setdefault(name, [])
    paths = []
    for share in shares:
        for _ in range(count):
            view = gs.open(share, **(kwargs or {}))
            views.append(view)
            paths.append(view.path)
    return sorted(set(paths))


def _close_many(state: dict, name: str) -> None:
    for view in state["views"].pop(name, []):
        view.close()


def _cycle(state: dict, share: Any, count: int, kwargs: dict | None = None) -> str:
    """Open, read one byte, close; ``count`` times."""
    import gpushare as gs

    path = ""
    for _ in range(count):
        with gs.open(share, **(kwargs or {})) as view:
            view.get(bytearray(1))
            path = view.path
    return path


def _fill_fds(state: dict, above: int) -> int:
    """Raise RLIMIT_NOFILE and hold fds up to number ``above``, so that every
    socket made from now on has a number above it; the highest held."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = above + 512
    if hard != resource.RLIM_INFINITY and hard < want:
        raise RuntimeError(f"RLIMIT_NOFILE hard limit {hard} is below {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    null = os.open(os.devnull, os.O_RDONLY)
    held = state.setdefault("held_fds", [null])
    while max(held) < above:
        held.append(os.dup(null))
    return max(held)


def _export_desc(state: dict, size: int) -> Any:
    """A host buffer's descriptor from gpushare.export_buffer (served by the broker)."""
    import gpushare as gs

    buf = gs.allocate(size, device="host")
    buf.memoryview()[:4] = b"desc"
    state.setdefault("exported", []).append(buf)
    return gs.export_buffer(buf)


def _drop_exports(state: dict) -> None:
    for obj in state.pop("exported", []):
        if hasattr(obj, "close"):
            obj.close()


def _revoke_all(state: dict, shares: list) -> None:
    for share in shares:
        share.revoke()


def _no_ptrace(state: dict) -> bool:
    """Give up CAP_SYS_PTRACE (effective and permitted), as a process of an
    ordinary user has it: True when it is gone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable, for two 32-bit words
    if libc.capget(header, data) != 0:
        return False
    bit = 1 << 19  # CAP_SYS_PTRACE
    data[0] &= ~bit
    data[1] &= ~bit
    if libc.capset(header, data) != 0:
        return False
    libc.capget(header, data)
    return not data[0] & bit


def _undumpable(state: dict) -> None:
    """Mark this process not dumpable: only a process with CAP_SYS_PTRACE may
    then read or write its memory."""
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def _forge_cma(state: dict, name: str, direction: str, offset: int, n: int, address: int | None = None,
               closed: bool = False) -> str:
    """Ask the exporter for a cma copy the view's own checks would refuse
    (past its end, a put on a read-only share, a bad address, after the
    view closed): what it says."""
    from gpushare import _buffers

    view = state["views"][name]
    if closed:
        view.close()
    buf = bytearray(max(n, 1))
    local = _buffers.resolve(buf, writable=True)
    if address is not None:
        local.address = address
    local.nbytes = n
    try:
        view._transport.start(direction, offset, local).wait(10)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "copied"


def _fork_sleeper(state: dict, seconds: float) -> int:
    """Fork a child that sleeps (holding whatever it inherited) and exits."""
    import time

    pid = os.fork()
    if pid == 0:
        time.sleep(seconds)
        os._exit(0)
    state.setdefault("sleepers", []).append(pid)
    return pid


def _kill_sleepers(state: dict) -> None:
    import signal

    for pid in state.pop("sleepers", []):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _try_writing(state: dict, name: str) -> dict:
    """What a hostile importer of a mapped host view can do to write the memory."""
    import ctypes
    import errno

    import gpushare as gs

    view = state["views"][name]
    address = view._mapped.address
    perms = ""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                perms = line.split()[1]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rc = libc.mprotect(address, 4096, 3)  # PROT_READ | PROT_WRITE
    mprotect = "ok" if rc == 0 else errno.errorcode[ctypes.get_errno()]
    try:
        view.put(b"\x07", 0)
        put = "done"
    except gs.GpuShareError as exc:
        put = f"{type(exc).__name__}: {exc}"
    return {"perms": perms, "mprotect": mprotect, "memoryview_readonly": view.memoryview().readonly, "put": put}


def _forged_offers(state: dict, share: Any, blobs: list) -> list[str]:
    """Each blob as the UCX address of a ucx-rma offer of ``share``: what the importer says."""
    import gpushare as gs
    from gpushare import _open

    out = []
    for blob in blobs:
        try:
            _open._import(share, "ucx-rma", {"address": blob, "region": 1, "key": bytes(32)}, 2.0, [], None, None)
            out.append("opened")
        except gs.GpuShareError as exc:
            out.append(type(exc).__name__)
    return out


def _fuzz_cma(state: dict, name: str, count: int) -> dict:
    """Send ``count`` cma requests on the view's lease with fields an
    attacker picks (bounds, types, lease ids, addresses); gets land only in
    a scratch buffer of this process or at addresses nobody maps.  Every
    request must be answered."""
    import random

    from gpushare import _buffers

    view = state["views"][name]
    lease = view._transport.lease
    link = lease._link
    scratch = bytearray(3 * 4096)
    base = _buffers.resolve(scratch, writable=True).address
    rng = random.Random(1234)
    edge = [0, 1, 4095, 4096, 4097, 1 << 31, (1 << 62) - 1, 1 << 62, 1 << 64, -1, -(1 << 63)]
    weird = [None, "1", 1.5, True, [], {}, b"x"]
    waiters = []
    for i in range(count):
        if i % 32 == 0:  # in batches: an importer may have only so many copies queued (more are refused "busy")
            for w in waiters[-32:]:
                w.event.wait(30)
        if i % 2 == 0:  # a well-formed request, within bounds: it must be served
            offset = rng.randrange(0, view.nbytes)
            n = rng.randrange(1, view.nbytes - offset + 1)
            waiters.append(link.submit({"op": "cma", "lease": lease.id, "dir": rng.choice(["get", "put"]),
                                        "offset": offset, "n": n, "addr": base + rng.randrange(0, 4096)},
                                       keep=scratch)[1])
            continue
        direction = rng.choice(["get", "put", "get", "put", "steal", None])
        offset = rng.choice(edge + [rng.randrange(0, 8192)])
        n = rng.choice(edge + [rng.randrange(1, 4096)])
        if direction == "get":
            address = rng.choice([base + rng.randrange(0, 4096), 8, 4096, 1 << 47])
            if isinstance(n, int) and address >= base and address + n > base + len(scratch):
                n = base + len(scratch) - address  # a get's bytes stay inside the scratch buffer
        else:
            address = rng.choice(edge + [base, 8])
        message = {"op": "cma", "lease": rng.choice([lease.id] * 6 + [lease.id + 1, -1, 0] + weird),
                   "dir": direction, "offset": rng.choice([offset] * 6 + weird), "n": rng.choice([n] * 6 + weird),
                   "addr": rng.choice([address] * 6 + weird)}
        waiters.append(link.submit(message, keep=scratch)[1])
    unanswered = sum(not w.event.wait(30) for w in waiters)
    codes: dict = {}
    for w in waiters:
        code = "ok" if w.reply and w.reply.get("ok") else str((w.reply or {}).get("code"))
        codes[code] = codes.get(code, 0) + 1
    return {"requests": count, "unanswered": unanswered, "ok": codes.pop("ok", 0), "refused": codes}


def _put_batch_async(state: dict, name: str, count: int, value: int, size: int) -> None:
    """Start ``count`` puts of ``size`` bytes of ``value`` on one view, as one batch; do not wait."""
    import numpy as np

    import gpushare as gs

    view = state["views"][name]
    src = np.full(size, value, np.uint8)
    state.setdefault("batches", []).append(gs.put_batch([(view, 0, src)] * count))


def _batch_errors(state: dict) -> list[str]:
    """How the batches started before ended (waits for them)."""
    out = []
    for req in state.pop("batches", []):
        try:
            req.wait(30)
            out.append("ok")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.append(type(exc).__name__)
    return out


def _storm_start(state: dict, name: str, count: int, size: int) -> None:
    """Start ``count`` gets and ``count`` puts of ``size`` bytes each on view ``name``, not waiting."""
    import numpy as np

    import gpushare as gs

    view = state["views"][name]
    dsts = [np.empty(size, np.uint8) for _ in range(count)]
    srcs = [np.full(size, 9, np.uint8) for _ in range(count)]
    state["storm"] = (dsts, srcs, [gs.get_batch([(view, (i * size) % (view.nbytes - size + 1), d)])
                                   for i, d in enumerate(dsts)]
                      + [gs.put_batch([(view, (i * size) % (view.nbytes - size + 1), s)]) for i, s in enumerate(srcs)])


def _storm_finish(state: dict, timeout: float) -> list[str]:
    """Wait for each transfer :func:`_storm_start` began: "ok" or its error's type."""
    dsts, srcs, requests = state.pop("storm")
    out = []
    for r in requests:
        try:
            r.wait(timeout)
            out.append("ok")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.append(type(exc).__name__)
    return out


HANDLERS = {
    "storm_start": _storm_start,
    "storm_finish": _storm_finish,
    "open": _open,
    "get": _get,
    "put": _put,
    "digest": _digest,
    "array_write": _array_write,
    "cupy_write": _cupy_write,
    "import_desc": _import_desc,
    "cupy_stream_roundtrip": _cupy_stream_roundtrip,
    "torch_sum": _torch_sum,
    "torch_read": _torch_read,
    "get_in_thread": _get_in_thread,
    "open_close": _open_close,
    "import_close": _import_close,
    "close": _close,
    "views": _views,
    "stop_broker": _stop_broker,
    "export": _export,
    "die": _die,
    "stats": _stats,
    "ucx_messages": _ucx_messages,
    "open_many": _open_many,
    "close_many": _close_many,
    "cycle": _cycle,
    "fill_fds": _fill_fds,
    "drop_exports": _drop_exports,
    "export_desc": _export_desc,
    "revoke_all": _revoke_all,
    "no_ptrace": _no_ptrace,
    "undumpable": _undumpable,
    "forge_cma": _forge_cma,
    "put_batch_async": _put_batch_async,
    "batch_errors": _batch_errors,
    "idle_cpu": idle_cpu,
    "forged_offers": _forged_offers,
    "fuzz_cma": _fuzz_cma,
    "try_writing": _try_writing,
    "fork_sleeper": _fork_sleeper,
    "kill_sleepers": _kill_sleepers,
}
