"""A training-exchange step loop: one producer, three consumers, 100 steps.

The producer fills a batch per step and publishes it on a gpushare channel;
each consumer waits for the step, reads the batch in place (host memory
mapped through memfds: no copy) and releases it.  The channel's ring of
slots is the only synchronisation: no barrier, no queue, no sleep.

Run: python examples/training_exchange.py [--steps N] [--consumers N]
         [--start-method spawn|forkserver|fork] [--shape 256,1024]

Across nodes, run the producer on one node and each consumer on another; the
producer prints the channel's handle (validated bytes, hex) for them.  They
are separate programs, so their control connections need one key
(docs/security.md): make a fresh one once, where only the job's user reads it
(a home directory the nodes share), and set it on every node:

    (umask 077; python -c "import secrets; print(secrets.token_hex(32))" > ~/.gpushare-key)
    GPUSHARE_AUTHKEY=$(cat ~/.gpushare-key) python examples/training_exchange.py --role producer --consumers 2 > handle.txt
    GPUSHARE_AUTHKEY=$(cat ~/.gpushare-key) python examples/training_exchange.py --role consumer < handle.txt   # on each other node
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys

import numpy as np

import gpushare as gs


def batch(step: int, shape: tuple[int, ...]) -> np.ndarray:
    """What the producer publishes at ``step`` (so consumers can check it)."""
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + step


def consume(handle: gs.ChannelHandle) -> tuple:
    with gs.subscribe(handle, timeout=60) as ch:
        seen, wrong = 0, 0
        for step in ch:  # each step released when the next is asked for
            x = step.array  # the slot, read-only: in place on this node, a local copy on another
            if x.dtype != np.float32 or x.shape != handle.shape or x[0, 0] != step.step \
                    or not np.array_equal(x, batch(step.step, handle.shape)):
                wrong += 1
            seen += 1
        return ch.index, seen, wrong, sorted(set(ch.paths)), ch.zero_copy


def consumer(handle: gs.ChannelHandle, results: mp.Queue) -> None:
    results.put(consume(handle))


def produce(producer: gs.Producer, steps: int, shape: tuple[int, ...]) -> None:
    with producer:
        for t in range(steps):
            with producer.slot(timeout=120) as x:  # waits until every consumer let go of this slot
                x[...] = batch(t, shape)
    # leaving the block waited for the consumers to release the last steps


def report(index: int, seen: int, wrong: int, paths: list[str], zero_copy: bool) -> str:
    return f"consumer {index}: {seen} steps, {wrong} wrong, via {', '.join(paths)}, zero-copy {zero_copy}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"))
    parser.add_argument("--shape", default="256,1024")
    parser.add_argument("--role", default="all", choices=("all", "producer", "consumer"))
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split(","))
    ctx = mp.get_context(args.start_method)
    if args.role == "consumer":
        result = consume(gs.ChannelHandle.from_bytes(bytes.fromhex(sys.stdin.readline().split()[-1])))
        print(report(*result))
        ok = result[1] == args.steps and result[2] == 0
        print("ok" if ok else "example failed")
        return 0 if ok else 1
    if args.role == "producer":
        producer = gs.channel(shape, np.float32, consumers=args.consumers, slots=2)
        print(f"handle: {producer.handle.to_bytes().hex()}", flush=True)
        produce(producer, args.steps, shape)
        print(f"producer: {producer.step} steps of {shape} float32 on {args.consumers} consumers")
        print("ok")
        return 0

    producer = gs.channel(shape, np.float32, consumers=args.consumers, slots=2)
    results = ctx.Queue()
    procs = [ctx.Process(target=consumer, args=(producer.handle, results)) for _ in range(args.consumers)]
    for p in procs:
        p.start()
    try:
        produce(producer, args.steps, shape)
        reports = sorted(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    print(f"producer: {producer.step} steps of {shape} float32 on {args.consumers} consumers, "
          f"start method {args.start_method}")
    ok = True
    for index, seen, wrong, paths, zero_copy in reports:
        print(report(index, seen, wrong, paths, zero_copy))
        ok &= seen == args.steps and wrong == 0
    ok &= all(p.exitcode == 0 for p in procs) and len(reports) == args.consumers
    print("ok" if ok else "example failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
