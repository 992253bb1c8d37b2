"""Open latency and copy bandwidth through every path this machine has.

Run: ``python benchmarks/bench_share.py [--runs 5] [--size-mib 64]`` (``--quick``
for fewer opens and shorter ucx_perftest runs).

The exporter (this process) shares a buffer; an importer in a second process
opens it through each available path and copies out (get) and in (put).
Each path is printed beside its reference, measured in the same run:
``memcpy`` (NumPy copy between two buffers of the importer) for mapped host
views, ``ucx_perftest`` on the same transport for ucx-rma.  Bandwidths,
gpushare's and the reference's, are the median of ``--runs`` runs
(lowest-highest), a run being one get, one put and one memcpy of the whole
buffer after one of each untimed (or one ucx_perftest run); open latency is the median of the opens
(lowest-highest).  Ratios are gpushare / reference of the medians (higher is
better for bandwidth).  Units: GB/s = 10^9 bytes per second; ms.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

from _report import spread

sys.path.insert(0, str(Path(__file__).parent))

MiB = 1 << 20


def _fmt(values: list[float], digits: int = 2) -> str:
    """The median of the runs, then the lowest and the highest of them."""
    return spread(values, digits)


def _importer(conn, share, path: str, opens: int, runs: int) -> None:
    import numpy as np

    import gpushare as gs

    lat = []
    for _ in range(opens):
        t0 = time.perf_counter()
        view = gs.open(share, prefer=[path])
        lat.append(time.perf_counter() - t0)
        got = view.path
        view.close()
    view = gs.open(share, prefer=[path])
    dst = np.empty(view.nbytes, np.uint8)
    src = np.ones(view.nbytes, np.uint8)
    view.get(dst)  # first touch and first transfer: not timed
    view.put(src)
    np.copyto(dst, src)
    gets, puts, refs = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        view.get(dst)
        gets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        view.put(src)
        puts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        refs.append(time.perf_counter() - t0)
    lane = ""
    if view.path == "ucx-rma":
        lane = next((ln.strip("# ").strip() for ln in view._peer.transport_info().splitlines() if "lane[0]" in ln), "")
    view.close()
    conn.send({"path": got, "open_s": lat, "get_s": gets, "put_s": puts, "memcpy_s": refs, "lane": lane})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs of each bandwidth (median, lowest-highest)")
    p.add_argument("--quick", action="store_true", help="fewer opens, shorter ucx_perftest runs")
    p.add_argument("--size-mib", type=int, default=64)
    args = p.parse_args()
    import gpushare as gs
    from bench_ucx import perftest

    size = args.size_mib * MiB
    opens, runs = (5 if args.quick else 20), args.runs
    buf = gs.allocate(size, device="host")
    share = gs.export(buf, lifetime="revoked")
    ctx = mp.get_context("spawn")
    print(f"{size >> 20} MiB host buffer from gpushare.allocate; open: median of {opens} opens, bandwidth: "
          f"median of {runs} runs, each (lowest-highest); ms, GB/s = 1e9 B/s\n")
    print(f"{'path':>12} {'open ms':>22} {'get GB/s':>22} {'put GB/s':>22} {'reference':>16} {'ref get GB/s':>22}"
          f" {'ref put GB/s':>22} {'get/ref':>8} {'put/ref':>8}")
    for path in [p for p in share.offers if p != "same-process"]:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_importer, args=(child, share, path, opens, runs), daemon=True)
        proc.start()
        r = parent.recv()
        proc.join(60)
        get_bw = [size / t / 1e9 for t in r["get_s"]]
        put_bw = [size / t / 1e9 for t in r["put_s"]]
        if r["path"] == "ucx-rma":
            iters = 4 if args.quick else 16
            # perftest reports MiB/s
            ref_get = [perftest("ucp_get", size, iters, "tcp", True)[0] * MiB / 1e9 for _ in range(runs)]
            ref_put = [perftest("ucp_put_bw", size, iters, "tcp", True)[0] * MiB / 1e9 for _ in range(runs)]
            ref = "ucx_perftest tcp"
        else:
            ref_get = ref_put = [size / t / 1e9 for t in r["memcpy_s"]]
            ref = "memcpy"
        get_ratio = statistics.median(get_bw) / statistics.median(ref_get)
        put_ratio = statistics.median(put_bw) / statistics.median(ref_put)
        print(f"{r['path']:>12} {_fmt([t * 1e3 for t in r['open_s']]):>22} {_fmt(get_bw):>22} {_fmt(put_bw):>22}"
              f" {ref:>16} {_fmt(ref_get):>22} {_fmt(ref_put):>22} {get_ratio:8.2f} {put_ratio:8.2f}")
        if r["lane"]:
            print(f"{'':>12} ucx-rma lane: {r['lane']}")
    same = []
    for _ in range(opens):
        t0 = time.perf_counter()
        gs.open(share).close()
        same.append(time.perf_counter() - t0)
    print(f"{'same-process':>12} {_fmt([t * 1e3 for t in same], 3):>22}  (the original object is handed back)")
    share.revoke()
    buf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
