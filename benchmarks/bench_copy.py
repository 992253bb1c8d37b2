"""View.get / View.put on one node, per path, against memcpy in the same run.

One exporter process, one importer process.  For each size, the importer
times ``view.get(dst)`` and ``view.put(src)`` over:

* host-fd (memory from ``gpushare.empty``: mapped, so get/put are a memcpy
  plus gpushare's per-call cost),
* cma (a plain NumPy array: the exporter copies with process_vm_readv/writev),
* ucx-rma (the same plain array over UCX on TCP, which a same-node peer gets
  only when cma cannot be used),

and ``numpy.copyto`` between two arrays of its own (memcpy, destination
pages already touched, as they are for the get's destination).  Every row is
the median of ``--runs`` runs of ``--reps`` transfers each, with the spread
(lowest to highest run) and the ratio of medians against memcpy.  Unit:
GB/s = 10^9 bytes per second.

Targets: host-fd get/put at 1 MiB at least 0.9x memcpy; cma get/put at
64 MiB at least 0.8x memcpy.

Run: ``python benchmarks/bench_copy.py [--runs 5] [--reps N] [--sizes 262144,1048576,67108864]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import warnings

import numpy as np

import gpushare as gs

from _report import spread

KiB, MiB = 1 << 10, 1 << 20


def _rate(fn, nbytes: int, reps: int) -> float:
    fn()  # first touch, connection, UCX load: not timed
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def _importer(conn, runs: int) -> None:
    warnings.simplefilter("ignore", gs.SlowPathWarning)  # ucx-rma is asked for on purpose here
    while True:
        msg = conn.recv()
        if msg is None:
            return
        share, prefer, reps = msg
        view = gs.open(share, prefer=prefer)
        n = share.nbytes
        dst = np.ones(n, np.uint8)
        src = np.full(n, 3, np.uint8)
        other = np.ones(n, np.uint8)
        rows = {"memcpy": [], "get": [], "put": []}
        for _ in range(runs):
            rows["memcpy"].append(_rate(lambda: np.copyto(other, src), n, reps))
            rows["get"].append(_rate(lambda: view.get(dst), n, reps))
            rows["put"].append(_rate(lambda: view.put(src), n, reps))
        path = view.path
        view.close()
        conn.send((path, rows))


def _fmt(values: list[float]) -> str:
    return spread(values, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--reps", type=int, default=0, help="transfers per run (default: about 256 MiB a run)")
    ap.add_argument("--sizes", default=f"{256 * KiB},{MiB},{64 * MiB}")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_importer, args=(child, args.runs))
    proc.start()
    print(f"get/put from another process on this node; median of {args.runs} runs (lowest-highest), GB/s = 1e9 B/s")
    print(f"{'size':>8} {'path':>8} {'memcpy':>22} {'get':>22} {'put':>22} {'get/memcpy':>10} {'put/memcpy':>10}")
    try:
        for n in sizes:
            reps = args.reps or max(3, (256 * MiB) // n)
            mapped = gs.empty(n, np.uint8)
            mapped[:] = 1
            plain = np.ones(n, np.uint8)
            for share, prefer in ((gs.export(mapped), None), (gs.export(plain), None),
                                  (gs.export(plain), "ucx-rma")):
                parent.send((share, prefer, reps if prefer is None else max(3, reps // 8)))
                path, rows = parent.recv()
                mem = statistics.median(rows["memcpy"])
                label = f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"
                print(f"{label:>8} {path:>8} {_fmt(rows['memcpy']):>22} {_fmt(rows['get']):>22} "
                      f"{_fmt(rows['put']):>22} {statistics.median(rows['get']) / mem:>9.2f}x "
                      f"{statistics.median(rows['put']) / mem:>9.2f}x")
    finally:
        parent.send(None)
        proc.join(30)


if __name__ == "__main__":
    main()
