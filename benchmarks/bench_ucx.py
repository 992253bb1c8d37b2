"""gpushare's UCX put/get against ucx_perftest, same transport, same run.

Run: ``python benchmarks/bench_ucx.py [--runs 3]`` (``--quick`` for fewer
iterations per run).

For each transport setting, ucx_perftest (shipped in the libucx wheel) and
gpushare run between two processes on this machine with the same UCX_TLS and
the same error-handling mode, and the script prints, per message size, the
bandwidth of each and the ratio gpushare / ucx_perftest (higher is better;
the target is >= 0.9 from 64 KiB up), then the small-message latency of a
get and the ratio gpushare / ucx_perftest (lower is better).  gpushare's
puts and gets are measured two ways: one ``mem_put``/``mem_get`` per
message (up to 512 in flight), and 16 messages per post (fewer where
perftest's count is smaller: as many in all) of a plan prepared
once (``prepare_put_batch``/``prepare_get_batch``, up to 32 posts in
flight), the rows marked ``plan``; the local buffer is registered once
(``Agent.create_memory_handle``), as perftest's UCX caches its
registration.

Settings measured:

* ``tcp, error handling``: gpushare's default ``Agent()`` forced to TCP;
  perftest with ``-e``.
* ``tcp, no error handling``: ``Agent(error_handling=False)``; perftest without ``-e``.
* ``one node, all transports``: UCX's default transports (``UCX_TLS=all``: on
  one node shared memory and cma), no error handling (UCX 1.21 keeps its
  shared-memory and cma lanes off endpoints with peer-failure handling);
  the exporter proves itself to the importer through a Unix socket
  (``ucx.LocalPeer``), without which those transports are refused; perftest
  with the same ``UCX_TLS``, without ``-e``.
* ``server``: the per-process region server (``gpushare._server.server()``),
  TCP, error handling, blocking progress, against perftest's active-message
  tests in the same mode (``ucp_am_bw``, ``ucp_am_lat``, ``-e -E sleep``):
  bandwidth of get and put with 64 requests in flight, a batch of 64 x 64 KiB
  as one ``get_batch``, the round trip of an 8-byte get against perftest's
  ping-pong round trip (2 x its one-way latency), and the message rate of
  8-byte gets with 64 in flight, and in batches of 64, against perftest's
  8-byte ``ucp_am_bw``.

``--setup-cost`` prints instead what serving 100 regions costs an exporter
(threads, file descriptors, RSS, CPU while idle) with one agent per region,
as the sharing API does today, with and without the shared-memory
transports, and with one region server.

In the three RMA settings the importer (perftest's client) runs on the
first core this process may use and the exporter (perftest's server) on
the second, threads included (``--no-pin`` leaves placement to the
scheduler), as ``bench_nixl.py`` places its two sides.

Every figure, gpushare's and perftest's alike, is the median of ``--runs``
runs (lowest-highest), and every ratio a ratio of medians.  Unit: MiB/s
(2**20 bytes per second) for every bandwidth, as perftest reports it;
microseconds for latencies; operations per second for rates.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import spread

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 64 * MiB]
SETTINGS = [
    ("tcp, error handling", "tcp", True),
    ("tcp, no error handling", "tcp", False),
    ("one node, all transports", "all", False),
    ("server", "tcp", True),
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


def _on_core(cpu: int | None):
    """A ``preexec_fn`` that keeps a child process on core ``cpu`` (None: on
    every core this machine has, whatever core the caller is pinned to)."""
    cpus = {cpu} if cpu is not None else set(range(os.cpu_count() or 1))
    return lambda: os.sched_setaffinity(0, cpus)


def pinned(conn, cpu, target, *args) -> None:
    """Run ``target(conn, *args)`` on core ``cpu`` (None: anywhere); threads
    it starts stay there too."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    target(conn, *args)


