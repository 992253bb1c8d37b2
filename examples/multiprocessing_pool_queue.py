"""Send shares through multiprocessing: a Pool and a Queue (spawn start method).

A :class:`gpushare.Share` is plain, picklable data, so it travels as a task
argument of a ``Pool`` or an item of a ``Queue`` like any tuple; the memory
itself never goes through the pickle.

* Pool: the parent shares an input buffer from ``gpushare.allocate(...,
  device="host")`` (workers map it: host-fd) and a plain NumPy output array
  (the parent copies into workers' buffers and out of them with the kernel's
  cross-memory attach: cma).  Each task reads its chunk of the input without
  a copy and puts the chunk, doubled, into the output.  Both shares keep the
  default lifetime, ``"auto"``: many workers open them at different times,
  and they stay openable while the parent holds the shares; they end when
  the parent drops them.
* Queue: the parent puts three shares, each exported with ``lifetime=1`` (one
  import), on a queue; a consumer process opens each, reads it, adds one to
  every byte with ``view.put`` and answers on a second queue.

The parent checks every byte and exits with status 1 on any mismatch.

Run: python examples/multiprocessing_pool_queue.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
from typing import Any

import numpy as np

import gpushare as gs

TASKS = 8
CHUNK = 1 << 18  # bytes per task
ITEMS = 3
ITEM_BYTES = 1 << 16


def pool_task(args: tuple[Any, Any, int]) -> tuple[int, str, str, int]:
    """One Pool task: read chunk ``i`` of the input, write it doubled to the output."""
    share_in, share_out, i = args
    with gs.open(share_in) as src, gs.open(share_out) as dst:
        if src.path in ("cma", "ucx-rma"):  # not mapped here: copy out
            chunk = np.empty(CHUNK, np.uint8)
            src.get(chunk, offset=i * CHUNK)
        else:  # mapped: a zero-copy view of the exporter's memory
            chunk = np.asarray(src)[i * CHUNK : (i + 1) * CHUNK].copy()
        checksum = int(chunk.sum(dtype=np.uint64))
        dst.put(chunk.astype(np.uint16) * 2, offset=i * CHUNK * 2)
        return os.getpid(), src.path, dst.path, checksum


def consumer(inbox: Any, outbox: Any) -> None:
    """The Queue consumer: open each share, read it, add one to every byte."""
    while True:
        item = inbox.get(timeout=60)
        if item is None:
            return
        name, share = item
        with gs.open(share) as view:
            data = np.empty(view.nbytes, np.uint8)
            view.get(data)
            view.put(data + 1)
            outbox.put((name, view.path, int(data.sum(dtype=np.uint64))))


def run_pool(ctx: Any) -> bool:
    inp = gs.allocate(TASKS * CHUNK, device="host")
    src = np.asarray(inp)
    src[:] = np.arange(src.size, dtype=np.uint64) % 251
    out = np.zeros(TASKS * CHUNK, np.uint16)
    share_in = gs.export(inp)  # lifetime="auto": open while this process holds the share
    share_out = gs.export(out)
    with ctx.Pool(2) as pool:
        results = pool.map(pool_task, [(share_in, share_out, i) for i in range(TASKS)], chunksize=1)
    del share_in, share_out  # no import is open: both shares end here
    ok = True
    for i, (pid, path_in, path_out, checksum) in enumerate(results):
        want = int(src[i * CHUNK : (i + 1) * CHUNK].sum(dtype=np.uint64))
        ok &= checksum == want
        print(f"pool: task {i} in worker {pid}: input via {path_in}, output via {path_out}, "
              f"checksum {'ok' if checksum == want else 'WRONG'}")
    doubled = bool((out == src.astype(np.uint16) * 2).all())
    print(f"pool: parent sees every chunk doubled: {doubled}")
    return ok and doubled


def run_queue(ctx: Any) -> bool:
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(inbox, outbox))
    proc.start()
    arrays, ok = {}, True
    try:
        for k in range(ITEMS):
            name = f"item{k}"
            arrays[name] = np.full(ITEM_BYTES, 10 * k, np.uint8)
            inbox.put((name, gs.export(arrays[name], lifetime=1)))
        for _ in range(ITEMS):
            try:
                name, path, checksum = outbox.get(timeout=60)
            except queue.Empty:
                print("queue: the consumer did not answer")
                return False
            arr = arrays[name]
            read_ok = checksum == ITEM_BYTES * 10 * int(name[4:])
            written = bool((arr == 10 * int(name[4:]) + 1).all())
            ok &= read_ok and written
            print(f"queue: {name} via {path}: consumer read it: {read_ok}, parent sees its write: {written}")
    finally:
        inbox.put(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return ok and proc.exitcode == 0


def main() -> int:
    ctx = mp.get_context("spawn")
    ok = run_pool(ctx)
    ok &= run_queue(ctx)
    if not ok:
        print("example failed: data did not match")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
