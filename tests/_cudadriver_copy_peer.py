"""Steps for tests/test_cudadriver_copy.py, in processes on the CUDA driver
stand-in: every handler of ``tests/_cudadriver_peer.py`` plus synchronous
gets timed and traced, in a thread whose current context is the device's
primary one (as CuPy and torch leave it)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import _cudadriver_peer as base

MARK = b"=== gpushare copy test: next get ===\n"


def setup() -> dict:
    state = base.setup()
    state["_handlers"] = {**base.HANDLERS, **HANDLERS}
    return state


def _destination(state: dict, name: str, n: int):
    import gpushare as gs

    base.make_current(state, 0)
    dst = gs.empty(n, dtype="u1", device=0)
    view = state["views"][name]
    for _ in range(40):  # the steady state: gpushare's stream made, the copy's time learned
        view.get(dst)
    return view, dst


def timed_gets(state: dict, name: str, n: int, count: int) -> dict:
    """``count`` gets of ``n`` bytes, each timed (ns); and their bytes."""
    view, dst = _destination(state, name, n)
    walls = []
    for _ in range(count):
        t = time.perf_counter_ns()
        view.get(dst)
        walls.append(time.perf_counter_ns() - t)
    return {"median_ns": statistics.median(walls), "walls": walls,
            "head": base.read_ptr(dst.ptr, 16), "tail": base.read_ptr(dst.ptr + n - 16, 16)}


def traced_gets(state: dict, name: str, n: int, count: int) -> list[list[str]]:
    """The driver calls of each of ``count`` gets (the stand-in's trace,
    ``GPUSHARE_STANDIN_TRACE=1``, written to stderr)."""
    view, dst = _destination(state, name, n)
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            for _ in range(count):
                os.write(2, MARK)
                view.get(dst)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    me = f"gpushare-standin[{os.getpid()}]: "
    gets = text.split(MARK.decode())[1:]
    return [[line[len(me):].split(" ->")[0] for line in g.splitlines() if line.startswith(me)] for g in gets]


HANDLERS = {"timed_gets": timed_gets, "traced_gets": traced_gets}


def get_on_device(state: dict, name: str, n: int, device: int) -> dict:
    """A get into, then a put from, CUDA memory of ``device``: the copy runs on that device."""
    import gpushare as gs

    view = state["views"][name]
    dst = gs.empty(n, dtype="u1", device=device)
    view.get(dst)
    got = base.read_ptr(dst.ptr, 16, device) + base.read_ptr(dst.ptr + n - 16, 16, device)
    src = gs.zeros(n, dtype="u1", device=device)
    view.put(src)
    back = gs.empty(n, dtype="u1", device=view.device)
    view.get(back)
    return {"view_device": view.device, "got": got, "after_put": base.read_ptr(back.ptr, 16, view.device)}


HANDLERS["get_on_device"] = get_on_device
