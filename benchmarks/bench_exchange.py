"""Steps per second of a producer/consumer step loop: a gpushare channel
against a hand-written double buffer over ``multiprocessing.shared_memory``
with ``multiprocessing.Barrier``, on one node; and, with ``--netns``, a
channel across two nodes against a hand-written loop of raw UCX gets and
TCP messages.

Both loops do the same work per step: the producer copies a prepared array
into the slot, each consumer copies the slot out into memory of its own
(what a consumer that keeps the data does), and two slots let the producer
fill step t+1 while the consumers read step t.

* gpushare: ``gs.channel(..., slots=2)``; the producer ``send``s, each
  consumer iterates (``for step in consumer``), reading the slot in place
  (host-fd: the memfd mapped in every process).
* hand-written: two ``SharedMemory`` buffers; the producer writes buffer
  ``t % 2`` then waits on the barrier; the consumers wait on the barrier,
  then read buffer ``t % 2``.  One barrier per step is what makes the double
  buffer safe: nobody passes barrier t+1 before every consumer is done with
  step t.

Across nodes (``--netns``, needs root and iproute2): two network namespaces
joined by a veth pair (198.18.7.1/24 and 198.18.7.2/24) stand in for two
nodes; the producer runs in one, the consumers in the other, each a program
of its own (``benchmarks/_exchange_netns.py`` under ``ip netns exec``,
trusting each other through a shared ``GPUSHARE_AUTHKEY``; the producer's
listeners bind 198.18.7.1 only, through ``GPUSHARE_CONTROL_HOST``).  The
namespaces are deleted at the end, also on an error, Ctrl-C or SIGTERM.

* gpushare: the same channel loop; the handle crosses as
  ``ChannelHandle.to_bytes()``, consumers join over TCP and the channel
  reads each slot over ucx-rma (the exporter's region server) into a local
  array, which the consumer then copies out as above.
* hand-written: a ``gpushare.ucx.Agent`` (TCP) registers two slots and
  sends its address and remote key; per step the producer fills slot
  ``t % 2`` and sends each consumer a 16-byte TCP message "step t ready in
  slot s"; each consumer does a one-sided UCX get of the slot straight into
  its own buffer and replies "done t".  The producer fills step t+2 only
  after every consumer is done with step t: the channel's back-pressure.
  The reference has no access checks and one copy fewer per consumer.

Each run times ``--small-steps`` steps of 256 KiB or ``--large-steps``
steps of 64 MiB after a few warm-up steps, from the producer, until every
consumer finished the last step.  Prints the median of
``--runs`` runs with the spread (min to max) and the ratio of the medians.
Target: the channel at least 0.8x the hand-written loop on one node.

Run: ``python benchmarks/bench_exchange.py [--consumers 3] [--runs 5] [--netns]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

import gpushare as gs

KiB, MiB = 1 << 10, 1 << 20
WARMUP = 3
#: The program each side of the cross-node section runs inside its namespace.
NODE = str(Path(__file__).with_name("_exchange_netns.py"))
#: Seconds one cross-node run may take before it is abandoned.
NETNS_RUN_TIMEOUT = 300


def _gs_consumer(handle: gs.ChannelHandle, done) -> None:
    local = np.empty(handle.shape, np.dtype(handle.typestr))
    count = 0
    with gs.subscribe(handle) as ch:
        for step in ch:
            np.copyto(local, step.array)
            count += 1
    done.put(count)


def _gs_run(ctx, nbytes: int, consumers: int, steps: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    done = ctx.Queue()
    producer = gs.channel(nbytes, np.uint8, consumers=consumers, slots=2)
    procs = [ctx.Process(target=_gs_consumer, args=(producer.handle, done)) for _ in range(consumers)]
    for p in procs:
        p.start()
    try:
        with producer:
            for _ in range(WARMUP):
                producer.send(src, timeout=60)
            producer.drain(timeout=60)
            t0 = time.perf_counter()
            for _ in range(steps):
                producer.send(src, timeout=60)
            producer.drain(timeout=60)
            elapsed = time.perf_counter() - t0
        counts = [done.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
    if counts != [steps + WARMUP] * consumers:
        raise SystemExit(f"gpushare: consumers saw {counts} steps; expected {steps + WARMUP}")
    return steps / elapsed


def _shm_consumer(names: list[str], nbytes: int, barrier, total: int, done) -> None:
    bufs = [shared_memory.SharedMemory(name=n) for n in names]
    views = [np.ndarray((nbytes,), np.uint8, buffer=b.buf) for b in bufs]
    local = np.empty(nbytes, np.uint8)
    for t in range(total):
        barrier.wait()  # step t is in buffer t % 2
        np.copyto(local, views[t % 2])
    barrier.wait()  # done with the last step
    del views
    for b in bufs:
        b.close()
    done.put(total)


def _shm_run(ctx, nbytes: int, consumers: int, steps: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    bufs = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(2)]
    views = [np.ndarray((nbytes,), np.uint8, buffer=b.buf) for b in bufs]
    barrier = ctx.Barrier(consumers + 1)
    done = ctx.Queue()
    total = steps + WARMUP
    procs = [ctx.Process(target=_shm_consumer, args=([b.name for b in bufs], nbytes, barrier, total, done))
             for _ in range(consumers)]
    for p in procs:
        p.start()
    try:
        for t in range(WARMUP):
            np.copyto(views[t % 2], src)
            barrier.wait()
        t0 = time.perf_counter()
        for t in range(WARMUP, total):
            np.copyto(views[t % 2], src)
            barrier.wait()
        barrier.wait()  # every consumer finished the last step
        elapsed = time.perf_counter() - t0
        counts = [done.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
        del views
        for b in bufs:
            b.close()
            b.unlink()
    if counts != [total] * consumers:
        raise SystemExit(f"shared_memory: consumers saw {counts} steps; expected {total}")
    return steps / elapsed


def _summary(rates: list[float]) -> str:
    return f"{statistics.median(rates):9.1f} steps/s ({min(rates):.1f} to {max(rates):.1f})"


# -- across two nodes: two network namespaces ------------------------------------


@dataclass(frozen=True)
class _Nodes:
    producer_ns: str
    consumer_ns: str
    producer_ip: str
    consumer_ip: str
    consumer_dev: str  # the veth end in the consumers' namespace
    env: dict


def _netns_unavailable() -> str | None:
    """Why the cross-node section cannot run here, or None."""
    if sys.platform != "linux":
        return "not Linux"
    if os.geteuid() != 0:
        return "not running as root (ip netns needs root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@contextlib.contextmanager
def _two_nodes() -> Iterator[_Nodes]:
    """Two namespaces joined by a veth pair; both deleted on the way out."""
    tag = os.getpid()
    a, b = f"gsbench-a-{tag}", f"gsbench-b-{tag}"
    va, vb = f"gsbva{tag}", f"gsbvb{tag}"
    made: list[str] = []
    link_here = False  # the veth pair exists and an end of it is still in this namespace

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")  # so that the namespaces are deleted (timeout, kill)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        link_here = True
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        link_here = False
        for ns, dev, addr in ((a, va, "198.18.7.1/24"), (b, vb, "198.18.7.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # Separate programs: they share a key to prove to each other who they are.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                   GPUSHARE_AUTHKEY=os.environ.get("GPUSHARE_AUTHKEY") or secrets.token_hex(16))
        yield _Nodes(a, b, "198.18.7.1", "198.18.7.2", vb, env)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup below runs to its end
        if link_here:  # a move failed: deleting either end deletes the pair
            subprocess.run(["ip", "link", "del", vb], capture_output=True, timeout=30)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _Program:
    """A program running in a namespace, its stderr kept in a file."""

    who: str
    proc: subprocess.Popen
    log: Any

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace").strip()[-2000:]

    def result(self, deadline: float) -> dict:
        """The last JSON line the program prints before it exits 0."""
        try:
            out, _ = self.proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{self.who} did not finish within {NETNS_RUN_TIMEOUT} s:\n{self.stderr()}") from None
        lines = out.strip().splitlines()
        if self.proc.returncode != 0 or not lines:
            raise SystemExit(f"{self.who} exited with {self.proc.returncode}:\n{self.stderr()}")
        return json.loads(lines[-1])

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def _start(nodes: _Nodes, who: str, ns: str, role: str, *args: str, stdin: str | None = None,
           env: dict | None = None) -> _Program:
    log = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, NODE, role, *args],
                                env={**nodes.env, **(env or {})},
                                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True)
    except BaseException:
        log.close()
        raise
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.flush()  # communicate() closes it
    return _Program(who, proc, log)


def _netns_run(nodes: _Nodes, kind: str, nbytes: int, consumers: int, steps: int) -> tuple[float, str]:
    """One run of ``kind`` ("gs" or "ucx") across the namespaces: (steps/s,
    how the consumers read the slots)."""
    args = [str(nbytes), str(consumers), str(steps), str(WARMUP)]
    if kind == "ucx":
        args.append(nodes.producer_ip)
    deadline = time.monotonic() + NETNS_RUN_TIMEOUT
    # The producer's listeners (channel, exporter) bind the veth address only.
    producer = _start(nodes, f"{kind} producer", nodes.producer_ns, f"{kind}-produce", *args,
                      env={"GPUSHARE_CONTROL_HOST": nodes.producer_ip})
    programs = [producer]
    try:
        if not select.select([producer.proc.stdout], [], [], NETNS_RUN_TIMEOUT)[0]:
            raise SystemExit(f"{kind} producer printed nothing within {NETNS_RUN_TIMEOUT} s:\n{producer.stderr()}")
        hello = producer.proc.stdout.readline()
        if not hello:
            producer.proc.wait(30)
            raise SystemExit(f"{kind} producer exited with {producer.proc.returncode}:\n{producer.stderr()}")
        for _ in range(consumers):
            programs.append(_start(nodes, f"{kind} consumer", nodes.consumer_ns, f"{kind}-consume", stdin=hello))
        rate = producer.result(deadline)["rate"]
        reports = [c.result(deadline) for c in programs[1:]]
    finally:
        for program in programs:
            program.end()
    counts = [r["count"] for r in reports]
    if counts != [steps + WARMUP] * consumers:
        raise SystemExit(f"{kind} across nodes: consumers saw {counts} steps; expected {steps + WARMUP}")
    if kind == "gs":
        paths = {p for r in reports for p in r["paths"]}
        if paths != {"ucx-rma"}:
            raise SystemExit(f"gpushare across nodes: the consumers read the slots over {sorted(paths)}, not ucx-rma")
        return rate, "ucx-rma"
    if any(r["wrong"] for r in reports):
        raise SystemExit(f"hand-written UCX: consumers read the wrong step {[r['wrong'] for r in reports]} times")
    lanes = {r["lane"] for r in reports}
    if any(nodes.consumer_dev not in lane for lane in lanes):
        raise SystemExit(f"hand-written UCX: the gets did not go over {nodes.consumer_dev}: {sorted(lanes)}")
    return rate, f"tcp on {nodes.consumer_dev}"


def _netns_section(consumers: int, runs: int, sizes: list[tuple[int, int]]) -> None:
    print()
    why = _netns_unavailable()
    if why is not None:
        print(f"across two nodes (--netns): skipped: {why}")
        return
    with _two_nodes() as nodes:
        print(f"across two nodes: producer in netns {nodes.producer_ns} ({nodes.producer_ip}), "
              f"{consumers} consumers in netns {nodes.consumer_ns} ({nodes.consumer_ip}), one veth pair")
        print(f"{'step':>8}  {'gpushare channel':>40}  {'UCX get + TCP message':>40}  ratio")
        ways: set[str] = set()
        for nbytes, steps in sizes:
            ours, theirs = [], []
            for _ in range(runs):  # interleaved, so both see the same machine
                rate, way = _netns_run(nodes, "gs", nbytes, consumers, steps)
                ours.append(rate)
                ways.add(f"channel slots read over {way}")
                rate, way = _netns_run(nodes, "ucx", nbytes, consumers, steps)
                theirs.append(rate)
                ways.add(f"reference gets over {way}")
            _row(nbytes, ours, theirs)
        print(f"({'; '.join(sorted(ways))})")


def _row(nbytes: int, ours: list[float], theirs: list[float]) -> None:
    ratio = statistics.median(ours) / statistics.median(theirs)
    size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
    print(f"{size:>8}  {_summary(ours):>40}  {_summary(theirs):>40}  {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--small-steps", type=int, default=1000, help="steps per run at 256 KiB")
    parser.add_argument("--large-steps", type=int, default=40, help="steps per run at 64 MiB")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"))
    parser.add_argument("--netns", action="store_true",
                        help="also run the loop across two network namespaces (needs root and iproute2)")
    args = parser.parse_args()
    ctx = mp.get_context(args.start_method)
    print(f"{args.consumers} consumers, 2 slots, {args.runs} runs each (median, min to max), "
          f"start method {args.start_method}")
    print(f"{'step':>8}  {'gpushare channel':>40}  {'shared_memory + Barrier':>40}  ratio")
    sizes = [(256 * KiB, args.small_steps), (64 * MiB, args.large_steps)]
    for nbytes, steps in sizes:
        ours, theirs = [], []
        for _ in range(args.runs):  # interleaved, so both see the same machine
            ours.append(_gs_run(ctx, nbytes, args.consumers, steps))
            theirs.append(_shm_run(ctx, nbytes, args.consumers, steps))
        _row(nbytes, ours, theirs)
    if args.netns:
        _netns_section(args.consumers, args.runs, sizes)


if __name__ == "__main__":
    main()
