"""Steps per second of a producer/consumer step loop: a gpushare channel
against a hand-written double buffer over ``multiprocessing.shared_memory``
with ``multiprocessing.Barrier``, on one node.

Both loops do the same work per step: the producer copies a prepared array
into the slot, each consumer copies the slot out into memory of its own
(what a consumer that keeps the data does), and two slots let the producer
fill step t+1 while the consumers read step t.

* gpushare: ``gs.channel(..., slots=2)``; the producer ``send``s, each
  consumer iterates (``for step in consumer``), reading the slot in place
  (host-fd: the memfd mapped in every process).
* hand-written: two ``SharedMemory`` buffers; the producer writes buffer
  ``t % 2`` then waits on the barrier; the consumers wait on the barrier,
  then read buffer ``t % 2``.  One barrier per step is what makes the double
  buffer safe: nobody passes barrier t+1 before every consumer is done with
  step t.

Each run times ``--steps`` steps after a few warm-up steps, from the
producer, until every consumer finished the last step.  Prints the median of
``--runs`` runs with the spread (min to max) and the ratio of the medians.
Target: the channel at least 0.8x the hand-written loop.

Run: ``python benchmarks/bench_exchange.py [--consumers 3] [--runs 5]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

import gpushare as gs

KiB, MiB = 1 << 10, 1 << 20
WARMUP = 3


def _gs_consumer(handle: gs.ChannelHandle, done) -> None:
    local = np.empty(handle.shape, np.dtype(handle.typestr))
    count = 0
    with gs.subscribe(handle) as ch:
        for step in ch:
            np.copyto(local, step.array)
            count += 1
    done.put(count)


def _gs_run(ctx, nbytes: int, consumers: int, steps: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    done = ctx.Queue()
    producer = gs.channel(nbytes, np.uint8, consumers=consumers, slots=2)
    procs = [ctx.Process(target=_gs_consumer, args=(producer.handle, done)) for _ in range(consumers)]
    for p in procs:
        p.start()
    try:
        with producer:
            for _ in range(WARMUP):
                producer.send(src, timeout=60)
            producer.drain(timeout=60)
            t0 = time.perf_counter()
            for _ in range(steps):
                producer.send(src, timeout=60)
            producer.drain(timeout=60)
            elapsed = time.perf_counter() - t0
        counts = [done.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
    if counts != [steps + WARMUP] * consumers:
        raise SystemExit(f"gpushare: consumers saw {counts} steps; expected {steps + WARMUP}")
    return steps / elapsed


def _shm_consumer(names: list[str], nbytes: int, barrier, total: int, done) -> None:
    bufs = [shared_memory.SharedMemory(name=n) for n in names]
    views = [np.ndarray((nbytes,), np.uint8, buffer=b.buf) for b in bufs]
    local = np.empty(nbytes, np.uint8)
    for t in range(total):
        barrier.wait()  # step t is in buffer t % 2
        np.copyto(local, views[t % 2])
    barrier.wait()  # done with the last step
    del views
    for b in bufs:
        b.close()
    done.put(total)


def _shm_run(ctx, nbytes: int, consumers: int, steps: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    bufs = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(2)]
    views = [np.ndarray((nbytes,), np.uint8, buffer=b.buf) for b in bufs]
    barrier = ctx.Barrier(consumers + 1)
    done = ctx.Queue()
    total = steps + WARMUP
    procs = [ctx.Process(target=_shm_consumer, args=([b.name for b in bufs], nbytes, barrier, total, done))
             for _ in range(consumers)]
    for p in procs:
        p.start()
    try:
        for t in range(WARMUP):
            np.copyto(views[t % 2], src)
            barrier.wait()
        t0 = time.perf_counter()
        for t in range(WARMUP, total):
            np.copyto(views[t % 2], src)
            barrier.wait()
        barrier.wait()  # every consumer finished the last step
        elapsed = time.perf_counter() - t0
        counts = [done.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
        del views
        for b in bufs:
            b.close()
            b.unlink()
    if counts != [total] * consumers:
        raise SystemExit(f"shared_memory: consumers saw {counts} steps; expected {total}")
    return steps / elapsed


def _summary(rates: list[float]) -> str:
    return f"{statistics.median(rates):9.1f} steps/s ({min(rates):.1f} to {max(rates):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--small-steps", type=int, default=1000, help="steps per run at 256 KiB")
    parser.add_argument("--large-steps", type=int, default=40, help="steps per run at 64 MiB")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"))
    args = parser.parse_args()
    ctx = mp.get_context(args.start_method)
    print(f"{args.consumers} consumers, 2 slots, {args.runs} runs each (median, min to max), "
          f"start method {args.start_method}")
    print(f"{'step':>8}  {'gpushare channel':>40}  {'shared_memory + Barrier':>40}  ratio")
    for nbytes, steps in ((256 * KiB, args.small_steps), (64 * MiB, args.large_steps)):
        ours, theirs = [], []
        for _ in range(args.runs):  # interleaved, so both see the same machine
            ours.append(_gs_run(ctx, nbytes, args.consumers, steps))
            theirs.append(_shm_run(ctx, nbytes, args.consumers, steps))
        ratio = statistics.median(ours) / statistics.median(theirs)
        size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
        print(f"{size:>8}  {_summary(ours):>40}  {_summary(theirs):>40}  {ratio:.2f}x")


if __name__ == "__main__":
    main()
