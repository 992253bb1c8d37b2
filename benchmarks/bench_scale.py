"""The control plane at scale: one exporter, N shares, M importers opening all of them.

Run: ``python benchmarks/bench_scale.py`` (about three minutes on two
cores); ``--n 1,100 --m 1,4 --paths host-fd`` to choose, ``--quick`` for a
short run, ``--runs 3`` to repeat every row.

This process exports N shares of 1 MiB each (host-fd: host memory from
``gpushare.allocate(device="host")``; ucx-rma: plain NumPy arrays) with
``lifetime="revoked"``.  M importer processes (spawned) each open all N,
keep them open, and read each once (one 1 MiB ``get`` per share).  While
every view is open the table shows, per row:

* ``open ms``: ``first``, the first open in an importer (connect, hello,
  open), the worst importer; ``median`` of the further opens, and their
  ``p99`` (99th percentile), over all importers;
* ``get ms``: the mean time of one 1 MiB get after the first (the first in
  a process also loads libraries; the slowest is given below the table);
* threads (NumPy's BLAS thread included), file descriptors and resident
  memory of the exporter and of the largest importer; resident memory counts
  the shared pages each has touched, so mapped views count their whole
  buffer;
* ``idle CPU``: CPU time over one second with every view open and nothing
  happening, in percent of one core (exporter; largest importer).

A row is one run by default.  With ``--runs R`` above 1 every run exports
its N shares anew, and each figure of a row, and the times in the notes
below the table, is the median of the R runs (lowest-highest).  Units: ms;
MiB; percent of one core; threads and fds are counts.

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

from _report import spread

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


def _measure(path: str, n: int, m: int, shares: list, timeout: float) -> dict | str:
    """One run of a row: M importers open all N shares; the row's figures, or why there are none."""
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
                return f"timed out after {timeout:.0f} s"
            results.append(conn.recv())
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            return f"failed: {errors[0][:100]}"
        taken = sorted({p for r in results for p in r["paths"]})
        if taken != [path]:
            return f"opened over {taken}, not {path}"
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
        further = sorted(t for r in results for t in r["times"][1:])
        big = max(results, key=lambda r: r["rss_mib"])
        return {
            "first": max(r["times"][0] for r in results) * 1e3,
            "median": statistics.median(further) * 1e3 if further else float("nan"),
            "p99": further[int(len(further) * 0.99)] * 1e3 if further else float("nan"),
            "get": statistics.mean(r["get_s"] for r in results) * 1e3,
            "first_get": max(r["first_get_s"] for r in results) * 1e3,
            "exp_threads": mine["threads"],
            "exp_fds": mine["fds"],
            "exp_rss": mine["rss_mib"],
            "exp_idle": mine_idle * 100,
            "imp_threads": max(r["threads"] for r in results),
            "imp_fds": max(r["fds"] for r in results),
            "imp_rss": big["rss_mib"],
            "imp_idle": their_idle * 100,
        }
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()


# The table's figures: key, width of a one-run column, digits.
COLUMNS = [
    ("first", 8, 1), ("median", 7, 2), ("p99", 7, 2), ("get", 7, 3),
    ("exp_threads", 5, 0), ("exp_fds", 6, 0), ("exp_rss", 7, 0), ("exp_idle", 5, 1),
    ("imp_threads", 5, 0), ("imp_fds", 6, 0), ("imp_rss", 7, 0), ("imp_idle", 5, 1),
]


