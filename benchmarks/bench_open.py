"""Opening shared host memory in another process on one node, side by side.

For host buffers of 1 MiB and 512 MiB, the time in the receiving process from
"here is the thing to open" to a usable NumPy array over the shared memory
(no copy), median of ``--reps`` opens with the spread (min-max):

* gpushare: ``gs.open(share)`` + ``numpy.asarray(view)`` of a host-fd share
  (a further open of the same exporter: one control round trip with the
  memfds in the reply), the view closed after the clock stops;
* torch.multiprocessing: receiving a ``share_memory_()`` CPU tensor from a
  ``torch.multiprocessing`` queue (its fd-passing strategy) and viewing it
  with ``numpy()`` (skipped, saying so, where torch is not installed);
* ``multiprocessing.shared_memory``: ``SharedMemory(name=...)`` and a NumPy
  array over it (no exporter is asked anything: the floor).

Ratios are torch's time over gpushare's (above 1: gpushare is faster).
Run: ``python benchmarks/bench_open.py [--reps N]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing import shared_memory

import numpy as np

import gpushare as gs

from _report import spread

MiB = 1 << 20


def _gpushare_child(conn) -> None:
    times = []
    while True:
        msg = conn.recv()
        if msg is None:
            conn.send(times)
            return
        t0 = time.perf_counter()
        view = gs.open(msg, exclude=["same-process"])
        arr = np.asarray(view)
        times.append(time.perf_counter() - t0)
        assert arr[0] == 7
        del arr
        view.close()
        conn.send("next")


def _shm_child(conn) -> None:
    times = []
    while True:
        msg = conn.recv()
        if msg is None:
            conn.send(times)
            return
        name, size = msg
        t0 = time.perf_counter()
        shm = shared_memory.SharedMemory(name=name)
        arr = np.ndarray((size,), np.uint8, buffer=shm.buf)
        times.append(time.perf_counter() - t0)
        assert arr[0] == 7
        del arr
        shm.close()
        conn.send("next")


def _torch_child(queue, conn) -> None:
    times = []
    while True:
        conn.send("ready")
        if conn.recv() is None:
            conn.send(times)
            return
        t0 = time.perf_counter()
        tensor = queue.get()
        arr = tensor.numpy()
        times.append(time.perf_counter() - t0)
        assert arr[0] == 7
        del arr, tensor


def _run(target, reps: int, make_msg, ctx, extra=()) -> list[float]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*extra, child))
    proc.start()
    for _ in range(reps + 1):  # the first warms the connection and imports
        parent.send(make_msg())
        parent.recv()
    parent.send(None)
    times = parent.recv()[1:]
    proc.join(30)
    return times


def gpushare_open(size: int, reps: int, ctx) -> list[float]:
    buf = gs.allocate(size, device="host")
    np.asarray(buf)[:] = 7
    share = gs.export(buf, lifetime="revoked")
    try:
        return _run(_gpushare_child, reps, lambda: share, ctx)
    finally:
        share.revoke()
        buf.close()


def shm_attach(size: int, reps: int, ctx) -> list[float]:
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        np.ndarray((size,), np.uint8, buffer=shm.buf)[:] = 7
        return _run(_shm_child, reps, lambda: (shm.name, size), ctx)
    finally:
        shm.close()
        shm.unlink()


def torch_receive(size: int, reps: int) -> list[float] | None:
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        return None
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_torch_child, args=(queue, child))
    proc.start()
    tensors = []
    for _ in range(reps + 1):
        parent.recv()  # the child waits for the next one
        t = torch.full((size,), 7, dtype=torch.uint8).share_memory_()
        tensors.append(t)
        queue.put(t)
        parent.send("go")
    parent.recv()
    parent.send(None)
    times = parent.recv()[1:]
    proc.join(30)
    return times


def _fmt(samples: list[float]) -> str:
    return spread(samples, 3, 8, scale=1e3, unit=" ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"median (min-max) of {args.reps} opens in a second process; times to a usable NumPy array\n")
    for size in (MiB, 512 * MiB):
        ours = gpushare_open(size, args.reps, ctx)
        floor = shm_attach(size, args.reps, ctx)
        theirs = torch_receive(size, args.reps)
        print(f"{size // MiB} MiB")
        print(f"  gpushare gs.open (host-fd)        {_fmt(ours)}")
        if theirs is None:
            print("  torch.multiprocessing            not installed (pip install torch): no reference")
        else:
            ratio = statistics.median(theirs) / statistics.median(ours)
            print(f"  torch.multiprocessing queue      {_fmt(theirs)}   torch/gpushare {ratio:.2f}")
        print(f"  shared_memory attach (the floor) {_fmt(floor)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
