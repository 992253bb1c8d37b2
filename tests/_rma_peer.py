"""The other side of the RMA tests: a process with its own Agent and memory."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from _procs import Child, idle_cpu


def recorder() -> tuple[Any, list, threading.Event]:
    """A request callback that records its (error, data) calls, the list, and an event set by
    its first call."""
    seen: list = []
    done = threading.Event()

    def callback(error, data):
        seen.append((error, data))
        done.set()

    return callback, seen, done


def setup(region_size: int, agent_kwargs: dict | None = None) -> dict:
    from gpushare import ucx

    agent = ucx.Agent(**(agent_kwargs or {}))
    mh = agent.create_memory_handle(region_size)
    key = mh.create_remote_key()
    state = {"agent": agent, "mh": mh, "eps": {}, "keys": {}}
    state["_handlers"] = HANDLERS
    state["_reply"] = {
        "address": agent.address,
        "key": key.serialize(),
        "base": key.base_address,
        "size": key.size,
        "pid": os.getpid(),
    }
    return state


@contextlib.contextmanager
def connected(region_size: int) -> Iterator[tuple]:
    """(an agent of this process, an endpoint to a peer of this module, the peer's key, the
    peer): the peer's region ``region_size`` bytes; all closed at the end."""
    from gpushare import ucx

    child = Child(setup, region_size)
    try:
        with ucx.Agent() as agent:
            ep = agent.connect(child.hello["address"])
            yield agent, ep, ep.unpack_remote_key(child.hello["key"]), child
    finally:
        child.close()


def _read(state: dict, offset: int, n: int) -> bytes:
    return bytes(state["mh"].buffer[offset : offset + n])


def _digest(state: dict, offset: int, n: int) -> str:
    return hashlib.sha256(state["mh"].buffer[offset : offset + n]).hexdigest()


def _write(state: dict, offset: int, data: bytes) -> None:
    state["mh"].buffer[offset : offset + len(data)] = data


def _fill(state: dict, offset: int, n: int, seed: int) -> str:
    import numpy as np

    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    state["mh"].buffer[offset : offset + n] = data.tobytes()
    return hashlib.sha256(data).hexdigest()


def _connect(state: dict, address: bytes, key: bytes) -> None:
    ep = state["agent"].connect(address)
    state["ep"] = ep
    state["rk"] = ep.unpack_remote_key(key)


def _put(state: dict, offset: int, data: bytes) -> None:
    ep, rk = state["ep"], state["rk"]
    ep.mem_put(data, rk.base_address + offset, rk).wait(30)
    ep.flush().wait(30)


def _get(state: dict, offset: int, n: int) -> bytes:
    ep, rk = state["ep"], state["rk"]
    out = bytearray(n)
    ep.mem_get(out, rk.base_address + offset, rk).wait(30)
    return bytes(out)


def _close_handle(state: dict) -> None:
    state["mh"].close()


def _close_agent(state: dict) -> None:
    state["agent"].close()


def _die(state: dict) -> None:
    os._exit(3)


HANDLERS: dict[str, Any] = {
    "idle_cpu": idle_cpu,
    "read": _read,
    "digest": _digest,
    "write": _write,
    "fill": _fill,
    "connect": _connect,
    "put": _put,
    "get": _get,
    "close_handle": _close_handle,
    "close_agent": _close_agent,
    "die": _die,
}
