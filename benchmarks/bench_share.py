"""Open latency and copy bandwidth through every path this machine has.

Run: ``python benchmarks/bench_share.py`` (``--quick`` for a short run).

The exporter (this process) shares a buffer; an importer in a second process
opens it through each available path and copies out (get) and in (put).
Each path is printed beside its reference, measured in the same run:
``memcpy`` (NumPy copy between two buffers of the importer) for mapped host
views, ``ucx_perftest`` on the same transport for ucx-rma.  Ratios are
gpushare / reference (higher is better for bandwidth).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MiB = 1 << 20


def _importer(conn, share, path: str, opens: int, repeat: int) -> None:
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
    gets, puts, refs = [], [], []
    for _ in range(repeat):
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
    conn.send({"path": got, "open_ms": statistics.median(lat) * 1e3, "get_s": min(gets), "put_s": min(puts),
               "memcpy_s": min(refs), "lane": lane})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--size-mib", type=int, default=64)
    args = p.parse_args()
    import gpushare as gs
    from bench_ucx import perftest

    size = args.size_mib * MiB
    opens, repeat = (5, 3) if args.quick else (20, 5)
    buf = gs.allocate(size, device="host")
    share = gs.export(buf, lifetime="revoked")
    ctx = mp.get_context("spawn")
    print(f"{size >> 20} MiB host buffer from gpushare.allocate; open latency is the median of {opens}, "
          f"bandwidth the best of {repeat}\n")
    print(f"{'path':>12} {'open ms':>8} {'get GB/s':>9} {'put GB/s':>9} {'reference':>28} {'get/ref':>8} {'put/ref':>8}")
    for path in [p for p in share.offers if p != "same-process"]:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_importer, args=(child, share, path, opens, repeat), daemon=True)
        proc.start()
        r = parent.recv()
        proc.join(60)
        get_bw, put_bw = size / r["get_s"] / 1e9, size / r["put_s"] / 1e9
        if r["path"] == "ucx-rma":
            iters = 4 if args.quick else 16
            ref_get = perftest("ucp_get", size, iters, "tcp", True)[0] / 1e3
            ref_put = perftest("ucp_put_bw", size, iters, "tcp", True)[0] / 1e3
            ref = f"ucx_perftest tcp {ref_get:.2f}/{ref_put:.2f}"
        else:
            ref_get = ref_put = size / r["memcpy_s"] / 1e9
            ref = f"memcpy {ref_get:.2f}"
        print(f"{r['path']:>12} {r['open_ms']:8.2f} {get_bw:9.2f} {put_bw:9.2f} {ref:>28} "
              f"{get_bw / ref_get:8.2f} {put_bw / ref_put:8.2f}")
        if r["lane"]:
            print(f"{'':>12} ucx-rma lane: {r['lane']}")
    t0 = time.perf_counter()
    for _ in range(opens):
        gs.open(share).close()
    print(f"{'same-process':>12} {(time.perf_counter() - t0) / opens * 1e3:8.3f}  (the original object is handed back)")
    share.revoke()
    buf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
