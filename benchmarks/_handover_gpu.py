"""Sections 4 and 6 of ``bench_gpu.py``: CUDA memory handed to a process
that is ready (its library imported, its CUDA context made), against what
users pick instead, in the same run.

Section 4, torch CUDA tensors against ``torch.multiprocessing``:

* one tensor (1 MiB and 1 GiB; 256 MiB with ``--quick``): gpushare's
  ``gs.export``, the share pickled through a pipe, ``gs.open`` and
  ``torch.from_dlpack`` in the consumer, against a ``torch.multiprocessing``
  Queue's put and get;
* a state dict of 2,000 tensors of 64 float32 each, every one its own
  storage (as ``torch.full`` gives them): ``gs.export`` of the dict,
  ``gs.open`` and ``torch.from_dlpack`` of every view, against the Queue.

Section 6, one CuPy array (1 MiB and 1 GiB; 256 MiB with ``--quick``, each
its own ``cudaMalloc``, CuPy's pool off) against CuPy's legacy CUDA IPC:
``gs.export``, the pickled share through the pipe, ``gs.open`` and
``cupy.from_dlpack``, against ``cupy.cuda.runtime.ipcGetMemHandle``, the
handle through the same pipe, ``ipcOpenMemHandle`` and an array over it.

Timed from the producer's call to the moment the consumer has usable arrays
(it synchronises after reading one element of each), first use included:
each producer is a fresh process for each run, as a short job or a new
worker is.  The ratio is the rival's time over gpushare's (above 1: gpushare
faster); the targets are 1x for one tensor or array and 2x for the state
dict.
"""

from __future__ import annotations

import contextlib
import pickle
import statistics
import time
from typing import Any, Iterator

from _report import ratio_line

MiB = 1 << 20

# What the hand-over's other side is: "gpushare", "torch.mp" or "cupy ipc".
GPUSHARE, TORCH_MP, CUPY_IPC = "gpushare", "torch.mp", "cupy ipc"


def _ready(lib: str) -> None:
    """Import ``lib`` ("torch" or "cupy") and make the CUDA context."""
    if lib == "torch":
        import torch

        torch.zeros(1, device="cuda")
    else:
        import cupy

        cupy.zeros(1)
        cupy.cuda.Device().synchronize()


def _from_view(lib: str, view: Any) -> Any:
    if lib == "torch":
        import torch

        return torch.from_dlpack(view)
    import cupy

    return cupy.from_dlpack(view)


def _consume(lib: str, arrays: list) -> int:
    """Use every array (one element of each, summed on the device, read once): how many."""
    if lib == "torch":
        import torch

        firsts = [t.reshape(-1)[:1].to(torch.float32) for t in arrays]
        torch.cat(firsts).sum().item()
    else:
        import cupy

        firsts = [a.reshape(-1)[:1].astype(cupy.float32) for a in arrays]
        cupy.concatenate(firsts).sum().item()
    return len(firsts)


def _serve(lib: str, conn, receive, take) -> None:
    """A ready consumer: ``take`` turns each hand-over ``receive()`` gives into
    ``(arrays, release)``; the arrays are used, the clock stops, ``release()``
    runs, and the parent gets ``(end, count)``.  None received: stop."""
    _ready(lib)
    conn.send("ready")
    while True:
        got = receive()
        if got is None:
            return
        arrays, release = take(got)
        count = _consume(lib, arrays)
        end = time.monotonic()
        del arrays, got
        release()
        conn.send((end, count))


def _gs_consumer(lib: str, conn) -> None:
    import gpushare as gs

    def take(blob: bytes) -> tuple[list, Any]:
        share = pickle.loads(blob)
        opened = gs.open(share)
        views = opened.tree().values() if share.is_bundle else [opened]
        return [_from_view(lib, v) for v in views], opened.close

    _serve(lib, conn, conn.recv, take)


