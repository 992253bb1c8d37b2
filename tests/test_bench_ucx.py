"""The UCX benchmarks run to the end and print every row (smoke checks: no figure is judged
here; the ratios are the benchmarks' to print, see docs/ucx.md, "Performance")."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def test_bench_ucx_one_node_prints_a_row_per_size_and_way_of_posting():
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_ucx.py"), "--quick", "--runs", "1",
                        "--setting", "one node, all transports"],
                       capture_output=True, text=True, timeout=600, cwd=BENCH)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "failed" not in r.stdout, r.stdout[-3000:]
    for size in ("4 KiB", "64 KiB", "1 MiB", "64 MiB"):
        for op in ("put", "put plan", "get", "get plan"):
            row = re.search(rf"^\s+{size}\s+{op}\s+\d+ \(\d+-\d+\)\s+\d+ \(\d+-\d+\)\s+\d+\.\d\d$", r.stdout, re.M)
            assert row, (size, op, r.stdout[-3000:])
    assert re.search(r"8 B get latency: gpushare \d+\.\d", r.stdout), r.stdout[-1000:]


def test_the_seed_comparisons_gpushare_side_measures_puts_batches_and_plans():
    code = ("import sys; sys.path.insert(0, '.'); import bench_nixl\n"
            "if __name__ == '__main__':\n"
            "    r = bench_nixl.seed_run(True, None)\n"
            "    print(sorted((k, s) for k, s in r if r[(k, s)] > 0))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=BENCH,
                       env={**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    expected = sorted((k, s) for k in ("put", "batch", "plan") for s in (4096, 65536, 1 << 20))
    assert r.stdout.strip().splitlines()[-1] == str(expected)
