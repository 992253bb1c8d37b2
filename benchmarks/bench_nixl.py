"""gpushare's region server against NIXL's UCX backend, same transport, same run.

Run: ``python benchmarks/bench_nixl.py [--runs 5]`` (``--quick`` for fewer
iterations per run).
NIXL is optional: ``pip install nixl-cu13`` (module ``nixl_cu13``; its UCX
backend works on host memory without a GPU).  Without it the script says so
and exits 0.

Both sides run as two processes on this machine with ``UCX_TLS=tcp`` (the
transport gpushare's server uses by default) and ``UCX_NET_DEVICES=lo`` on
host memory: the same transport and the same device for both.  Each
process is pinned to a core of its own (the first two this process may use;
``--no-pin`` leaves placement to the scheduler): unpinned, where the
scheduler puts the two processes' threads decides the figures of both
libraries, which then differ by 2 to 4 times between invocations on a
2-core machine (NIXL's target and initiator both spin; sharing a core, a
1 MiB NIXL put took 8 ms).  For each
operation the importer (NIXL's initiator) issues one request at a time and
waits for it, so each figure is what one synchronous caller gets:

* get and put of 4 KiB, 64 KiB and 1 MiB: one buffer per request;
* a batch of 64 x 64 KiB: one request of 64 descriptors (NIXL) against one
  ``get_batch``/``put_batch`` (gpushare; the puts gathered, as the sharing
  API does for host memory).

``--seed`` compares instead the seed API's puts (``gpushare.ucx.Agent``:
``Endpoint.mem_put`` with 16 in flight; one ``Endpoint.mem_put_batch`` of the
same 16 puts; and one post of those 16 prepared once with
``Endpoint.prepare_put_batch``; each followed by a flush posted behind the
puts, so that its acknowledgement follows theirs) of 4 KiB, 64 KiB and
1 MiB with NIXL's WRITE of 16 descriptors of the same size in one transfer
(prepared once, posted each time, its flush behind its puts),
and with ``ucx_perftest``'s ``ucp_put_bw`` in the same error-handling mode
(``-e``: gpushare's agents and NIXL's UCX backend handle peer failure) and
in its default mode (no error handling), so that what error handling costs
UCX itself shows.  Agents run with rendezvous off (``RNDV_THRESH=inf``, as
NIXL's UCX backend sets it) and wire-up on the active-message lane, which
makes their TCP puts zero-copy with error handling on; perftest -e runs with
the same settings.  ``--rndv`` runs both agents and perftest -e with UCX's
default rendezvous threshold instead, under which UCX 1.21 emulates a TCP
put when the endpoint handles peer failure (see docs/ucx.md).

Each figure is the median of ``--runs`` runs (lowest-highest) of either
library, each run in processes of its own, the two libraries' runs
alternating.  Unit: MiB/s (2**20 bytes per
second) everywhere; the ratio is gpushare / NIXL of the medians (above 1:
gpushare faster).  Differences to keep in mind: NIXL moves
data with one-sided RMA and checks nothing on the target per request, and
its target runs a polling progress thread (one busy core); gpushare's
exporter checks every request (region, key, range) and sleeps while idle;
NIXL's initiator here polls the transfer state from Python, gpushare waits
on its request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_ucx import _exporter, _server_exporter, cores as _cores, perftest, pinned as _pinned, spawned
from _report import spread

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB]
BATCH = 64
BATCH_SIZE = 64 * KiB
REGION = max(max(SIZES), BATCH * BATCH_SIZE)
INFLIGHT = 16  # the seed-API comparison's puts in flight


def _iters(nbytes: int, quick: bool) -> int:
    budget = (32 if quick else 256) * MiB
    return max(8, min(5000, budget // nbytes))


# -- NIXL ---------------------------------------------------------------------------


def _nixl_target(conn) -> None:
    import numpy as np
    from nixl_cu13._api import nixl_agent

    agent = nixl_agent("target")
    buf = np.ones(REGION, np.uint8)
    agent.register_memory([(buf.ctypes.data, REGION, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    conn.recv()


def _nixl_measure(agent, peer, laddr: int, raddr: int, op: str, pairs: list[tuple[int, int, int]],
                  quick: bool) -> float:
    """MiB/s of NIXL transfer ``op`` of ``pairs`` (local offset, remote offset, bytes), one at a
    time, polled from here."""
    ldescs = agent.get_xfer_descs([(laddr + lo, n, 0) for lo, _, n in pairs], "DRAM")
    rdescs = agent.get_xfer_descs([(raddr + ro, n, 0) for _, ro, n in pairs], "DRAM")
    handle = agent.initialize_xfer(op, ldescs, rdescs, peer)
    nbytes = sum(n for _, _, n in pairs)
    iters = _iters(nbytes, quick)
    for i in range(iters + 2):  # two warm-up transfers
        if i == 2:
            t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL {op} failed: {state}")
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    return nbytes * iters / dt / MiB


def nixl_run(quick: bool, cpu: int | None = None, seed: bool = False) -> dict:
    """NIXL's figures: ``seed`` (the seed-API comparison): WRITE of INFLIGHT descriptors per size;
    else single gets and puts per size and the batch.  The initiator runs in a process of its own
    (on this process's core): NIXL's teardown at the exit of a process that used an agent crashed
    it (SIGSEGV, after the work was done)."""
    with spawned(_nixl_initiator, quick, cpu, seed, daemon=False, timeout=600) as results:  # it starts the target
        return results


def _nixl_initiator(conn, quick: bool, cpu: int | None, seed: bool) -> None:
    import numpy as np
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    results = {}
    with spawned(_pinned, cpu, _nixl_target) as (meta, raddr):
        # The initiator polls the transfer state itself: no progress thread.
        agent = nixl_agent("initiator", nixl_agent_config(enable_prog_thread=False))
        local = np.zeros(REGION, np.uint8)
        agent.register_memory([(local.ctypes.data, REGION, 0, "")], "DRAM")
        peer = agent.add_remote_agent(meta)
        laddr = local.ctypes.data

        def measure(op: str, pairs: list[tuple[int, int, int]]) -> float:
            return _nixl_measure(agent, peer, laddr, raddr, op, pairs, quick)

        if seed:
            for size in SIZES:
                results[("put", size)] = measure("WRITE", [(0, 0, size)] * INFLIGHT)
        else:
            for size in SIZES:
                results[("get", size)] = measure("READ", [(0, 0, size)])
                results[("put", size)] = measure("WRITE", [(0, 0, size)])
            pairs = [(i * BATCH_SIZE, i * BATCH_SIZE, BATCH_SIZE) for i in range(BATCH)]
            results[("get", "batch")] = measure("READ", pairs)
            results[("put", "batch")] = measure("WRITE", pairs)
        agent.remove_remote_agent(peer)
    conn.send(results)
    conn.recv()


# -- gpushare ---------------------------------------------------------------------


def gpushare_run(quick: bool, cpu: int | None = None) -> dict:
    import numpy as np

    from gpushare._ucx import _peer

    results = {}
    with spawned(_pinned, cpu, _server_exporter, REGION) as (address, (rid, key)):
        peer = _peer.client().connect(address, timeout=30)
        local = np.zeros(REGION, np.uint8)

        def measure(fn, nbytes: int) -> float:
            iters = _iters(nbytes, quick)
            fn()
            fn()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return nbytes * iters / (time.perf_counter() - t0) / MiB

        for size in SIZES:
            view = local[:size]
            results[("get", size)] = measure(lambda v=view: peer.get(rid, key, 0, v, 60), size)
            results[("put", size)] = measure(lambda v=view: peer.put(rid, key, 0, v, 60), size)
        items = [(rid, key, i * BATCH_SIZE, local[i * BATCH_SIZE : (i + 1) * BATCH_SIZE]) for i in range(BATCH)]
        results[("get", "batch")] = measure(lambda: peer.get_batch(items).wait(60), BATCH * BATCH_SIZE)
        results[("put", "batch")] = measure(lambda: peer.put_batch(items, host_regions=True).wait(60), BATCH * BATCH_SIZE)
        peer.close()
    return results


def seed_run(quick: bool, cpu: int | None = None, config: dict[str, str] | None = None) -> dict:
    """The seed API's puts: INFLIGHT ``mem_put`` of each size, then a flush, per iteration
    (``"put"``), one ``mem_put_batch`` of INFLIGHT items with ``flush=True`` (``"batch"``), and
    the same items prepared once, each post with ``flush=True`` (``"plan"``);
    ``config``: further UCX settings of both agents."""
    import numpy as np

    from gpushare import ucx

    results = {}
    with spawned(_pinned, cpu, _exporter, "tcp", True, REGION, "blocking", None, config) as (address, key):
        with ucx.Agent(transports="tcp", config=config) as agent:
            ep = agent.connect(address)
            rk = ep.unpack_remote_key(key)
            # The local buffer registered once, as NIXL's is.
            mh = agent.create_memory_handle(REGION)
            local = np.frombuffer(mh.buffer, np.uint8)
            local[:] = 1
            for size in SIZES:
                iters = _iters(INFLIGHT * size, quick)

                # The flush is posted behind the puts, as NIXL's WRITE posts its
                # own: its ack then follows theirs, no round trip of its own.
                def once(view=local[:size]) -> None:
                    reqs = [ep.mem_put(view, rk.base_address, rk) for _ in range(INFLIGHT)]
                    reqs.append(ep.flush())
                    for r in reqs:
                        r.wait(60)

                # The same puts as NIXL's 16 descriptors, complete at the peer as its WRITE is
                # (flush=True: the flush posted by the same call).
                def batch(items=[(local[:size], rk.base_address)] * INFLIGHT) -> None:
                    ep.mem_put_batch(items, rk, flush=True).wait(60)

                # Prepared once, posted per transfer, as NIXL's transfer handle is.
                plan = ep.prepare_put_batch([(local[:size], rk.base_address)] * INFLIGHT, rk)

                def prepared(plan=plan) -> None:
                    plan.post(flush=True).wait(60)

                for kind, fn in (("put", once), ("batch", batch), ("plan", prepared)):
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    results[(kind, size)] = INFLIGHT * size * iters / (time.perf_counter() - t0) / MiB
                plan.close()
            del once, batch, prepared, plan, local
            ep.close()
    return results


def perftest_puts(quick: bool, cores: tuple[int | None, int | None], config: dict[str, str] | None = None) -> dict:
    """``ucp_put_bw`` per size, with error handling (``-e``, with the agents' further settings
    ``config``) and in perftest's default mode; its client and server on the cores of the importer
    and the exporter."""
    settings = {f"UCX_{k}": v for k, v in (config or {}).items()}
    return {(mode, size): perftest("ucp_put_bw", size, INFLIGHT * _iters(INFLIGHT * size, quick), "tcp",
                                   mode == "perftest -e", cores=cores,
                                   settings=settings if mode == "perftest -e" else None)[0]
            for mode in ("perftest -e", "perftest") for size in SIZES}


def _fmt(values: list[float]) -> str:
    """The median of the runs, then the lowest and the highest of them."""
    return spread(values, 0)


def _label(size) -> str:
    if size == "batch":
        return f"{BATCH} x {BATCH_SIZE // KiB} KiB"
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs of each library (median, lowest-highest)")
    p.add_argument("--quick", action="store_true", help="fewer iterations per run")
    p.add_argument("--seed", action="store_true",
                   help="the seed API's puts with 16 in flight against NIXL and ucx_perftest instead")
    p.add_argument("--rndv", action="store_true",
                   help="with --seed: both agents and perftest -e run with UCX's default rendezvous threshold "
                        "(gpushare's agents turn rendezvous off, as NIXL's UCX backend does; see docs/ucx.md)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the processes' placement on cores to the scheduler")
    args = p.parse_args()
    try:
        import nixl_cu13  # noqa: F401
    except ImportError:
        print("NIXL is not installed (pip install nixl-cu13): skipping the comparison.")
        return 0
    # Both sides, both libraries, inherited by the spawned processes.
    os.environ["UCX_TLS"] = "tcp"
    os.environ["UCX_NET_DEVICES"] = "lo"
    mine, theirs = _cores(args.pin)
    if mine is not None:
        # Before either library starts a thread: they all stay on this core.
        os.sched_setaffinity(0, {mine})
    if args.seed:
        return _seed_main(args, mine, theirs)
    # Alternating, so that both libraries see the machine in the same states.
    nixl, ours = [], []
    for _ in range(args.runs):
        nixl.append(nixl_run(args.quick, theirs))
        ours.append(gpushare_run(args.quick, theirs))
    where = f"importer on core {mine}, exporter on core {theirs}" if mine is not None else "unpinned"
    print(f"UCX_TLS=tcp, UCX_NET_DEVICES=lo, host memory, {os.cpu_count()} CPUs, {where}; median of {args.runs} runs "
          "(lowest-highest); MiB/s; ratio = gpushare / NIXL of the medians\n")
    print(f"{'op':>4} {'size':>14} {'gpushare':>22} {'NIXL':>22} {'ratio':>6}")
    for op in ("get", "put"):
        for size in [*SIZES, "batch"]:
            g = [r[(op, size)] for r in ours]
            n = [r[(op, size)] for r in nixl]
            print(f"{op:>4} {_label(size):>14} {_fmt(g):>22} {_fmt(n):>22} "
                  f"{statistics.median(g) / statistics.median(n):6.2f}")
    return 0


def _ucx_versions() -> str:
    """The UCX release each library runs: gpushare's (the libucx wheel's) and the one NIXL bundles."""
    import ctypes
    import glob
    import importlib.util

    from gpushare import ucx

    ours = ".".join(map(str, ucx.ucx_version()))
    theirs = "unknown"
    spec = importlib.util.find_spec("nixl_cu13")  # its wheel's folder holds the bundled UCX
    for path in glob.glob(os.path.join(os.path.dirname(os.path.dirname(spec.origin or "")),
                                       "nixl_cu13.libs", "libucp-*.so*")):
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        theirs = lib.ucp_get_version_string().decode()
    return f"gpushare on UCX {ours}, NIXL on its own UCX {theirs}"


def _seed_main(args, mine: int | None, theirs: int | None) -> int:
    nixl, ours, ref = [], [], []
    from gpushare._ucx._common import rma_config

    config = {"RNDV_THRESH": "auto"} if args.rndv else None  # the agents' further settings
    settings = rma_config("tcp") | (config or {})  # perftest -e's: the agents' own
    for _ in range(args.runs):  # alternating, so that each sees the machine in the same states
        nixl.append(nixl_run(args.quick, theirs, seed=True))
        ours.append(seed_run(args.quick, theirs, config))
        ref.append(perftest_puts(args.quick, (mine, theirs), settings))
    where = f"importer on core {mine}, exporter on core {theirs}" if mine is not None else "unpinned"
    print(f"seed API puts, {INFLIGHT} in flight; UCX_TLS=tcp, UCX_NET_DEVICES=lo, host memory, {os.cpu_count()} "
          f"CPUs, {where}; agents and perftest -e {'with UCX_RNDV_THRESH=auto' if args.rndv else 'as gpushare sets them'} "
          f"({', '.join(f'{k}={v}' for k, v in settings.items())}); "
          f"median of {args.runs} runs (lowest-highest); MiB/s; ratios of the medians; "
          f"{_ucx_versions()}\n")
    print("gpushare put: mem_put x 16; batch: one mem_put_batch of 16 items, as NIXL's one WRITE of 16 "
          "descriptors; plan: the same 16 items prepared once (prepare_put_batch), one post each time, as NIXL "
          "prepares its transfer once; each complete at the peer, as NIXL's: put with a flush posted behind the "
          "puts, batch and plan with flush=True (the flush posted by the same call)\n")
    print(f"{'size':>8} {'':>6} {'gpushare':>20} {'NIXL':>20} {'perftest -e':>20} {'perftest':>20} "
          f"{'/NIXL':>6} {'/pt -e':>6} {'/pt':>6}")
    for size in SIZES:
        theirs_cols = [[r[("put", size)] for r in nixl], [r[("perftest -e", size)] for r in ref],
                       [r[("perftest", size)] for r in ref]]
        for kind in ("put", "batch", "plan"):
            mine_col = [r[(kind, size)] for r in ours]
            g = statistics.median(mine_col)
            ratios = [g / statistics.median(c) for c in theirs_cols]
            print(f"{_label(size):>8} {kind:>6} " + " ".join(f"{_fmt(c):>20}" for c in [mine_col, *theirs_cols]) + " "
                  + " ".join(f"{x:6.2f}" for x in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
