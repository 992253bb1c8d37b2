"""Share a NumPy array between two processes with UCX remote memory access.

The exporter registers an array and sends its agent address and a remote key
through a multiprocessing pipe; the importer connects, reads the array with a
get, writes a reply with a put, and the exporter sees it.

Run: python examples/rma_two_processes.py
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from gpushare import ucx


def exporter(conn) -> None:
    array = np.arange(1024, dtype=np.float64)
    with ucx.Agent() as agent, agent.create_memory_handle(array.nbytes, array) as mh:
        conn.send((agent.address, mh.create_remote_key().serialize()))
        conn.recv()  # the importer is done
        print(f"exporter: first element is now {array[0]}")
        conn.send(float(array[0]))


def main() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=exporter, args=(child,))
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise SystemExit("example failed: the exporter did not answer")
    address, key = parent.recv()
    with ucx.Agent() as agent:
        ep = agent.connect(address)
        rkey = ep.unpack_remote_key(key)
        copy = np.empty(1024, dtype=np.float64)
        ep.mem_get(copy, rkey.base_address, rkey).wait(timeout=30)
        print(f"importer: read {copy.nbytes} bytes, sum = {copy.sum()}")
        ep.mem_put(np.array([-1.0]), rkey.base_address, rkey).wait(timeout=30)
        ep.flush().wait(timeout=30)
    parent.send("done")
    seen = parent.recv() if parent.poll(60) else None
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    if copy.sum() != sum(range(1024)) or seen != -1.0 or proc.exitcode != 0:
        raise SystemExit("example failed: data did not match")
    print("ok")


if __name__ == "__main__":
    main()