def _torch_consumer(queue, conn) -> None:
    def take(got: Any) -> tuple[list, Any]:
        return (list(got.values()) if isinstance(got, dict) else [got]), lambda: None

    _serve("torch", conn, queue.get, take)


def _cupy_ipc_consumer(conn) -> None:
    import cupy

    runtime = cupy.cuda.runtime

    def take(got: tuple[bytes, int]) -> tuple[list, Any]:
        handle, nbytes = got
        ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, handle)
        array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        return [array], lambda: runtime.ipcCloseMemHandle(ptr)

    _serve("cupy", conn, conn.recv, take)


def _make(lib: str, n: int, count: int) -> Any:
    """The producer's tensors (``count`` 1: one of ``n`` bytes; else a dict of
    ``count`` tensors of ``n`` float32), complete on the device."""
    if lib == "torch":
        import torch

        if count == 1:
            obj: Any = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
        else:
            obj = {f"t{i}": torch.full((n,), float(i % 97), device="cuda") for i in range(count)}
        torch.cuda.synchronize()
        return obj
    import cupy

    cupy.cuda.set_allocator(None)  # its own cudaMalloc: an IPC handle's base is the array's start
    obj = cupy.full((n,), 7, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
    return obj


def _producer(lib: str, how: str, n: int, count: int, conn, queue) -> None:
    """A fresh process: make the tensors (outside the clock), then hand them over."""
    obj = _make(lib, n, count)
    conn.send("made")
    conn.recv()
    t0 = time.monotonic()
    if how == GPUSHARE:
        import gpushare as gs

        share = gs.export(obj, lifetime="revoked")
        conn.send((t0, pickle.dumps(share)))
    elif how == CUPY_IPC:
        import cupy

        conn.send((t0, (cupy.cuda.runtime.ipcGetMemHandle(obj.data.ptr), obj.nbytes)))
    else:
        queue.put(obj)
        conn.send((t0, None))
    conn.recv()  # until the consumer is done with them


def _one(ctx, lib: str, how: str, n: int, count: int, consumer_conn, queue) -> float:
    """One hand-over from a fresh producer; seconds from its call to usable arrays.
    A producer or consumer that dies or hangs is reported, not waited for."""
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(lib, how, n, count, theirs, queue))
    proc.start()
    theirs.close()  # the producer's end is its own: its exit shows here as end of file
    try:
        if _answer(mine, f"the {how} producer") != "made":
            raise SystemExit(f"{how}: the producer did not make its tensors")
        mine.send(None)
        t0, blob = _answer(mine, f"the {how} producer")
        if blob is not None:
            consumer_conn.send(blob)
        end, got = _answer(consumer_conn, f"the {how} consumer")
        if got != count:
            raise SystemExit(f"{how}: the consumer used {got} of {count} tensors")
        mine.send(None)
        return end - t0
    finally:
        mine.close()  # a producer still waiting sees end of file and exits
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def _answer(conn, who: str, timeout: float = 120.0) -> Any:
    """The next message on ``conn``; SystemExit when ``who`` ended or did not answer in time."""
    try:
        if conn.poll(timeout):
            return conn.recv()
    except EOFError:
        raise SystemExit(f"{who} ended before it answered (its traceback is above)") from None
    raise SystemExit(f"{who} did not answer within {timeout:g} s")


