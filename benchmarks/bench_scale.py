"""The control plane at scale: one exporter, N shares, M importers opening all of them.

Run: ``python benchmarks/bench_scale.py`` (about three minutes on two
cores); ``--n 1,100 --m 1,4 --paths host-fd`` to choose, ``--quick`` for a
short run.

This process exports N shares of 1 MiB each (host-fd: host memory from
``gpushare.allocate(device="host")``; ucx-rma: plain NumPy arrays) with
``lifetime="revoked"``.  M importer processes (spawned) each open all N,
keep them open, and read each once (one 1 MiB ``get`` per share).  While
every view is open the table shows, per row:

* ``first ms``: the first open in an importer (connect, hello, open), the
  worst importer; ``open ms``: the median of the further opens, and their
  99th percentile, over all importers;
* ``get ms``: the mean time of one 1 MiB get after the first (the first in
  a process also loads libraries; the slowest is given below the table);
* threads (NumPy's BLAS thread included), file descriptors and resident
  memory of the exporter and of the largest importer; resident memory counts
  the shared pages each has touched, so mapped views count their whole
  buffer;
* ``idle CPU``: CPU time over one second with every view open and nothing
  happening, in percent of one core (exporter; largest importer).

ucx-rma goes through each process's one UCX worker (the region server): a
share is a region and each lease a key, so threads and file descriptors grow
with importers, not with shares.  ``--rma-cap`` still bounds its rows, for
short runs (no bound by default).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time

MiB = 1 << 20
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stats(pid: int | str = "self") -> dict:
    """Threads, fds, RSS (MiB) and CPU seconds of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {
        "threads": int(status["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "cpu_s": (int(fields[11]) + int(fields[12])) / _TICK,
    }


def _importer(conn, shares: list, path: str) -> None:
    import numpy as np

    import gpushare as gs

    try:
        views, times = [], []
        for share in shares:
            t0 = time.perf_counter()
            views.append(gs.open(share, prefer=[path]))
            times.append(time.perf_counter() - t0)
        taken = sorted({v.path for v in views})
        dst = np.empty(MiB, np.uint8)
        t0 = time.perf_counter()
        views[0].get(dst)
        first_get_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for view in views[1:]:
            view.get(dst)
        get_s = (time.perf_counter() - t0) / (len(views) - 1) if len(views) > 1 else float("nan")
        conn.send({"times": times, "paths": taken, "get_s": get_s, "first_get_s": first_get_s,
                   **_proc_stats()})
        conn.recv()  # the parent measured the idle processes
        for view in views:
            view.close()
        conn.send("closed")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _export(path: str, n: int) -> tuple[list, list]:
    import numpy as np

    import gpushare as gs

    objs, shares = [], []
    for _ in range(n):
        obj = gs.allocate(MiB, device="host") if path == "host-fd" else np.zeros(MiB, np.uint8)
        if path == "host-fd":
            np.asarray(obj)[:] = 1
        objs.append(obj)
        shares.append(gs.export(obj, lifetime="revoked", paths=[path]))
    return objs, shares


def _row(path: str, n: int, m: int, shares: list, timeout: float, first_gets: dict) -> str:
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for _ in range(m):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_importer, args=(child, shares, path), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        deadline = time.monotonic() + timeout
        results = []
        for conn in conns:
            if not conn.poll(max(deadline - time.monotonic(), 0.1)):
                return f"{path:>8} {n:>5} {m:>3}  timed out after {timeout:.0f} s"
            results.append(conn.recv())
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            return f"{path:>8} {n:>5} {m:>3}  failed: {errors[0][:100]}"
        taken = sorted({p for r in results for p in r["paths"]})
        if taken != [path]:
            return f"{path:>8} {n:>5} {m:>3}  opened over {taken}, not {path}"
        mine = _proc_stats()
        theirs = [_proc_stats(p.pid) for p in procs]
        time.sleep(1.0)
        mine_idle = _proc_stats()["cpu_s"] - mine["cpu_s"]
        their_idle = max(_proc_stats(p.pid)["cpu_s"] - t["cpu_s"] for p, t in zip(procs, theirs))
        for conn in conns:
            conn.send("go")
        for conn in conns:
            if conn.poll(timeout):
                conn.recv()
        first = max(r["times"][0] for r in results) * 1e3
        further = sorted(t for r in results for t in r["times"][1:])
        med = statistics.median(further) * 1e3 if further else float("nan")
        p99 = further[int(len(further) * 0.99)] * 1e3 if further else float("nan")
        get_ms = statistics.mean(r["get_s"] for r in results) * 1e3
        first_gets[path] = max([first_gets.get(path, 0.0)] + [r["first_get_s"] * 1e3 for r in results])
        big = max(results, key=lambda r: r["rss_mib"])
        return (f"{path:>8} {n:>5} {m:>3} {first:>8.1f} {med:>7.2f} {p99:>7.2f} {get_ms:>7.3f}"
                f" {mine['threads']:>5} {mine['fds']:>6} {mine['rss_mib']:>7.0f} {mine_idle * 100:>5.1f}"
                f" {max(r['threads'] for r in results):>5} {max(r['fds'] for r in results):>6}"
                f" {big['rss_mib']:>7.0f} {their_idle * 100:>5.1f}")
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=_ints, default=[1, 100, 1000, 2000], help="shares, comma-separated")
    p.add_argument("--m", type=_ints, default=[1, 4, 16], help="importer processes, comma-separated")
    p.add_argument("--paths", default="host-fd,ucx-rma", help="host-fd and/or ucx-rma")
    p.add_argument("--rma-cap", type=int, default=1 << 30, help="most shares in a ucx-rma row")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one row may take")
    p.add_argument("--quick", action="store_true", help="N = 1, 100; M = 1, 4")
    args = p.parse_args()
    if args.quick:
        args.n, args.m = [1, 100], [1, 4]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    for path in paths:
        if path not in ("host-fd", "ucx-rma"):
            p.error(f"unknown path {path!r}; choose host-fd and/or ucx-rma")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    import gpushare as gs
    from gpushare import _exporter

    print(f"one exporter (pid {os.getpid()}), N shares of 1 MiB, M importers each opening all N; "
          f"{os.cpu_count()} CPUs\n")
    print(f"{'':>18} {'open: first':>12} {'further':>15} {'':>7} {'exporter':^26} {'largest importer':^26}")
    print(f"{'path':>8} {'N':>5} {'M':>3} {'ms':>8} {'median':>7} {'p99':>7} {'get ms':>7}"
          f" {'thr':>5} {'fds':>6} {'RSS MiB':>7} {'idle%':>5} {'thr':>5} {'fds':>6} {'RSS MiB':>7} {'idle%':>5}")
    notes: list[str] = []
    first_gets: dict[str, float] = {}
    for path in paths:
        for n in args.n:
            if path == "ucx-rma" and n > args.rma_cap:
                notes.append(f"ucx-rma with N={n} skipped: --rma-cap {args.rma_cap}")
                continue
            objs, shares = _export(path, n)
            try:
                for m in args.m:
                    print(_row(path, n, m, shares, args.timeout, first_gets), flush=True)
            finally:
                for share in shares:
                    share.revoke()
                for obj in objs:
                    if hasattr(obj, "close"):
                        obj.close()
                del objs
            # The importers have exited: their connections' ends reach the
            # exporter's service thread a moment later.
            t0 = time.monotonic()
            stats = _exporter.get_exporter().stats()
            while (stats["exports"] or stats["leases"]) and time.monotonic() - t0 < 120:
                time.sleep(0.1)
                stats = _exporter.get_exporter().stats()
            if stats["exports"] or stats["leases"]:
                notes.append(f"after {path} N={n}: exporter still holds {stats} after 120 s")
            else:
                notes.append(f"after {path} N={n}: every lease and export gone {time.monotonic() - t0:.1f} s "
                             "after the importers exited")
    print()
    for path, ms in first_gets.items():
        notes.append(f"the first get in an importer over {path} took up to {ms:.0f} ms")
    for note in notes:
        print("note:", note)
    print(f"exporter threads at the end: {threading.active_count()} "
          f"({', '.join(sorted(t.name for t in threading.enumerate()))})")
    del gs
    return 0


if __name__ == "__main__":
    sys.exit(main())
