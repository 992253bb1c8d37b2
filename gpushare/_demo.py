"""``gpushare demo``: move data between two processes and say how it went."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from typing import Any

__all__ = ["run_demo"]


def _exporter(conn: Any, size: int) -> None:
    """The second process: registers memory, hands out its key, serves until told to stop."""
    import numpy as np

    from gpushare import ucx

    with ucx.Agent() as agent, agent.create_memory_handle(size) as mh:
        buf = np.frombuffer(mh.buffer, dtype=np.uint8)
        buf[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        key = mh.create_remote_key()
        conn.send((agent.address, key.serialize(), hashlib.sha256(buf).hexdigest()))
        conn.recv()  # the importer writes, then asks for a digest
        conn.send(hashlib.sha256(buf).hexdigest())
        conn.recv()  # done


def run_demo(size: int = 64 << 20, repeat: int = 5, out: Any = print) -> int:
    """Share ``size`` bytes from a second process over UCX RMA; return an exit code."""
    import numpy as np

    from gpushare import ucx

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exporter, args=(child, size), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            out("the exporting process did not start within 60 s")
            return 1
        address, key_blob, digest = parent.recv()
        with ucx.Agent() as agent:
            ep = agent.connect(address)
            rkey = ep.unpack_remote_key(key_blob)
            out(f"UCX {'.'.join(map(str, ucx.ucx_version()))}: process {proc.pid} exported "
                f"{size >> 20} MiB of host memory; this process ({mp.current_process().pid}) connected")
            lane = next((ln.strip("# ").strip() for ln in ep.transport_info().splitlines() if "lane[0]" in ln), "?")
            out(f"transport: {lane}")
            dst = np.empty(size, np.uint8)
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                ep.mem_get(dst, rkey.base_address, rkey).wait(120)
                times.append(time.perf_counter() - t0)
            ok_get = hashlib.sha256(dst).hexdigest() == digest
            get_bw = size / min(times) / 1e9
            out(f"get: {size >> 20} MiB in {min(times) * 1e3:.1f} ms = {get_bw:.2f} GB/s; "
                f"bytes match the exporter's: {ok_get}")
            src = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                ep.mem_put(src, rkey.base_address, rkey).wait(120)
                ep.flush().wait(120)
                times.append(time.perf_counter() - t0)
            parent.send("digest")
            ok_put = parent.recv() == hashlib.sha256(src).hexdigest()
            put_bw = size / min(times) / 1e9
            out(f"put+flush: {size >> 20} MiB in {min(times) * 1e3:.1f} ms = {put_bw:.2f} GB/s; "
                f"the exporter sees the bytes: {ok_put}")
            ep.close()
        parent.send("done")
        proc.join(30)
        if ok_get and ok_put:
            out("demo passed: data moved both ways between two processes with UCX RMA")
            return 0
        out("demo FAILED: the data did not match")
        return 1
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