def cores(pin: bool) -> tuple[int | None, int | None]:
    """(importer's core, exporter's core), or (None, None) unpinned or with
    fewer than two cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return cpus[0], cpus[1]


def perftest(test: str, size: int, iters: int, tls: str, error_handling: bool,
             wait: str | None = None, settings: dict[str, str] | None = None,
             cores: tuple[int | None, int | None] = (None, None)) -> tuple[float, float, float]:
    """Run ucx_perftest; return (overall bandwidth MiB/s, average overhead usec, overall msg/s).

    ``wait="sleep"`` makes both perftest sides sleep on the worker's event fd
    (``-E sleep``), as gpushare's blocking progress thread does.  ``settings``:
    more UCX variables for both perftest sides.  ``cores``: (client's core,
    server's core), as the benchmark pins its own two sides; None lets a side
    run anywhere (never on the caller's core only: two perftest processes
    polling on one core measure the scheduler).
    """
    exe, env = _perftest_paths()
    env["UCX_TLS"] = tls
    env.update(settings or {})
    port = _free_port()
    flags = (["-e"] if error_handling else []) + (["-E", wait] if wait else [])
    server = subprocess.Popen([exe, "-p", str(port), *flags], env=env, preexec_fn=_on_core(cores[1]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(
            [exe, "127.0.0.1", "-p", str(port), *flags, "-t", test, "-s", str(size), "-n", str(iters)],
            env=env, capture_output=True, text=True, timeout=300, preexec_fn=_on_core(cores[0]),
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("Final:")), None)
        if line is None:
            raise RuntimeError(f"ucx_perftest {test} failed: {out.stdout[-400:]} {out.stderr[-400:]}")
        fields = line.split()
        # Final: iters  lat50  lat_avg  lat_overall  bw_avg  bw_overall  rate_avg rate_overall
        return float(fields[6]), float(fields[3]), float(fields[8])
    finally:
        server.kill()
        server.wait(10)


def _exporter(conn, tls: str, error_handling: bool, size: int, progress: str, listener: str | None = None,
              config: dict[str, str] | None = None) -> None:
    from gpushare import ucx

    proof = None
    if listener is not None:  # the importer proves this process through the socket's credentials
        proof = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        proof.connect(listener)
    with ucx.Agent(transports=tls, error_handling=error_handling, progress=progress, config=config) as agent:
        mh = agent.create_memory_handle(size)
        conn.send((agent.address, mh.create_remote_key().serialize()))
        conn.recv()


def gpushare_bw(ep, rk, op: str, buf, iters: int, window: int = 512) -> float:
    """MiB/s of ``iters`` puts or gets of all of ``buf``, up to ``window`` in flight."""
    size = len(buf)
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
    return size * iters / (time.perf_counter() - t0) / MiB


def gpushare_plan_bw(ep, rk, op: str, buf, iters: int, per_post: int = 16, window: int = 32) -> float:
    """As gpushare_bw, the puts or gets posted ``per_post`` at a time by one plan
    (``Endpoint.prepare_put_batch``/``prepare_get_batch``), prepared once."""
    size = len(buf)
    prepare = ep.prepare_put_batch if op == "put" else ep.prepare_get_batch
    per_post = max(1, min(per_post, iters))  # as many messages in all as perftest's -n
    posts = max(1, iters // per_post)
    with prepare([(buf, rk.base_address)] * per_post, rk) as plan:
        inflight = []
        t0 = time.perf_counter()
        for _ in range(posts):
            inflight.append(plan.post())
            if len(inflight) >= window:
                inflight.pop(0).wait(120)
        for r in inflight:
            r.wait(120)
        ep.flush().wait(120)
        return size * posts * per_post / (time.perf_counter() - t0) / MiB


def gpushare_lat(ep, rk, buf, iters: int) -> float:
    """Microseconds of one 8-byte get into ``buf``, waited for."""
    buf = buf[:8]
    t0 = time.perf_counter()
    for _ in range(iters):
        ep.mem_get(buf, rk.base_address, rk).wait(60)
    return (time.perf_counter() - t0) / iters * 1e6


def _iters(size: int, quick: bool) -> int:
    budget = (64 if quick else 512) * MiB
    return max(4, min(20000, budget // size))


# -- the region server ---------------------------------------------------------------

WINDOW = 64
BATCH, BATCH_SIZE = 64, 64 * KiB


@contextlib.contextmanager
def spawned(target, *args, daemon: bool = True, timeout: float | None = None):
    """Run ``target(conn, *args)`` in a spawned process; yield what it sends first.

    On exit the process is told ``"done"`` and reaped (killed if it hangs).
    ``daemon=False`` lets the process start processes of its own; ``timeout``
    bounds the wait for its first message.
    """
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=target, args=(child, *args), daemon=daemon)
    proc.start()
    child.close()
    try:
        if timeout is not None and not parent.poll(timeout):
            raise RuntimeError(f"{target.__name__} sent nothing within {timeout} s")
        try:
            first = parent.recv()
        except EOFError:
            proc.join(10)
            raise RuntimeError(f"{target.__name__}'s process ended with status {proc.exitcode} "
                               "before it sent anything") from None
        yield first
    finally:
        try:
            parent.send("done")
        except OSError:
            pass  # it is gone already
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _server_exporter(conn, size: int) -> None:
    import numpy as np

    from gpushare._ucx import _server

    srv = _server.server()
    buf = np.ones(size, np.uint8)
    region = srv.add_region(buf)
    conn.send((srv.address, region.grant()))
    conn.recv()
    region.close()


def server_bw(peer, cap, op: str, size: int, iters: int, window: int = WINDOW) -> float:
    import numpy as np

    buf = np.ones(size, np.uint8)
    fn = peer.get_async if op == "get" else peer.put_async
    inflight = []
    t0 = time.perf_counter()
    for _ in range(iters):
        inflight.append(fn(*cap, 0, buf))
        if len(inflight) >= window:
            inflight.pop(0).wait(120)
    for r in inflight:
        r.wait(120)
    return size * iters / (time.perf_counter() - t0) / MiB


def server_batch_bw(peer, cap, iters: int) -> float:
    import numpy as np

    bufs = [np.ones(BATCH_SIZE, np.uint8) for _ in range(BATCH)]
    items = [(*cap, i * BATCH_SIZE, b) for i, b in enumerate(bufs)]
    t0 = time.perf_counter()
    for _ in range(iters):
        peer.get_batch(items).wait(120)
    return BATCH * BATCH_SIZE * iters / (time.perf_counter() - t0) / MiB


def server_rtt(peer, cap, iters: int) -> float:
    buf = bytearray(8)
    t0 = time.perf_counter()
    for _ in range(iters):
        peer.get(*cap, 0, buf)
    return (time.perf_counter() - t0) / iters * 1e6


def server_rate(peer, cap, iters: int) -> float:
    return server_bw(peer, cap, "get", 8, iters) * MiB / 8


def server_batch_rate(peer, cap, iters: int) -> float:
    """8-byte gets per second, posted as get_batch of BATCH (one request message each)."""
    bufs = [bytearray(8) for _ in range(BATCH)]
    items = [(*cap, 8 * i, b) for i, b in enumerate(bufs)]
    t0 = time.perf_counter()
    for _ in range(iters):
        peer.get_batch(items).wait(120)
    return BATCH * iters / (time.perf_counter() - t0)


def run_server(sizes, runs: int, quick: bool) -> None:
    from gpushare._ucx import _peer
    from gpushare._ucx._node import tcp_segment_config

    tls, eh = "tcp", True
    # perftest gets the TCP segment sizes the server's worker uses.
    seg = {"UCX_" + k: v for k, v in tcp_segment_config().items()}
    print(f"== region server (UCX_TLS={tls}, error handling on, blocking progress; "
          f"perftest: active messages, -e -E sleep, {' '.join(f'{k}={v}' for k, v in seg.items())})")
    # perftest first, with no gpushare process alive.
    refs = {}
    for size in sizes:
        n = _iters(size, quick)
        refs[size] = [perftest("ucp_am_bw", size, n, tls, eh, "sleep", seg)[0] for _ in range(runs)]
    li = 2000 if quick else 10000
    ping_pong = [2 * perftest("ucp_am_lat", 8, li, tls, eh, "sleep", seg)[1] for _ in range(runs)]
    rate = [perftest("ucp_am_bw", 8, 20 * li, tls, eh, "sleep", seg)[2] for _ in range(runs)]
    batch_ref = [perftest("ucp_am_bw", BATCH_SIZE, _iters(BATCH_SIZE, quick), tls, eh, "sleep", seg)[0]
                 for _ in range(runs)]
    with spawned(_server_exporter, max(max(sizes), BATCH * BATCH_SIZE)) as (address, cap):
        peer = _peer.client().connect(address, timeout=30)
        lane = next((ln.strip("# ").strip() for ln in peer.transport_info().splitlines() if "lane[0]" in ln), "?")
        print(f"   gpushare peer: {lane}")
        print(f"   {'size':>8} {'op':>4} {'gpushare MiB/s':>22} {'perftest MiB/s':>22} {'ratio':>6}")
        for size in sizes:
            n = _iters(size, quick)
            for op in ("get", "put"):
                got = [server_bw(peer, cap, op, size, n) for _ in range(runs)]
                print(f"   {_label(size):>8} {op:>4} {_fmt(got):>22} {_fmt(refs[size]):>22} "
                      f"{_ratio(got, refs[size]):6.2f}")
        nb = max(4, _iters(BATCH * BATCH_SIZE, quick))
        got = [server_batch_bw(peer, cap, nb) for _ in range(runs)]
        print(f"   {BATCH} x {BATCH_SIZE // KiB} KiB get_batch: {_fmt(got).strip()} MiB/s, "
              f"perftest {BATCH_SIZE // KiB} KiB am_bw {_fmt(batch_ref).strip()} MiB/s, "
              f"ratio {_ratio(got, batch_ref):.2f}")
        rtt = [server_rtt(peer, cap, li) for _ in range(runs)]
        print(f"   8 B get round trip: gpushare {_fmt(rtt, 1).strip()} us, "
              f"perftest ping-pong {_fmt(ping_pong, 1).strip()} us, "
              f"ratio {_ratio(rtt, ping_pong):.2f} (lower is better)")
        got_rate = [server_rate(peer, cap, 10 * li) for _ in range(runs)]
        print(f"   8 B get rate, {WINDOW} in flight: gpushare {_fmt(got_rate).strip()} ops/s, "
              f"perftest 8 B am_bw {_fmt(rate).strip()} ops/s, ratio {_ratio(got_rate, rate):.2f}")
        got_rate = [server_batch_rate(peer, cap, li // 10) for _ in range(runs)]
        print(f"   8 B get rate, get_batch of {BATCH}: gpushare {_fmt(got_rate).strip()} ops/s, "
              f"ratio {_ratio(got_rate, rate):.2f}\n")
        peer.close()


def run(settings, sizes, runs: int, quick: bool, pin: bool = True) -> None:
    import numpy as np

    from gpushare import ucx
    from gpushare._ucx._common import rma_config

    all_cpus = os.sched_getaffinity(0)
    print(f"UCX {'.'.join(map(str, ucx.ucx_version()))}, {os.cpu_count()} CPUs; median of {runs} runs "
          "(lowest-highest); MiB/s for bandwidths, us for latencies, operations/s for rates; perftest with "
          "the agents' settings of each setting\n")
    for name, tls, eh in settings:
        if name == "server":
            try:
                run_server(sizes, runs, quick)
            except Exception as exc:  # noqa: BLE001
                print(f"   setting failed: {exc}\n")
            continue
        same = {f"UCX_{k}": v for k, v in rma_config(tls).items()}  # perftest runs with the agents' settings
        print(f"== {name} (UCX_TLS={tls}, error handling {'on' if eh else 'off'}; "
              f"{' '.join(f'{k}={v}' for k, v in same.items())})")
        progress = "blocking"  # both sides sleep between transfers, so perftest may run in between
        li = 2000 if quick else 10000
        try:
            listener = proof_name = None
            if tls == "all":  # one-node transports: the exporter must be proven to be on this node
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                proof_name = f"\0gpushare-bench-{os.getpid()}"
                listener.bind(proof_name)
                listener.listen(1)
            mine, theirs = cores(pin)
            if mine is not None:  # before the agent starts its threads: they stay on this core too
                os.sched_setaffinity(0, {mine})
            with spawned(pinned, theirs, _exporter, tls, eh, max(sizes), progress, proof_name) as (address, key), \
                    ucx.Agent(transports=tls, error_handling=eh, progress=progress) as agent:
                peer = ucx.LocalPeer.from_socket(listener.accept()[0]) if listener is not None else None
                ep = agent.connect(address, local_peer=peer)
                rk = ep.unpack_remote_key(key)
                lanes = [ln.strip("# ").strip() for ln in ep.transport_info().splitlines() if "lane[" in ln]
                print(f"   gpushare endpoint: {'; '.join(lanes) or '?'}")
                print(f"   {'size':>8} {'op':>8} {'gpushare MiB/s':>22} {'perftest MiB/s':>22} {'ratio':>6}")
                # The local buffer registered once, as perftest's UCX caches its registration
                # (gpushare's processes run without UCX's cache: docs/ucx.md, "Memory hooks").
                mh = agent.create_memory_handle(max(sizes))
                local = np.frombuffer(mh.buffer, np.uint8)
                local[:] = 1
                for size in sizes:
                    n = _iters(size, quick)
                    buf = local[:size]
                    for op in ("put", "get"):
                        # perftest and gpushare alternate, run by run, so that a change
                        # of load during the run weighs on both alike
                        test = "ucp_put_bw" if op == "put" else "ucp_get"
                        ref, got, planned = [], [], []
                        try:
                            for _ in range(runs):
                                ref.append(perftest(test, size, n, tls, eh, settings=same, cores=(mine, theirs))[0])
                                got.append(gpushare_bw(ep, rk, op, buf, n))
                                planned.append(gpushare_plan_bw(ep, rk, op, buf, n))
                        except Exception as exc:  # noqa: BLE001 - report and go on
                            print(f"   {_label(size):>8} {op:>8} failed: {exc}")
                            continue
                        for label, col in ((op, got), (f"{op} plan", planned)):
                            print(f"   {_label(size):>8} {label:>8} {_fmt(col):>22} {_fmt(ref):>22} "
                                  f"{_ratio(col, ref):6.2f}")
                ref_lat, got_lat = [], []
                for _ in range(runs):
                    try:
                        ref_lat.append(perftest("ucp_get", 8, li, tls, eh, settings=same, cores=(mine, theirs))[1])
                    except Exception:  # noqa: BLE001 - the latency line says so
                        ref_lat.append(float("nan"))
                    got_lat.append(gpushare_lat(ep, rk, local, li))
                print(f"   8 B get latency: gpushare {_fmt(got_lat, 1).strip()} us, "
                      f"perftest {_fmt(ref_lat, 1).strip()} us, "
                      f"ratio {_ratio(got_lat, ref_lat):.2f} (lower is better)\n")
                del buf, local
                mh.close()
                ep.close()
        except Exception as exc:  # noqa: BLE001
            print(f"   setting failed: {exc}\n")
        finally:
            os.sched_setaffinity(0, all_cpus)
            if listener is not None:
                listener.close()


# -- what a worker costs to have -----------------------------------------------------


def _usage() -> tuple[int, int, float, float]:
    """(threads, fds, RSS MiB, CPU seconds) of this process."""
    rss = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmRSS")) / 1024
    t = os.times()
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), rss, t.user + t.system


def _setup_cost_child(conn, kind: str, count: int) -> None:
    import numpy as np

    from gpushare import ucx
    from gpushare._ucx._loader import native

    native()
    kept: list = []  # what serves the regions, held until the parent is done
    if kind == "server":
        from gpushare._ucx import _server

        b = _usage()
        t0 = time.perf_counter()
        srv = _server.server()
        arrays = [np.ones(4096, np.uint8) for _ in range(count)]
        kept += [srv.add_region(a) for a in arrays]
        for r in kept:
            r.grant()
    else:
        tls = {"agent, shared memory too": "tcp,sm,self"}.get(kind)
        ucx.Agent(transports=tls).close()  # load the transports once
        b = _usage()
        t0 = time.perf_counter()
        for _ in range(count):
            agent = ucx.Agent(transports=tls)
            kept.append((agent, agent.create_memory_handle(4096)))
    dt = time.perf_counter() - t0
    a = _usage()
    time.sleep(5.0)
    idle = _usage()[3] - a[3]
    conn.send((dt, a[0] - b[0], a[1] - b[1], a[2] - b[2], idle))
    conn.recv()
    kept.clear()


def run_setup_cost(runs: int, count: int = 100) -> None:
    print(f"== what serving {count} regions costs the exporter (added threads, fds, RSS; CPU over 5 s idle); "
          f"median of {runs} runs (lowest-highest)")
    for kind in ("agent, shared memory too", "agent, TCP only (default now)", "server"):
        what = "one region each on its own agent" if kind != "server" else "one server, one region each"
        rows = []
        for _ in range(runs):
            with spawned(_setup_cost_child, kind, count) as row:
                rows.append(row)
        ms, threads, fds, rss, idle = ([r[i] for r in rows] for i in range(5))
        print(f"   {kind:<30} {what}: {_fmt([t * 1e3 / count for t in ms], 2).strip()} ms per region, "
              f"+{_fmt(threads).strip()} threads, +{_fmt(fds).strip()} fds, +{_fmt(rss, 1).strip()} MiB RSS, "
              f"idle CPU {_fmt([t * 1e3 for t in idle], 1).strip()} ms in 5 s")
    print()


def _fmt(values: list[float], digits: int = 0) -> str:
    """The median of the runs, then the lowest and the highest of them."""
    return spread(values, digits)


def _ratio(ours: list[float], theirs: list[float]) -> float:
    """The ratio of the medians."""
    return statistics.median(ours) / statistics.median(theirs)


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of every measurement (median, lowest-highest)")
    p.add_argument("--quick", action="store_true", help="fewer iterations per run")
    p.add_argument("--setting", choices=[s[0] for s in SETTINGS], action="append",
                   help="only these settings (repeatable)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the two sides' placement on cores to the scheduler (RMA settings)")
    p.add_argument("--setup-cost", action="store_true",
                   help="only what 100 regions cost: per-share agents against one server")
    args = p.parse_args()
    if args.setup_cost:
        run_setup_cost(args.runs)
        return 0
    settings = [s for s in SETTINGS if not args.setting or s[0] in args.setting]
    run(settings, SIZES, runs=args.runs, quick=args.quick, pin=args.pin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
