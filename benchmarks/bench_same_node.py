"""Time from a descriptor to a usable view of a host buffer in another process.

Compares, for host buffers of 4 KiB and 64 MiB (and 1 GiB with ``--large``):

* gpushare: ``import_buffer(descriptor)`` + ``numpy.asarray`` (broker round
  trip, fds over SCM_RIGHTS, fstat and seal checks, mmap per chunk);
* ``multiprocessing.shared_memory``: ``SharedMemory(name=...)`` + ``numpy.ndarray``;
* pickling the array through a ``multiprocessing`` pipe (send in the parent
  to a NumPy array in the child; the clocks are the same CLOCK_MONOTONIC).

It also prints the time of a bare request and reply between the two
processes: a gpushare open asks the exporter's broker for the fds, so it can
never be faster than that, while a shared_memory attach asks no one.

A run times ``--reps`` opens of each kind (a tenth of them, at least one,
for pickling 64 MiB and more) and takes their median; every figure printed
is the median of ``--runs`` runs (lowest-highest), and every ratio a ratio
of those medians.  Unit: microseconds.

Targets: open at most 2x the shared_memory attach; at least 100x faster than
pickling at 64 MiB.  Run: ``python benchmarks/bench_same_node.py [--large] [--runs 5] [--reps N]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

import gpushare as gs

from _report import spread

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _child(conn) -> None:
    while True:
        cmd, arg, reps = conn.recv()
        if cmd == "exit":
            return
        times = []
        for _ in range(reps):
            if cmd == "device":
                t0 = time.perf_counter()
                buf = gs.import_buffer(arg)
                times.append(time.perf_counter() - t0)
                buf.close()
            elif cmd == "gpushare":
                t0 = time.perf_counter()
                buf = gs.import_buffer(arg)
                view = np.asarray(buf)
                view[0]
                times.append(time.perf_counter() - t0)
                del view
                buf.close()
            elif cmd == "shm":
                t0 = time.perf_counter()
                shm = shared_memory.SharedMemory(name=arg[0])
                view = np.ndarray((arg[1],), dtype=np.uint8, buffer=shm.buf)
                view[0]
                times.append(time.perf_counter() - t0)
                del view
                shm.close()
            elif cmd == "ping":
                t0 = time.perf_counter()
                conn.send(None)
                conn.recv()
                times.append(time.perf_counter() - t0)
            elif cmd == "pickle":
                arr = conn.recv()
                arr[0]
                times.append(time.perf_counter())  # the parent subtracts its send time
                del arr
        conn.send(times)


def _median(times: list[float]) -> float:
    return statistics.median(times)


def _fmt(values: list[float]) -> str:
    """The median of the runs, then the lowest and the highest of them, in microseconds."""
    return spread(values, 1, 8, scale=1e6)


def round_trip(conn, reps: int) -> float:
    """A bare request and reply between the two processes: the floor under
    any scheme that asks the exporter for something."""
    conn.send(("ping", None, reps))
    for _ in range(reps):
        conn.send(conn.recv())
    return _median(conn.recv())


def measure(conn, size: int, reps: int) -> dict[str, float]:
    buf = gs.allocate(size, device="host")
    np.asarray(buf)[:] = 1
    desc = gs.export_buffer(buf)
    conn.send(("gpushare", desc, reps))
    gs_time = _median(conn.recv())
    buf.close()

    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        np.ndarray((size,), dtype=np.uint8, buffer=shm.buf)[:] = 1
        conn.send(("shm", (shm.name, size), reps))
        shm_time = _median(conn.recv())
    finally:
        shm.close()
        shm.unlink()

    arr = np.ones(size, dtype=np.uint8)
    pickle_reps = max(1, reps // 10) if size >= 64 * MiB else reps
    conn.send(("pickle", None, pickle_reps))
    starts = []
    for _ in range(pickle_reps):
        starts.append(time.perf_counter())
        conn.send(arr)
    ends = conn.recv()
    pickle_time = _median([e - s for s, e in zip(starts, ends, strict=True)])
    return {"gpushare": gs_time, "shm": shm_time, "pickle": pickle_time}


def measure_device(conn, size: int, reps: int, device: int) -> dict[str, float]:
    """Open times of a device buffer: VMM through posix-fd, and a cuda.core
    memory-pool buffer through legacy CUDA IPC."""
    from cuda.core import Device

    out = {}
    vmm = gs.allocate(size, device=device)
    conn.send(("device", gs.export_buffer(vmm, handle_type="posix-fd"), reps))
    out["posix-fd"] = _median(conn.recv())
    vmm.close()
    dev = Device(device)
    dev.set_current()
    pooled = dev.allocate(size)
    conn.send(("device", gs.export_buffer(pooled, handle_type="cuda-ipc"), reps))
    out["cuda-ipc"] = _median(conn.recv())
    pooled.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also 1 GiB (needs about 4 GiB of memory)")
    parser.add_argument("--runs", type=int, default=5, help="runs of every measurement (median, lowest-highest)")
    parser.add_argument("--reps", type=int, default=50, help="repetitions per measurement in a run (median)")
    parser.add_argument(
        "--device", type=int, default=None, help="also time device buffers on this CUDA device"
    )
    args = parser.parse_args()
    sizes = [4 * KiB, 64 * MiB] + ([1 * GiB] if args.large else [])

    ctx = mp.get_context("spawn")
    conn, theirs = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(theirs,), daemon=True)
    proc.start()
    try:
        print(
            f"median of {args.runs} runs (lowest-highest), a run the median of {args.reps} opens; microseconds"
        )
        print(
            f"{'size':>8} {'gpushare':>24} {'shm attach':>24} {'pickle':>32} {'gs/shm':>7} {'pickle/gs':>10}"
        )
        for size in sizes:
            runs = [measure(conn, size, args.reps) for _ in range(args.runs)]
            r = {key: [run[key] for run in runs] for key in runs[0]}
            med = {key: statistics.median(values) for key, values in r.items()}
            label = (
                f"{size // GiB} GiB"
                if size >= GiB
                else f"{size // MiB} MiB"
                if size >= MiB
                else f"{size // KiB} KiB"
            )
            print(
                f"{label:>8} {_fmt(r['gpushare']):>24} {_fmt(r['shm']):>24} {_fmt(r['pickle']):>32}"
                f" {med['gpushare'] / med['shm']:>7.2f} {med['pickle'] / med['gpushare']:>10.1f}"
            )
        print("targets: gs/shm <= 2.00; pickle/gs >= 100 at 64 MiB")
        if args.device is not None:
            print(f"device {args.device}: {'size':>8} {'posix-fd':>26} {'cuda-ipc':>26}")
            for size in sizes:
                runs = [measure_device(conn, size, args.reps, args.device) for _ in range(args.runs)]
                r = {key: [run[key] for run in runs] for key in runs[0]}
                print(f"{'':>9} {size:>8} {_fmt(r['posix-fd']):>26} {_fmt(r['cuda-ipc']):>26}")
        floor = [round_trip(conn, 200) for _ in range(args.runs)]
        print(
            f"a bare request/reply between these processes takes {_fmt(floor).strip()} us: "
            "the floor under an open that asks the exporter's broker"
        )
    finally:
        conn.send(("exit", None, 0))
        proc.join(10)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
