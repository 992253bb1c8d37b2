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

Then further opens: ``--shares`` (2,000) host buffers of 1 KiB from
``gs.empty`` exported up front, each opened once over the connection an
earlier open made (host-fd: the memfds come with the reply), the median and
90th percentile of ``gs.open`` alone and of open and close, against
attaching as many ``shared_memory`` segments (the floor), as a ratio.
Run: ``python benchmarks/bench_open.py [--reps N] [--shares N]``.
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


def _further_child(conn) -> None:
    shares = conn.recv()
    gs.open(shares[0], exclude=["same-process"]).close()  # the connection the further opens use
    opens, both = [], []
    for share in shares[1:]:
        t0 = time.perf_counter()
        view = gs.open(share, exclude=["same-process"])
        t1 = time.perf_counter()
        view.close()
        opens.append(t1 - t0)
        both.append(time.perf_counter() - t0)
    conn.send((opens, both))


def _attach_child(conn) -> None:
    names = conn.recv()
    times = []
    for name in names:
        t0 = time.perf_counter()
        shm = shared_memory.SharedMemory(name=name)
        times.append(time.perf_counter() - t0)
        shm.close()
    conn.send(times)


def _ask(target, msg, ctx):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,))
    proc.start()
    parent.send(msg)
    answer = parent.recv()
    proc.join(30)
    return answer


def further_opens(count: int, ctx) -> tuple[list[float], list[float], list[float]]:
    """(open, open and close, shared_memory attach) times of ``count`` shares each opened once."""
    arrays = [gs.empty(1024) for _ in range(count + 1)]
    shares = [gs.export(a) for a in arrays]
    opens, both = _ask(_further_child, shares, ctx)
    segments = [shared_memory.SharedMemory(create=True, size=1024) for _ in range(count)]
    try:
        floor = _ask(_attach_child, [s.name for s in segments], ctx)
    finally:
        for s in segments:
            s.close()
            s.unlink()
    return opens, both, floor


def _p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[-1]


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
    parser.add_argument("--shares", type=int, default=2000)
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
    opens, both, floor = further_opens(args.shares, ctx)
    print(f"\nfurther opens of {args.shares} shares of 1 KiB, each once, one connection: median, 90th percentile")
    for what, samples in (("gs.open", opens), ("gs.open + close", both), ("shared_memory attach", floor)):
        print(f"  {what:<21} {statistics.median(samples) * 1e3:.3f} ms  p90 {_p90(samples) * 1e3:.3f} ms")
    print(f"  gs.open / attach      {statistics.median(opens) / statistics.median(floor):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
