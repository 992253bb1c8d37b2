"""One side of ``bench_exchange.py --netns``: a program run inside a network
namespace with ``ip netns exec``.

    python _exchange_netns.py gs-produce NBYTES CONSUMERS STEPS WARMUP
    python _exchange_netns.py gs-consume          # reads the producer's JSON line on stdin
    python _exchange_netns.py ucx-produce NBYTES CONSUMERS STEPS WARMUP HOST
    python _exchange_netns.py ucx-consume         # reads the producer's JSON line on stdin

A producer prints one JSON line for its consumers (the channel handle, or
the agent address, remote key and TCP address of the hand-written loop),
runs ``WARMUP`` steps, then times ``STEPS`` steps until every consumer is
done with the last one and prints ``{"rate": steps per second}``.  A
consumer prints ``{"count": steps seen, ...}`` when the producer ends.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

import numpy as np

#: Producer to consumer: "step t ready in slot s"; t = -1 ends the loop.
READY = struct.Struct("<qq")
#: Consumer to producer: "done t", the slot of step t may be reused.
DONE = struct.Struct("<q")
#: Seconds any one wait may take before the run is abandoned.
WAIT = 120.0


def _source(nbytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"peer closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# -- gpushare channel ---------------------------------------------------------


def gs_produce(nbytes: int, consumers: int, steps: int, warmup: int) -> None:
    import gpushare as gs

    src = _source(nbytes)
    producer = gs.channel(nbytes, np.uint8, consumers=consumers, slots=2)
    _emit({"handle": producer.handle.to_bytes().hex()})
    with producer:
        for _ in range(warmup):  # the first send waits until every consumer joined
            producer.send(src, timeout=WAIT)
        producer.drain(timeout=WAIT)
        t0 = time.perf_counter()
        for _ in range(steps):
            producer.send(src, timeout=WAIT)
        producer.drain(timeout=WAIT)
        elapsed = time.perf_counter() - t0
    _emit({"rate": steps / elapsed})


def gs_consume() -> None:
    import gpushare as gs

    handle = gs.ChannelHandle.from_bytes(bytes.fromhex(json.loads(sys.stdin.readline())["handle"]))
    local = np.empty(handle.shape, np.dtype(handle.typestr))
    count = 0
    with gs.subscribe(handle, timeout=WAIT) as ch:
        for step in ch:
            np.copyto(local, step.array)
            count += 1
        paths = sorted(set(ch.paths))
    _emit({"count": count, "paths": paths})


# -- hand-written: raw UCX get plus a TCP message per step ----------------------


def ucx_produce(nbytes: int, consumers: int, steps: int, warmup: int, host: str) -> None:
    from gpushare import ucx

    src = _source(nbytes)
    with ucx.Agent(transports="tcp") as agent, agent.create_memory_handle(2 * nbytes) as mh, \
            socket.create_server((host, 0)) as listener:
        slots = np.ndarray((2, nbytes), np.uint8, buffer=mh.buffer)
        key = mh.create_remote_key()
        _emit({"address": agent.address.hex(), "key": key.serialize().hex(), "nbytes": nbytes,
               "host": host, "port": listener.getsockname()[1]})
        listener.settimeout(WAIT)
        conns = []
        try:
            for _ in range(consumers):
                conn, _ = listener.accept()
                conn.settimeout(WAIT)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns.append(conn)
            acked = -1  # every consumer replied "done" up to this step

            def wait_done(upto: int) -> None:
                nonlocal acked
                while acked < upto:
                    acked += 1
                    for conn in conns:  # each consumer replies in step order
                        (t,) = DONE.unpack(_recv_exact(conn, DONE.size))
                        if t != acked:
                            raise RuntimeError(f"a consumer said done {t}; expected done {acked}")

            def step(t: int) -> None:
                s = t % 2
                wait_done(t - 2)  # the consumers are done with the step that used slot s last
                np.copyto(slots[s], src)
                slots[s, :8].view(np.int64)[0] = t  # lets the consumers check which step they read
                msg = READY.pack(t, s)
                for conn in conns:
                    conn.sendall(msg)

            for t in range(warmup):
                step(t)
            wait_done(warmup - 1)
            t0 = time.perf_counter()
            for t in range(warmup, warmup + steps):
                step(t)
            wait_done(warmup + steps - 1)
            elapsed = time.perf_counter() - t0
            for conn in conns:
                conn.sendall(READY.pack(-1, 0))
            for conn in conns:  # keep the registered memory until every consumer let go
                while conn.recv(4096):
                    pass
        finally:
            for conn in conns:
                conn.close()
        key.close()
    _emit({"rate": steps / elapsed})


def ucx_consume() -> None:
    from gpushare import ucx

    hello = json.loads(sys.stdin.readline())
    nbytes = int(hello["nbytes"])
    local = np.empty(nbytes, np.uint8)
    count = wrong = 0
    with ucx.Agent(transports="tcp") as agent:
        ep = agent.connect(bytes.fromhex(hello["address"]), timeout=WAIT)
        rk = ep.unpack_remote_key(bytes.fromhex(hello["key"]))
        lane = next((ln.strip() for ln in ep.transport_info().splitlines() if "lane[0]" in ln), "")
        with socket.create_connection((hello["host"], int(hello["port"])), timeout=WAIT) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                t, s = READY.unpack(_recv_exact(sock, READY.size))
                if t < 0:
                    break
                ep.mem_get(local, rk.base_address + s * nbytes, rk).wait(WAIT)
                sock.sendall(DONE.pack(t))
                wrong += int(local[:8].view(np.int64)[0] != t)
                count += 1
        rk.close()
        ep.close()
    _emit({"count": count, "wrong": wrong, "lane": lane})


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "gs-produce":
        gs_produce(*(int(a) for a in args))
    elif role == "gs-consume":
        gs_consume()
    elif role == "ucx-produce":
        ucx_produce(*(int(a) for a in args[:4]), args[4])
    elif role == "ucx-consume":
        ucx_consume()
    else:
        raise SystemExit(f"unknown role {role!r}")