@contextlib.contextmanager
def _consumers(ctx, starts: list[tuple[Any, tuple, Any]], queue: Any = None) -> Iterator[None]:
    """Start a consumer process per ``(target, args, conn)`` (``conn``: this
    side of the pipe whose other end is among ``args``), wait until each says
    it is ready, and stop them all at the end: None through each pipe and,
    for the Queue's consumer, through ``queue``."""
    from multiprocessing.connection import Connection

    procs = [ctx.Process(target=target, args=args, daemon=True) for target, args, _ in starts]
    for p in procs:
        p.start()
    for _, args, _ in starts:  # their ends are theirs: a consumer's exit shows here as end of file
        for arg in args:
            if isinstance(arg, Connection):
                arg.close()
    try:
        for _, _, conn in starts:
            if _answer(conn, "a consumer") != "ready":
                raise SystemExit("a consumer did not start")
        yield
    finally:
        for _, _, conn in starts:
            try:
                conn.send(None)
            except OSError:
                pass  # already gone
        if queue is not None:
            queue.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _compare(ctx, lib: str, rival: str, conns: dict[str, Any], queue, cases, runs: int) -> None:
    """Time every case ``runs`` times each way; a row and a ratio line per case."""
    for label, n, count in cases:
        ours, theirs = [], []
        for _ in range(runs):
            ours.append(_one(ctx, lib, GPUSHARE, n, count, conns[GPUSHARE], None) * 1e3)
            theirs.append(_one(ctx, lib, rival, n, count, conns[rival], queue) * 1e3)
        print(f"   {label:34s} gpushare {statistics.median(ours):9.1f} ({min(ours):.1f}-{max(ours):.1f})  "
              f"{rival} {statistics.median(theirs):9.1f} ({min(theirs):.1f}-{max(theirs):.1f})")
        print(ratio_line(statistics.median(theirs) / statistics.median(ours), f"{rival} / gpushare time, {label}",
                         2.0 if count > 1 else 1.0))


def _sizes(quick: bool) -> tuple[int, str]:
    big = 256 * MiB if quick else 1 << 30
    return big, f"{big // MiB} MiB"


def cupy_unavailable() -> str | None:
    """Why what needs CuPy (sections 6 and 7) cannot run here; None when it can."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"CuPy sees no CUDA device: {exc}"
    return None if count > 0 else "CuPy sees no CUDA device"


def handover(runs: int, quick: bool) -> None:
    """Section 4: torch CUDA tensors against ``torch.multiprocessing``."""
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        print("\n4. hand-over against torch.multiprocessing: not run (torch is not installed)")
        return
    if not torch.cuda.is_available():
        print("\n4. hand-over against torch.multiprocessing: not run (this torch has no CUDA)")
        return
    ctx = tmp.get_context("spawn")
    gs_conn, gs_child = ctx.Pipe()
    t_conn, t_child = ctx.Pipe()
    queue = ctx.Queue()
    big, big_label = _sizes(quick)
    cases = [("one tensor, 1 MiB", MiB, 1), (f"one tensor, {big_label}", big, 1),
             ("state dict, 2,000 x 64 float32", 64, 2000)]
    print(f"\n4. torch CUDA tensors handed to a ready process, first use included (ms; median (min-max) of {runs}; "
          "ratio: torch.multiprocessing's time / gpushare's)")
    with _consumers(ctx, [(_gs_consumer, ("torch", gs_child), gs_conn), (_torch_consumer, (queue, t_child), t_conn)],
                    queue):
        _compare(ctx, "torch", TORCH_MP, {GPUSHARE: gs_conn, TORCH_MP: t_conn}, queue, cases, runs)


def handover_cupy(runs: int, quick: bool) -> None:
    """Section 6: one CuPy array against CuPy's ``ipcGetMemHandle`` / ``ipcOpenMemHandle``."""
    import multiprocessing as mp

    reason = cupy_unavailable()
    if reason is not None:
        print(f"\n6. hand-over against CuPy's CUDA IPC: not run ({reason})")
        return
    ctx = mp.get_context("spawn")
    gs_conn, gs_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    big, big_label = _sizes(quick)
    cases = [("one array, 1 MiB", MiB, 1), (f"one array, {big_label}", big, 1)]
    print(f"\n6. one CuPy array handed to a ready process, first use included (ms; median (min-max) of {runs}; "
          "ratio: CuPy IPC's time / gpushare's)")
    with _consumers(ctx, [(_gs_consumer, ("cupy", gs_child), gs_conn), (_cupy_ipc_consumer, (c_child,), c_conn)]):
        _compare(ctx, "cupy", CUPY_IPC, {GPUSHARE: gs_conn, CUPY_IPC: c_conn}, None, cases, runs)
