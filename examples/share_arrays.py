"""Share arrays between two processes with gpushare.export and gpushare.open.

With CuPy and a CUDA device, the exporter shares two CuPy arrays: one on
memory from ``gpushare.allocate(n, device=0)`` (CUDA virtual memory: the
posix-fd path) and one from CuPy's own pool (legacy CUDA IPC).  Without them
(or with ``--host``) it shares the same two arrays in host memory with NumPy:
one on ``gpushare.allocate(n, device="host")`` (memfds: the host-fd path) and
a plain NumPy array (which the exporter copies with cross-memory attach: cma).

The importer, a second process started with the ``spawn`` method, prints the
path each share took and why, checks the exporter's data, then writes back
(through a zero-copy array where the path maps the memory, and with
``view.put`` always); the exporter checks it sees those writes.  Any mismatch
makes the program exit with status 1.

Run: python examples/share_arrays.py [--host]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from typing import Any

import numpy as np

import gpushare as gs

SHAPE = (256, 1024)  # float32: 1 MiB per array
DTYPE = np.float32


def array_module(force_host: bool) -> Any:
    """CuPy when it and a CUDA device are usable, else NumPy."""
    if force_host:
        return np
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # noqa: BLE001, S110  (no CuPy, no driver or no device: use host memory)
        pass
    return np


def expected(xp: Any, k: int) -> Any:
    """The exporter's initial contents of array ``k``."""
    return xp.arange(SHAPE[0] * SHAPE[1], dtype=DTYPE).reshape(SHAPE) * (k + 1)


def sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.runtime.deviceSynchronize()


def exported_arrays(xp: Any) -> list[tuple[str, Any, Any]]:
    """(name, object to export, array on the same memory) for each array."""
    nbytes = SHAPE[0] * SHAPE[1] * np.dtype(DTYPE).itemsize
    if xp is np:
        buf = gs.allocate(nbytes, device="host")
        allocated = np.asarray(buf).view(DTYPE).reshape(SHAPE)
        plain = np.empty(SHAPE, DTYPE)
        arrays = [("allocated", buf, allocated), ("plain", plain, plain)]
    else:
        buf = gs.allocate(nbytes, device=0)
        mem = xp.cuda.UnownedMemory(int(buf.handle), nbytes, buf)
        allocated = xp.ndarray(SHAPE, DTYPE, xp.cuda.MemoryPointer(mem, 0))
        plain = xp.empty(SHAPE, DTYPE)
        arrays = [("allocated", buf, allocated), ("plain", plain, plain)]
    for k, (_, _, arr) in enumerate(arrays):
        arr[...] = expected(xp, k)
    sync(xp)
    return arrays


def importer(conn: Any, force_host: bool) -> None:
    """The second process: open each share, check it, write back."""
    xp = array_module(force_host)
    ok = True
    for k, name, share in conn.recv():
        with gs.open(share) as view:
            print(f"importer: {name}: path={view.path}")
            print(f"importer: {name}: why={view.why}")
            # Copy out: works on every path.
            out = xp.empty(SHAPE, DTYPE)
            view.get(out)
            ok &= bool((out == expected(xp, k)).all())
            if view.path not in ("cma", "ucx-rma"):
                # Zero-copy: an array on the mapped memory itself.
                mapped = xp.asarray(view).view(DTYPE).reshape(SHAPE)
                ok &= bool((mapped == expected(xp, k)).all())
                mapped[0, :] = -1.0  # the exporter sees this store
                sync(xp)
                del mapped
            else:
                view.put(xp.full(SHAPE[1], -1.0, DTYPE))  # row 0
            # Copy in: the last row, at its byte offset.
            row = xp.full(SHAPE[1], -2.0, DTYPE)
            view.put(row, offset=(SHAPE[0] - 1) * row.nbytes)
        print(f"importer: {name}: read {out.nbytes} bytes, match={ok}")
    conn.send(ok)


def main(argv: list[str]) -> int:
    force_host = "--host" in argv
    xp = array_module(force_host)
    print(f"exporter: arrays are {xp.__name__}")
    arrays = exported_arrays(xp)
    shares = []
    for k, (name, obj, _) in enumerate(arrays):
        share = gs.export(obj)
        print(f"exporter: {name}: {share.nbytes} bytes, offered on {', '.join(share.offers)}")
        shares.append((k, name, share))

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=importer, args=(child, force_host))
    proc.start()
    child.close()
    parent.send(shares)  # a Share is plain data: it pickles like a tuple
    importer_ok = parent.recv() if parent.poll(120) else False
    proc.join(30)
    if proc.is_alive():
        proc.kill()

    ok = importer_ok and proc.exitcode == 0
    sync(xp)
    for k, (name, _, arr) in enumerate(arrays):
        want = expected(xp, k)
        want[0, :] = -1.0
        want[-1, :] = -2.0
        seen = bool((arr == want).all())
        print(f"exporter: {name}: sees the importer's writes: {seen}")
        ok &= seen
    if not ok:
        print("example failed: data did not match")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
