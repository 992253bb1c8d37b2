"""gpushare.multiprocessing against torch.multiprocessing: tensors through a Queue.

Each side runs in processes of its own (the two register reducers for the
same torch type, so they never share a process): a spawned producer puts
the object on its module's Queue, a spawned consumer gets it and reads one
element of each tensor; timed from just before the put to that read
(``time.monotonic``, which both processes share), median of ``--runs`` runs
after one warm-up (lowest-highest in parentheses).  The two sides take
turns, run by run, so that both see the same load on the machine.  Every run sends fresh
tensors (a new model output each time), so both sides pay for moving them
into shared memory at the put, as ``torch.multiprocessing`` does for a
tensor not yet shared.

Rows:

* one 64 MiB float32 tensor;
* a dict of 1,000 float32 tensors of 16 KiB (16 MiB in all): torch
  shares one storage (one fd) per tensor, gpushare one bundle;
* with a GPU (``--cuda`` by default where CUDA is present): a 64 MiB CUDA
  tensor both ways, and a 64 MiB CuPy array, which torch.multiprocessing
  cannot carry (gpushare only).

Targets: gpushare at least 1x torch.multiprocessing on the CPU tensor and on
the 1,000-tensor dict (printed PASS/FAIL with the ratio, torch's time over
gpushare's).  The exit status is 1 when a target fails.

Run: ``python benchmarks/bench_mp.py [--runs 7] [--quick] [--no-cuda]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

# The benchmarks' helpers, also when Python does not put the script's folder on sys.path (-P, PYTHONSAFEPATH).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import spread  # noqa: E402

MiB = 1 << 20


def _module(side: str) -> Any:
    """The multiprocessing module of ``side``, imported in this process only."""
    if side == "torch":
        import torch.multiprocessing as m
    else:
        import gpushare.multiprocessing as m
    return m


def _make(side: str, case: str, seed: int) -> Any:
    import torch

    if case == "tensor":
        return torch.full((16 * MiB,), float(seed), dtype=torch.float32)
    if case == "shared":  # already in shared memory: what a hand-over costs beyond the copy
        t = torch.full((16 * MiB,), float(seed), dtype=torch.float32)
        if side == "torch":
            t.share_memory_()
        else:
            import gpushare as gs

            t = gs.share_memory(t)
        return t
    if case == "dict":
        return {f"layers.{i}.w": torch.full((4096,), float(seed), dtype=torch.float32) for i in range(1000)}
    if case == "cuda-tensor":
        return torch.full((16 * MiB,), float(seed), dtype=torch.float32, device="cuda")
    if case == "cupy":
        import cupy

        return cupy.full((16 * MiB,), float(seed), dtype=cupy.float32)
    raise ValueError(case)


def _first_element(obj: Any) -> float:
    """Read one element of every tensor: the object is usable."""
    if isinstance(obj, dict):
        return sum(_first_element(v) for v in obj.values())
    return float(obj[0])


def _consumer(queue: Any, replies: Any) -> None:
    while True:
        obj = queue.get()
        if obj is None:
            return
        total = _first_element(obj)
        replies.put((time.monotonic(), total))
        del obj


def _producer(side: str, case: str, conn: Any) -> None:
    """Hand over one fresh object per ``"run"`` asked on ``conn``; answer its time."""
    m = _module(side)
    ctx = m.get_context("spawn")
    queue, replies = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_consumer, args=(queue, replies), daemon=True)
    consumer.start()
    try:
        while True:
            seed = conn.recv()
            if seed is None:
                break
            obj = _make(side, case, seed)
            want = _first_element(obj)
            t0 = time.monotonic()
            queue.put(obj)
            t1, got = replies.get(timeout=120)
            if got != want:
                raise SystemExit(f"{side} {case}: the consumer read {got}, not {want}")
            del obj
            time.sleep(0.05)  # the consumer's release settles before the next run
            conn.send(t1 - t0)
        queue.put(None)
        consumer.join(30)
    except BaseException as exc:  # the parent reports it
        conn.send(f"{type(exc).__name__}: {exc}")
        consumer.kill()


def measure(sides: list[str], case: str, runs: int) -> dict[str, list[float] | str]:
    """Times of ``runs`` hand-overs on each side (or why it failed), the sides
    taking turns run by run, so that both see the same load on the machine."""
    ctx = multiprocessing.get_context("spawn")
    procs, conns = {}, {}
    for side in sides:
        conns[side], child = ctx.Pipe()
        procs[side] = ctx.Process(target=_producer, args=(side, case, child))
        procs[side].start()
    out: dict[str, list[float] | str] = {side: [] for side in sides}
    try:
        for run in range(runs + 1):
            for side in (sides if run % 2 else sides[::-1]):
                if isinstance(out[side], str):
                    continue
                conns[side].send(run + 1)
                if not conns[side].poll(300):
                    out[side] = "no result (timed out)"
                    continue
                got = conns[side].recv()
                if isinstance(got, str):
                    out[side] = got
                elif run:  # the first run is a warm-up (connections, first open)
                    out[side].append(got)  # type: ignore[union-attr]
    except (EOFError, OSError) as exc:  # a producer that died says nothing more
        for side in sides:
            if not isinstance(out[side], str) and len(out[side]) < runs:
                out[side] = f"no result ({type(exc).__name__})"
    finally:
        for side in sides:
            try:
                conns[side].send(None)
            except OSError:
                pass
            procs[side].join(60)
            if procs[side].is_alive():
                procs[side].kill()
    return out


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _cupy_present() -> bool:
    return importlib.util.find_spec("cupy") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 runs, for a check that it works")
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA rows")
    args = parser.parse_args(argv)
    runs = 3 if args.quick else max(1, args.runs)
    cases = [("tensor", "one 64 MiB tensor", True), ("dict", "1,000-tensor dict (16 MiB)", True),
             ("shared", "64 MiB, already shared", False)]
    if not args.no_cuda and _cuda_present():
        cases.append(("cuda-tensor", "one 64 MiB CUDA tensor", False))
        if _cupy_present():
            cases.append(("cupy", "one 64 MiB CuPy array", False))
    else:
        print("no CUDA device (or --no-cuda): the CUDA rows are not measured")
    print(f"put to usable object in the receiver, ms: median (lowest-highest) of {runs} runs, spawn")
    failed = 0
    targets = []
    for case, title, target in cases:
        got = measure(["gpushare"] if case == "cupy" else ["gpushare", "torch"], case, runs)
        mine = got["gpushare"]
        theirs = got.get("torch", "torch.multiprocessing cannot carry it")
        row = f"  {title:28s} gpushare "
        row += spread(mine, 1, scale=1e3) if isinstance(mine, list) else mine
        row += "   torch.multiprocessing "
        row += spread(theirs, 1, scale=1e3) if isinstance(theirs, list) else theirs
        if isinstance(mine, list) and isinstance(theirs, list):
            ratio = statistics.median(theirs) / statistics.median(mine)
            row += f"   ratio {ratio:.2f}x"
            if target:
                ok = ratio >= 1.0
                failed += not ok
                targets.append(f"{'PASS' if ok else 'FAIL'}: {title} >= 1x torch.multiprocessing: {ratio:.2f}x")
        elif target:
            failed += 1
            targets.append(f"FAIL: {title}: not measured")
        print(row, flush=True)
    for line in targets:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