def _fmt(values: list[float], digits: int = 2) -> str:
    """One run: its figure; more: the median of the runs, then the lowest and the highest of them."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return spread(values, digits, 0)


def _width(width: int, runs: int) -> int:
    return width if runs == 1 else 2 * width + 6


def _line(path: str, n: int, m: int, runs: list[dict], failure: str | None) -> str:
    """A row of the table: each figure over the runs, or why the row has none."""
    if failure is not None:
        return f"{path:>8} {n:>5} {m:>3}  {failure}"
    cells = [f"{_fmt([r[key] for r in runs], digits):>{_width(width, len(runs))}}"
             for key, width, digits in COLUMNS]
    return f"{path:>8} {n:>5} {m:>3} " + " ".join(cells)


def _header(runs: int) -> str:
    w = {key: _width(width, runs) for key, width, _ in COLUMNS}
    opens = w["first"] + w["median"] + w["p99"] + 2
    exporter = sum(w[k] for k in w if k.startswith("exp_")) + 3
    importer = sum(w[k] for k in w if k.startswith("imp_")) + 3
    labels = ["first", "median", "p99", "get ms", "thr", "fds", "RSS MiB", "idle%", "thr", "fds", "RSS MiB", "idle%"]
    return (f"{'':>18} {'open ms':^{opens}} {'':>{w['get']}} {'exporter':^{exporter}} {'largest importer':^{importer}}\n"
            f"{'path':>8} {'N':>5} {'M':>3} "
            + " ".join(f"{label:>{w[key]}}" for label, (key, _, _) in zip(labels, COLUMNS)))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=_ints, default=[1, 100, 1000, 2000], help="shares, comma-separated")
    p.add_argument("--m", type=_ints, default=[1, 4, 16], help="importer processes, comma-separated")
    p.add_argument("--paths", default="host-fd,ucx-rma", help="host-fd and/or ucx-rma")
    p.add_argument("--rma-cap", type=int, default=1 << 30, help="most shares in a ucx-rma row")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one row may take")
    p.add_argument("--runs", type=int, default=1, help="runs of every row (median, lowest-highest)")
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
    from gpushare._exporter import registry

    runs = "one run" if args.runs == 1 else f"median of {args.runs} runs (lowest-highest)"
    print(f"one exporter (pid {os.getpid()}), N shares of 1 MiB, M importers each opening all N; "
          f"{os.cpu_count()} CPUs; {runs}\n")
    print(_header(args.runs))
    notes: list[str] = []
    first_gets: dict[str, dict[int, float]] = {}  # path: the slowest first get of each run
    for path in paths:
        for n in args.n:
            if path == "ucx-rma" and n > args.rma_cap:
                notes.append(f"ucx-rma with N={n} skipped: --rma-cap {args.rma_cap}")
                continue
            rows: dict[int, list[dict]] = {m: [] for m in args.m}
            failed: dict[int, str] = {}
            gone: list[float] = []
            held: list[dict] = []
            for run in range(args.runs):
                # Every run exports its own N shares and ends them all, so
                # that each run also times how the exporter lets them go.
                objs, shares = _export(path, n)
                try:
                    for m in args.m:
                        if m not in failed:
                            got = _measure(path, n, m, shares, args.timeout)
                            if isinstance(got, str):
                                failed[m] = got
                            else:
                                rows[m].append(got)
                                slowest = first_gets.setdefault(path, {})
                                slowest[run] = max(slowest.get(run, 0.0), got["first_get"])
                        if run == args.runs - 1:
                            print(_line(path, n, m, rows[m], failed.get(m)), flush=True)
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
                stats = registry.get_exporter().stats()
                while (stats["exports"] or stats["leases"]) and time.monotonic() - t0 < 120:
                    time.sleep(0.1)
                    stats = registry.get_exporter().stats()
                if stats["exports"] or stats["leases"]:
                    held.append(stats)
                else:
                    gone.append(time.monotonic() - t0)
            if held:
                notes.append(f"after {path} N={n}: exporter still holds {held[0]} after 120 s"
                             + (f" (in {len(held)} of {args.runs} runs)" if args.runs > 1 else ""))
            else:
                notes.append(f"after {path} N={n}: every lease and export gone {_fmt(gone, 1)} s "
                             "after the importers exited")
    print()
    for path, slowest in first_gets.items():
        notes.append(f"the first get in an importer over {path} took up to {_fmt(list(slowest.values()), 0)} ms"
                     + (" (the slowest of each run)" if args.runs > 1 else ""))
    for note in notes:
        print("note:", note)
    print(f"exporter threads at the end: {threading.active_count()} "
          f"({', '.join(sorted(t.name for t in threading.enumerate()))})")
    del gs
    return 0


if __name__ == "__main__":
    sys.exit(main())
