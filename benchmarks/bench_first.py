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

``--cuda`` measures instead the first export and the first open of 1 MiB
of CUDA memory (an array over ``cuMemAlloc`` memory, as CuPy's allocator
gives it, handed over by ``__cuda_array_interface__``): each in a fresh
process whose CUDA context is made before the clock starts, so that what is
timed is gpushare's own first use (the targets: at most 20 ms for the export,
30 ms for the open; no cuda.core imported on the way).  It runs on a GPU or
against the CUDA driver stand-in (``LD_LIBRARY_PATH`` at its build), where
the suite runs it (``tests/test_first_use.py``).

Run: ``python benchmarks/bench_first.py [--runs 5] [--cuda]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time

# The benchmarks' helpers, also when Python does not put the script's folder on sys.path (-P, PYTHONSAFEPATH).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import spread  # noqa: E402

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


# -- CUDA memory: first export and first open beyond making the context ----------------------


class _CudaArray:
    """Device memory as CuPy hands it over: ``__cuda_array_interface__`` (version 3, nothing pending)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


def _context_and_memory(n: int) -> int:
    """Make the CUDA context (and, for the exporter, allocate ``n`` bytes as CuPy's allocator does)."""
    from gpushare._cuda import _driver

    drv = _driver.driver()
    with _driver.on_device(0):
        if not n:
            return 0
        ptr = int(_driver.check(drv.cuMemAlloc(n), "cuMemAlloc"))
        _driver.check(drv.cuMemsetD8(ptr, 7, n), "cuMemsetD8")
        _driver.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    return ptr


def _cuda_exporter(conn, kind: str) -> None:
    import gpushare as gs

    if kind == "allocate":
        _context_and_memory(0)
        obj: object = gs.allocate(2 * MiB, device=0)
    else:
        obj = _CudaArray(_context_and_memory(MiB), MiB)
    t0 = time.perf_counter()
    share = gs.export(obj)
    t1 = time.perf_counter()
    conn.send((t1 - t0, share.to_bytes(), "cuda.core" in sys.modules))
    conn.recv()


def _cuda_importer(conn, data: bytes) -> None:
    import gpushare as gs

    _context_and_memory(0)
    share = gs.Share.from_bytes(data)
    t0 = time.perf_counter()
    view = gs.open(share)
    t1 = time.perf_counter()
    conn.send((t1 - t0, view.path, "cuda.core" in sys.modules))
    view.close()
    conn.recv()


def cuda_run(kind: str) -> dict:
    ctx = mp.get_context("spawn")
    exp_parent, exp_child = ctx.Pipe()
    imp_parent, imp_child = ctx.Pipe()
    exporter = ctx.Process(target=_cuda_exporter, args=(exp_child, kind))
    exporter.start()
    first_export, data, exp_core = exp_parent.recv()
    importer = ctx.Process(target=_cuda_importer, args=(imp_child, data))
    importer.start()
    first_open, path, imp_core = imp_parent.recv()
    imp_parent.send(None)
    exp_parent.send(None)
    importer.join(30)
    exporter.join(30)
    return {"export": first_export, "open": first_open, "path": path,
            "cuda.core": imp_core if kind == "allocate" else exp_core or imp_core}


#: First use of CUDA memory, beyond making the context: the targets (seconds).
FIRST_EXPORT, FIRST_OPEN = 0.020, 0.030


def cuda_main(runs: int) -> None:
    """The first export and the first open of CUDA memory (1 MiB of a CuPy-style array over
    ``cuMemAlloc``; a 2 MiB ``gs.allocate`` buffer), each in a fresh process whose CUDA context is made
    before the clock starts."""
    print(f"first use of CUDA memory in fresh processes, the context made before the clock; ms, median of {runs} "
          "runs (lowest-highest)")
    print(f"{'memory':>30} {'path':>9} {'first export':>20} {'first open':>20} {'cuda.core loaded':>17}")
    targets = []
    for label, kind in (("cuMemAlloc array, 1 MiB", "array"), ("gs.allocate buffer, 2 MiB", "allocate")):
        rows = [cuda_run(kind) for _ in range(runs)]
        export = statistics.median(r["export"] for r in rows)
        opened = statistics.median(r["open"] for r in rows)
        core = any(r["cuda.core"] for r in rows)
        print(f"{label:>30} {rows[0]['path']:>9} {_ms([r['export'] for r in rows]):>20} "
              f"{_ms([r['open'] for r in rows]):>20} {'yes' if core else 'no':>17}")
        if kind == "array":  # gs.allocate's exporter made its buffer with cuda.core, as it must
            targets.append(f"{label}: first export <= {FIRST_EXPORT * 1e3:.0f} ms: {export * 1e3:.1f} ms  "
                           f"{'PASS' if export <= FIRST_EXPORT else 'BELOW'}")
        targets.append(f"{label}: first open <= {FIRST_OPEN * 1e3:.0f} ms, no cuda.core: {opened * 1e3:.1f} ms  "
                       f"{'PASS' if opened <= FIRST_OPEN and (kind == 'allocate' or not core) else 'BELOW'}")
    print("targets")
    for line in targets:
        print("  " + line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cuda", action="store_true",
                    help="instead: the first export and open of CUDA memory (a GPU, or the CUDA driver stand-in)")
    args = ap.parse_args()
    os.environ.setdefault("GPUSHARE_AUTHKEY", secrets.token_hex(16))  # two programs that trust each other
    if args.cuda:
        cuda_main(args.runs)
        return
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
