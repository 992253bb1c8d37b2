"""Pages: allocation and first touch, huge pages, and pre-faulting on import.

Two measurements, each the median of ``--runs`` runs with the spread
(lowest-highest); times in milliseconds:

1. Allocate and fill ``--size`` bytes (default 1 GiB): NumPy's
   ``np.empty(n).fill`` (the reference: NumPy advises transparent huge pages
   for large arrays) against ``gs.empty(n, huge_pages=...)`` + fill for
   ``False`` (4 KiB shared-memory pages), ``"auto"`` (transparent huge pages
   advised; they back the buffer only where
   ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` honours the advice)
   and ``"hugetlb"`` (reserved huge pages, when ``vm.nr_hugepages`` has
   enough free).
2. An importer in another process opens a share of ``--size / 2`` bytes and
   copies all of it once into a buffer of its own (already touched): with
   ``gs.open(share)`` the copy pays a page fault per page; with
   ``gs.open(share, prefault=True)`` the open faults them in, in the kernel.
   Printed: open, first copy, and both together.

``--configure`` (root only): for the length of the run, set shmem THP to
``advise`` and reserve enough huge pages, then put both settings back; it
shows what the settings gain on a machine that allows them.

Run: ``python benchmarks/bench_pages.py [--size BYTES] [--runs 5] [--configure]``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import time

import numpy as np

import gpushare as gs
from gpushare._paths import host_fd

from _report import spread

MiB, GiB = 1 << 20, 1 << 30
THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
NR = "/proc/sys/vm/nr_hugepages"


def _ms(values: list[float]) -> str:
    return spread(values, 1, 8, scale=1e3)


def _fill_numpy(n: int) -> float:
    t = time.perf_counter()
    a = np.empty(n, np.uint8)
    a.fill(1)
    took = time.perf_counter() - t
    del a
    return took


def _fill_gs(n: int, huge: object) -> float:
    t = time.perf_counter()
    a = gs.empty(n, np.uint8, huge_pages=huge)
    a.fill(1)
    took = time.perf_counter() - t
    del a
    return took


def _importer(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        share, prefault = msg
        dst = np.ones(share.nbytes, np.uint8)
        t0 = time.perf_counter()
        view = gs.open(share, prefault=prefault)
        t1 = time.perf_counter()
        view.get(dst)
        t2 = time.perf_counter()
        view.close()
        conn.send((t1 - t0, t2 - t1))


@contextlib.contextmanager
def _configured(enabled: bool, size: int):
    if not enabled:
        yield
        return
    with open(THP) as f:
        thp_before = host_fd.shmem_thp()
    with open(NR) as f:
        nr_before = f.read().strip()
    try:
        with open(THP, "w") as f:
            f.write("advise")
        with open(NR, "w") as f:
            f.write(str(int(nr_before) + 2 * size // host_fd.HUGE + 8))
        yield
    finally:
        with open(THP, "w") as f:
            f.write(thp_before)
        with open(NR, "w") as f:
            f.write(nr_before)


def _settings() -> str:
    free = host_fd._hugetlb_free()
    return f"shmem THP: {host_fd.shmem_thp()}; free reserved huge pages: {free} of {host_fd.HUGE // MiB} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=GiB)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--configure", action="store_true", help="root: allow shmem THP and reserve huge pages for the run")
    args = ap.parse_args()
    n = args.size
    with _configured(args.configure, n):
        print(_settings())
        print(f"\n1. allocate and fill {n // MiB} MiB; median of {args.runs} runs (lowest-highest), ms")
        ref = [_fill_numpy(n) for _ in range(args.runs)]
        print(f"{'numpy.empty + fill':>28} {_ms(ref):>26}   1.00x")
        for huge in (False, "auto", "hugetlb"):
            try:
                with gs.allocate(n, device="host", huge_pages=huge) as probe:
                    granted = probe.huge_pages
            except gs.UnsupportedError as exc:
                print(f"{'gs.empty huge_pages=' + repr(huge):>28}   not available here: {str(exc)[:90]}")
                continue
            times = [_fill_gs(n, huge) for _ in range(args.runs)]
            ratio = statistics.median(ref) / statistics.median(times)
            print(f"{'gs.empty huge_pages=' + repr(huge):>28} {_ms(times):>26}   {ratio:.2f}x as fast"
                  f"   (pages: {granted or '4 KiB'})")

        half = n // 2
        print(f"\n2. another process opens {half // MiB} MiB and copies it once; median of {args.runs} runs, ms")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_importer, args=(child,))
        proc.start()
        try:
            print(f"{'exported with':>24} {'prefault':>9} {'open':>22} {'first copy':>22} {'together':>22}")
            for huge in (False, "auto", "hugetlb"):
                try:
                    src = gs.empty(half, np.uint8, huge_pages=huge)
                except gs.UnsupportedError:
                    continue
                src.fill(2)
                share = gs.export(src)
                for prefault in (False, True):
                    opens, copies = [], []
                    for _ in range(args.runs):
                        parent.send((share, prefault))
                        o, c = parent.recv()
                        opens.append(o)
                        copies.append(c)
                    both = [o + c for o, c in zip(opens, copies, strict=True)]
                    print(f"{'huge_pages=' + repr(huge):>24} {str(prefault):>9} {_ms(opens):>22} {_ms(copies):>22}"
                          f" {_ms(both):>22}")
                del share, src
        finally:
            parent.send(None)
            proc.join(30)


if __name__ == "__main__":
    main()
