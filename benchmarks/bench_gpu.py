"""GPU benchmark: needs a CUDA device.  Prints, side by side in one run:

1. a mapped view's device-to-device copy (``View.get`` / ``View.put`` into a
   device buffer, posix-fd path) against ``cuMemcpyDtoD`` between two local
   buffers of the same size, inside one process;
2. import latency: ``gs.open`` of a posix-fd share end to end, and
   ``gs.import_buffer`` of a descriptor;
3. ucx-rma put/get between CUDA buffers against ``ucx_perftest -m cuda`` on
   the same transports.

Unit: MiB/s (2^20 bytes per second) throughout, as ucx_perftest prints;
latencies in microseconds.  Each figure is the median of ``--runs`` runs,
with the spread (min-max) beside it.

Run: ``python benchmarks/bench_gpu.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _report import spread

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MiB = 1 << 20


def _median(samples: list[float]) -> str:
    return spread(samples, 1, 10)


def _timed(fn, iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _importer_setup() -> dict:
    import _share_peer

    return _share_peer.setup()


def mapped_copies(size: int, runs: int, iters: int) -> None:
    import gpushare as gs
    from gpushare._paths import _cuda

    drv = _cuda.driver()
    print(f"\n1. device-to-device copy of {size // MiB} MiB (MiB/s; median (min-max) of {runs})")
    shared = gs.allocate(size, device=0)
    a = gs.allocate(size, device=0)
    b = gs.allocate(size, device=0)
    share = gs.export(shared, lifetime="revoked")
    # Open from this process's point of view as another process would: the
    # same-process path would hand back the buffer itself.
    view = gs.open(share, exclude=["same-process"])
    try:
        def memcpy() -> None:
            with _cuda.on_device(0):
                _cuda.check(drv.cuMemcpyDtoD(int(a.handle), int(b.handle), size), "cuMemcpyDtoD")
                _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")

        rows = {"cuMemcpyDtoD + sync": memcpy, f"view.get ({view.path})": lambda: view.get(a),
                f"view.put ({view.path})": lambda: view.put(b)}
        ref = None
        for name, fn in rows.items():
            samples = [size / MiB / _timed(fn, iters) for _ in range(runs)]
            ref = ref or statistics.median(samples)
            print(f"   {name:28s} {_median(samples)}   ratio {statistics.median(samples) / ref:.2f}")
    finally:
        view.close()
        share.revoke()
        for x in (shared, a, b):
            x.close()


def import_latency(runs: int, iters: int) -> None:
    import gpushare as gs
    from _procs import Child

    print(f"\n2. import latency (us; median (min-max) of {runs})")
    buf = gs.allocate(64 * MiB, device=0)
    share = gs.export(buf, lifetime="revoked")
    desc = gs.export_buffer(buf, handle_type="posix_fd")
    child = Child(_importer_setup, timeout=120)
    try:
        for name, cmd, args in (("gs.open (posix-fd) + close", "open_close", (share,)),
                                ("gs.import_buffer + close", "import_close", (desc,))):
            samples = [child.call(cmd, *args, iters) * 1e6 for _ in range(runs)]
            print(f"   {name:28s} {_median(samples)}")
    finally:
        child.close()
        share.revoke()
        buf.close()


def _perftest_cuda(test: str, size: int, iters: int, tls: str) -> float:
    """ucx_perftest between CUDA buffers (``-m cuda``), error handling on as
    gpushare's agents have it; MiB/s."""
    import subprocess

    import bench_ucx

    exe, env = bench_ucx._perftest_paths()
    env["UCX_TLS"] = tls
    port = str(bench_ucx._free_port())
    flags = ["-e", "-m", "cuda"]
    server = subprocess.Popen([exe, "-p", port, *flags], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run([exe, "127.0.0.1", "-p", port, *flags, "-t", test, "-s", str(size), "-n", str(iters)],
                             env=env, capture_output=True, text=True, timeout=300)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("Final:")), None)
        if line is None:
            raise RuntimeError(f"{out.stdout[-300:]} {out.stderr[-300:]}")
        return float(line.split()[6])
    finally:
        server.kill()
        server.wait(10)


def _rma_exporter(conn, tls: str, size: int) -> None:
    from gpushare import ucx

    with ucx.Agent(transports=tls) as agent:
        mh = agent.create_memory_handle(size, memory_type="cuda")  # UCX allocates device memory
        conn.send((agent.address, mh.create_remote_key().serialize()))
        conn.recv()


def rma(sizes: list[int], runs: int, iters: int, tls: str = "tcp,cuda_copy,cuda_ipc") -> None:
    import multiprocessing as mp

    import gpushare as gs
    from gpushare import ucx

    print(f"\n3. ucx-rma between CUDA buffers, UCX_TLS={tls} (MiB/s; median (min-max) of {runs};"
          " ratio to ucx_perftest -m cuda)")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_rma_exporter, args=(child, tls, max(sizes)), daemon=True)
    proc.start()
    local = gs.allocate(max(sizes), device=0)
    try:
        address, key = parent.recv()
        with ucx.Agent(transports=tls) as agent:
            ep = agent.connect(address)
            rk = ep.unpack_remote_key(key)
            for size in sizes:
                for test, op in (("ucp_put_bw", ep.mem_put), ("ucp_get", ep.mem_get)):
                    def once() -> None:
                        reqs = [op(local, rk.base_address, rk, nbytes=size) for _ in range(8)]
                        for r in reqs:
                            r.wait(120)
                        ep.flush().wait(120)

                    ours = [8 * size / MiB / _timed(once, iters) for _ in range(runs)]
                    try:
                        ref = [_perftest_cuda(test, size, 8 * iters, tls) for _ in range(runs)]
                        ratio = f"{statistics.median(ours) / statistics.median(ref):.2f}"
                        ref_text = _median(ref)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        ratio, ref_text = "n/a", f"ucx_perftest failed: {str(exc)[:80]}"
                    print(f"   {test:10s} {size:>9} B  gpushare {_median(ours)}  perftest {ref_text}  ratio {ratio}")
            ep.close()
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        local.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from gpushare._paths import _cuda

    reason = _cuda.unavailable_reason()
    if reason is not None:
        print(f"no CUDA device: {reason}")
        return 2
    iters = 5 if args.quick else 20
    mapped_copies(64 * MiB if args.quick else 256 * MiB, args.runs, iters)
    import_latency(args.runs, 20 if args.quick else 100)
    rma([64 * 1024, 4 * MiB] if args.quick else [64 * 1024, 4 * MiB, 64 * MiB], args.runs, iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
