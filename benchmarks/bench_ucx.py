"""gpushare's UCX put/get against ucx_perftest, same transport, same run.

Run: ``python benchmarks/bench_ucx.py`` (``--quick`` for a short run).

For each transport setting, ucx_perftest (shipped in the libucx wheel) and
gpushare run between two processes on this machine with the same UCX_TLS and
the same error-handling mode, and the script prints, per message size, the
bandwidth of each and the ratio gpushare / ucx_perftest (higher is better;
the target is >= 0.9 from 64 KiB up), then the small-message latency of a
get and the ratio gpushare / ucx_perftest (lower is better).

Settings measured:

* ``tcp, error handling``: gpushare's default ``Agent()`` forced to TCP;
  perftest with ``-e``.
* ``tcp, no error handling``: ``Agent(error_handling=False)``; perftest without ``-e``.
* ``shared memory``: ``Agent(transports="sm,self", error_handling=False)``:
  only without error handling can UCX use cross-memory attach (cma); perftest
  with the same UCX_TLS and no ``-e``.
* ``shared memory, polling``: the same with ``progress="polling"`` on both
  sides: shared-memory transports cannot wake a sleeping progress thread, so
  the default blocking mode pays up to a millisecond per round trip there.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 64 * MiB]
SETTINGS = [
    ("tcp, error handling", "tcp", True),
    ("tcp, no error handling", "tcp", False),
    ("shared memory", "sm,self", False),
    ("shared memory, polling", "sm,self", False),
]


def _perftest_paths() -> tuple[str, dict]:
    import libucx

    root = Path(libucx.__file__).parent
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{root / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    return str(root / "bin" / "ucx_perftest"), env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perftest(test: str, size: int, iters: int, tls: str, error_handling: bool) -> tuple[float, float]:
    """Run ucx_perftest; return (overall bandwidth MB/s, average overhead usec)."""
    exe, env = _perftest_paths()
    env["UCX_TLS"] = tls
    port = _free_port()
    flags = ["-e"] if error_handling else []
    server = subprocess.Popen([exe, "-p", str(port), *flags], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(
            [exe, "127.0.0.1", "-p", str(port), *flags, "-t", test, "-s", str(size), "-n", str(iters)],
            env=env, capture_output=True, text=True, timeout=300,
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("Final:")), None)
        if line is None:
            raise RuntimeError(f"ucx_perftest {test} failed: {out.stdout[-400:]} {out.stderr[-400:]}")
        fields = line.split()
        # Final: iters  lat50  lat_avg  lat_overall  bw_avg  bw_overall  rate_avg rate_overall
        return float(fields[6]), float(fields[3])
    finally:
        server.kill()
        server.wait(10)


def _exporter(conn, tls: str, error_handling: bool, size: int, progress: str) -> None:
    from gpushare import ucx

    with ucx.Agent(transports=tls, error_handling=error_handling, progress=progress) as agent:
        mh = agent.create_memory_handle(size)
        conn.send((agent.address, mh.create_remote_key().serialize()))
        conn.recv()


def gpushare_bw(ep, rk, op: str, size: int, iters: int, window: int = 512) -> float:
    import numpy as np

    buf = np.ones(size, np.uint8)
    fn = ep.mem_put if op == "put" else ep.mem_get
    inflight = []
    t0 = time.perf_counter()
    for _ in range(iters):
        inflight.append(fn(buf, rk.base_address, rk))
        if len(inflight) >= window:
            inflight.pop(0).wait(120)
    for r in inflight:
        r.wait(120)
    ep.flush().wait(120)
    return size * iters / (time.perf_counter() - t0) / 1e6


def gpushare_lat(ep, rk, iters: int) -> float:
    buf = bytearray(8)
    t0 = time.perf_counter()
    for _ in range(iters):
        ep.mem_get(buf, rk.base_address, rk).wait(60)
    return (time.perf_counter() - t0) / iters * 1e6


def _iters(size: int, quick: bool) -> int:
    budget = (64 if quick else 512) * MiB
    return max(4, min(20000, budget // size))


def run(settings, sizes, trials: int, quick: bool) -> None:
    from gpushare import ucx

    ctx = mp.get_context("spawn")
    print(f"UCX {'.'.join(map(str, ucx.ucx_version()))}, {os.cpu_count()} CPUs; best of {trials} trials\n")
    for name, tls, eh in settings:
        print(f"== {name} (UCX_TLS={tls}, error handling {'on' if eh else 'off'})")
        parent, child = ctx.Pipe()
        progress = "polling" if "polling" in name else "blocking"
        proc = ctx.Process(target=_exporter, args=(child, tls, eh, max(sizes), progress), daemon=True)
        proc.start()
        try:
            address, key = parent.recv()
            with ucx.Agent(transports=tls, error_handling=eh, progress=progress) as agent:
                ep = agent.connect(address)
                rk = ep.unpack_remote_key(key)
                lane = next((ln.strip("# ").strip() for ln in ep.transport_info().splitlines() if "lane[0]" in ln), "?")
                print(f"   gpushare endpoint: {lane}")
                print(f"   {'size':>8} {'op':>4} {'gpushare MB/s':>14} {'perftest MB/s':>14} {'ratio':>6}")
                for size in sizes:
                    n = _iters(size, quick)
                    for op, test in (("put", "ucp_put_bw"), ("get", "ucp_get")):
                        try:
                            ref = max(perftest(test, size, n, tls, eh)[0] for _ in range(trials))
                        except Exception as exc:  # noqa: BLE001 - report and go on
                            print(f"   {size:>8} {op:>4} perftest failed: {exc}")
                            continue
                        got = max(gpushare_bw(ep, rk, op, size, n) for _ in range(trials))
                        print(f"   {_fmt(size):>8} {op:>4} {got:14.0f} {ref:14.0f} {got / ref:6.2f}")
                li = 2000 if quick else 10000
                ref_lat = min(perftest("ucp_get", 8, li, tls, eh)[1] for _ in range(trials))
                got_lat = min(gpushare_lat(ep, rk, li) for _ in range(trials))
                print(f"   8 B get latency: gpushare {got_lat:.1f} us, perftest {ref_lat:.1f} us, "
                      f"ratio {got_lat / ref_lat:.2f} (lower is better)\n")
                ep.close()
        except Exception as exc:  # noqa: BLE001
            print(f"   setting failed: {exc}\n")
        finally:
            parent.send("done")
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _fmt(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer iterations and trials")
    p.add_argument("--setting", choices=[s[0] for s in SETTINGS], action="append",
                   help="only these settings (repeatable)")
    args = p.parse_args()
    settings = [s for s in SETTINGS if not args.setting or s[0] in args.setting]
    run(settings, SIZES, trials=1 if args.quick else 3, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
