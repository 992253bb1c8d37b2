"""The first share in a process: what a fresh exporter and a fresh importer
pay for their first ``gs.export``, ``gs.open`` and copy.

Each run starts two new processes (spawn): the exporter imports gpushare and
exports 1 MiB; the importer imports gpushare, opens the share and copies it
out once.  Timed: the first export, the first open, the first get, and
whether the importer loaded UCX (only ucx-rma needs it).  Interpreter
start-up and ``import gpushare`` are reported apart: every Python program
pays them.  Reference, measured in the same run the same way: a
``multiprocessing.shared_memory`` segment created in the first process and
attached and copied in the second.  Rows: memory from ``gs.empty`` (host-fd),
a plain NumPy array (cma), and a plain array with ``prefer="ucx-rma"``.

Times in milliseconds, median of ``--runs`` runs (lowest-highest).
Target: first export + first open + first get at most 50 ms together, with
no UCX load unless the path is ucx-rma.

Run: ``python benchmarks/bench_first.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time

from _report import spread

MiB = 1 << 20


def _ms(values: list[float]) -> str:
    return spread(values, 1, scale=1e3)


def _exporter(conn, kind: str) -> None:
    t0 = time.perf_counter()
    import numpy as np

    import gpushare as gs

    t1 = time.perf_counter()
    if kind == "shm":
        from multiprocessing import shared_memory

        seg = shared_memory.SharedMemory(create=True, size=MiB)
        np.ndarray(MiB, np.uint8, seg.buf)[:] = 1
        t2 = time.perf_counter()
        conn.send((t1 - t0, t2 - t1, seg.name))
    else:
        a = gs.zeros(MiB, np.uint8) if kind == "gs.empty" else np.ones(MiB, np.uint8)
        t2 = time.perf_counter()
        share = gs.export(a)
        t3 = time.perf_counter()
        conn.send((t1 - t0, t3 - t2, share.to_bytes()))
    conn.recv()  # until the importer is done
    if kind == "shm":
        seg.close()
        seg.unlink()


def _importer(conn, kind: str, data, prefer: str | None) -> None:
    t0 = time.perf_counter()
    import numpy as np

    import gpushare as gs

    t1 = time.perf_counter()
    out = np.empty(MiB, np.uint8)
    if kind == "shm":
        from multiprocessing import shared_memory

        seg = shared_memory.SharedMemory(name=data, track=False) if sys.version_info >= (3, 13) else \
            shared_memory.SharedMemory(name=data)
        t2 = time.perf_counter()
        np.copyto(out, np.ndarray(MiB, np.uint8, seg.buf))
        t3 = time.perf_counter()
        seg.close()
        conn.send((t1 - t0, t2 - t1, t3 - t2, "shm", False))
        return
    share = gs.Share.from_bytes(data)
    view = gs.open(share, prefer=prefer)
    t2 = time.perf_counter()
    view.get(out)
    t3 = time.perf_counter()
    conn.send((t1 - t0, t2 - t1, t3 - t2, view.path, "gpushare._ucx._native" in sys.modules))
    view.close()


def _run(kind: str, prefer: str | None) -> dict:
    ctx = mp.get_context("spawn")
    exp_parent, exp_child = ctx.Pipe()
    imp_parent, imp_child = ctx.Pipe()
    start = time.perf_counter()
    exporter = ctx.Process(target=_exporter, args=(exp_child, "shm" if kind == "shm" else kind))
    exporter.start()
    exp_import, first_export, data = exp_parent.recv()
    importer = ctx.Process(target=_importer, args=(imp_child, kind, data, prefer))
    importer.start()
    imp_import, first_open, first_get, path, ucx = imp_parent.recv()
    exp_parent.send(None)
    importer.join(30)
    exporter.join(30)
    del start
    return {"import": max(exp_import, imp_import), "export": first_export, "open": first_open, "get": first_get,
            "path": path, "ucx": ucx}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("GPUSHARE_AUTHKEY", secrets.token_hex(16))  # two programs that trust each other
    rows = [("shared_memory (reference)", "shm", None), ("gs.empty (host-fd)", "gs.empty", None),
            ("plain NumPy (cma)", "numpy", None), ("plain NumPy, ucx-rma", "numpy", "ucx-rma")]
    print(f"first use in fresh processes, 1 MiB; ms, median of {args.runs} runs (lowest-highest)")
    print(f"{'memory':>26} {'path':>8} {'import':>20} {'first export':>20} {'first open':>20} {'first get':>20}"
          f" {'together':>20} {'/ reference':>11} {'UCX loaded':>10}")
    reference = None
    for label, kind, prefer in rows:
        runs = [_run(kind, prefer) for _ in range(args.runs)]
        together = [r["export"] + r["open"] + r["get"] for r in runs]
        if reference is None:
            reference = statistics.median(together)
        print(f"{label:>26} {runs[0]['path']:>8} {_ms([r['import'] for r in runs]):>20} "
              f"{_ms([r['export'] for r in runs]):>20} {_ms([r['open'] for r in runs]):>20} "
              f"{_ms([r['get'] for r in runs]):>20} {_ms(together):>20} "
              f"{statistics.median(together) / reference:>10.1f}x {str(any(r['ucx'] for r in runs)):>10}")
    print("(import: interpreter start-up excluded, `import gpushare` and numpy included; shared_memory: "
          "create + fill as export, attach as open, copy as get)")


if __name__ == "__main__":
    main()
