"""Section 4 of ``bench_gpu.py``: torch CUDA tensors handed to a process
that is ready (torch imported, its CUDA context made), against what users
pick instead, ``torch.multiprocessing``, in the same run.

* one tensor (1 MiB and 1 GiB; 256 MiB with ``--quick``): gpushare's
  ``gs.export``, the share pickled through a pipe, ``gs.open`` and
  ``torch.from_dlpack`` in the consumer, against a ``torch.multiprocessing``
  Queue's put and get;
* a state dict of 2,000 tensors of 64 float32 each, every one its own
  storage (as ``torch.full`` gives them): ``gs.export`` of the dict,
  ``gs.open`` and ``torch.from_dlpack`` of every view, against the Queue.

Timed from the producer's call to the moment the consumer has usable tensors
(it synchronises after reading one element of each), first use included:
each producer is a fresh process for each run, as a short job or a new
worker is.  The ratio is torch's time over gpushare's (above 1: gpushare
faster); the targets are 1x for one tensor and 2x for the state dict.
"""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any

MiB = 1 << 20


def _consume(tensors: Any) -> int:
    """Use every tensor (one element of each, summed on the device, read once): how many."""
    import torch

    firsts = [t.reshape(-1)[:1].to(torch.float32) for t in tensors]
    torch.cat(firsts).sum().item()
    return len(firsts)


def _gs_consumer(conn) -> None:
    import torch

    import gpushare as gs

    torch.zeros(1, device="cuda")  # ready: torch imported, context made
    conn.send("ready")
    while True:
        blob = conn.recv()
        if blob is None:
            return
        share = pickle.loads(blob)
        opened = gs.open(share)
        if share.is_bundle:
            tensors = [torch.from_dlpack(v) for v in opened.tree().values()]
        else:
            tensors = [torch.from_dlpack(opened)]
        count = _consume(tensors)
        end = time.monotonic()
        del tensors
        opened.close()
        conn.send((end, count))


def _torch_consumer(queue, conn) -> None:
    import torch

    torch.zeros(1, device="cuda")
    conn.send("ready")
    while True:
        got = queue.get()
        if got is None:
            return
        tensors = list(got.values()) if isinstance(got, dict) else [got]
        count = _consume(tensors)
        end = time.monotonic()
        del tensors, got
        conn.send((end, count))


def _producer(how: str, n: int, count: int, conn, queue) -> None:
    """A fresh process: make the tensors (outside the clock), then hand them over."""
    import torch

    if count == 1:
        obj: Any = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
    else:
        obj = {f"t{i}": torch.full((n,), float(i % 97), device="cuda") for i in range(count)}
    torch.cuda.synchronize()
    conn.send("made")
    conn.recv()
    t0 = time.monotonic()
    if how == "gpushare":
        import gpushare as gs

        share = gs.export(obj, lifetime="revoked")
        conn.send((t0, pickle.dumps(share)))
    else:
        queue.put(obj)
        conn.send((t0, None))
    conn.recv()  # until the consumer is done with them


def _one(how: str, n: int, count: int, consumer_conn, queue) -> float:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(how, n, count, theirs, queue))
    proc.start()
    try:
        assert mine.recv() == "made"
        mine.send(None)
        t0, blob = mine.recv()
        if blob is not None:
            consumer_conn.send(blob)
        end, got = consumer_conn.recv()
        if got != count:
            raise SystemExit(f"{how}: the consumer used {got} of {count} tensors")
        mine.send(None)
        return end - t0
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def handover(runs: int, quick: bool) -> None:
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
    consumers = [ctx.Process(target=_gs_consumer, args=(gs_child,), daemon=True),
                 ctx.Process(target=_torch_consumer, args=(queue, t_child), daemon=True)]
    for p in consumers:
        p.start()
    assert gs_conn.recv() == "ready" and t_conn.recv() == "ready"
    big = 256 * MiB if quick else 1 << 30
    cases = [("one tensor, 1 MiB", MiB, 1), (f"one tensor, {big // MiB} MiB", big, 1),
             ("state dict, 2,000 x 64 float32", 64, 2000)]
    print(f"\n4. torch CUDA tensors handed to a ready process, first use included (ms; median (min-max) of {runs}; "
          "ratio: torch.multiprocessing / gpushare)")
    try:
        for label, n, count in cases:
            ours, theirs = [], []
            for _ in range(runs):
                ours.append(_one("gpushare", n, count, gs_conn, None) * 1e3)
                theirs.append(_one("torch", n, count, t_conn, queue) * 1e3)
            ratio = statistics.median(theirs) / statistics.median(ours)
            want = 2.0 if count > 1 else 1.0
            print(f"   {label:34s} gpushare {statistics.median(ours):9.1f} ({min(ours):.1f}-{max(ours):.1f})  "
                  f"torch.mp {statistics.median(theirs):9.1f} ({min(theirs):.1f}-{max(theirs):.1f})  "
                  f"ratio {ratio:5.2f}  target {want:g}x  {'PASS' if ratio >= want else 'BELOW'}")
    finally:
        gs_conn.send(None)
        queue.put(None)
        for p in consumers:
            p.join(30)
            if p.is_alive():
                p.kill()
