"""A process with a region server (exporter) or a client (second importer), for the server tests."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from _procs import idle_cpu


def _counts() -> dict:
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


def setup_exporter() -> dict:
    from gpushare._ucx import _server

    before = _counts()
    srv = _server.server()
    state: dict[str, Any] = {"server": srv, "regions": {}, "arrays": {}, "_handlers": HANDLERS}
    state["_reply"] = {"address": srv.address, "pid": os.getpid(), "before": before, "counts": _counts()}
    return state


def _add(state: dict, name: str, size: int, seed: int, readonly: bool = False) -> int:
    arr = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    if readonly:
        arr.flags.writeable = False
    region = state["server"].add_region(arr, readonly=readonly)
    state["regions"][name] = region
    state["arrays"][name] = arr
    return region.id


def _add_many(state: dict, prefix: str, count: int, size: int) -> list[int]:
    return [_add(state, f"{prefix}{i}", size, i) for i in range(count)]


def _grant(state: dict, name: str) -> tuple[int, bytes]:
    return state["regions"][name].grant()


def _grant_many(state: dict, prefix: str, count: int) -> list[tuple[int, bytes]]:
    return [state["regions"][f"{prefix}{i}"].grant() for i in range(count)]


def _revoke(state: dict, name: str, key: bytes) -> bool:
    return state["regions"][name].revoke(key)


def _close(state: dict, name: str) -> None:
    state["regions"][name].close()


def _digest(state: dict, name: str, offset: int = 0, n: int | None = None) -> str:
    arr = state["arrays"][name]
    end = arr.size if n is None else offset + n
    return hashlib.sha256(arr[offset:end]).hexdigest()


def _read(state: dict, name: str, offset: int, n: int) -> bytes:
    return state["arrays"][name][offset : offset + n].tobytes()


def _counts_cmd(state: dict) -> dict:
    return _counts()


def _stats(state: dict) -> dict:
    return state["server"].stats()


HANDLERS: dict[str, Any] = {
    "add": _add,
    "add_many": _add_many,
    "grant": _grant,
    "grant_many": _grant_many,
    "revoke": _revoke,
    "close": _close,
    "digest": _digest,
    "read": _read,
    "counts": _counts_cmd,
    "stats": _stats,
    "idle_cpu": idle_cpu,
    "die": lambda state: os._exit(3),
}


# -- a second importer ------------------------------------------------------------


def setup_importer() -> dict:
    return {"_handlers": {"get": _imp_get, "put": _imp_put}, "_reply": {"pid": os.getpid()}}


def _imp_get(state: dict, address: bytes, cap: tuple, offset: int, n: int) -> bytes:
    from gpushare._ucx import _peer

    out = bytearray(n)
    _peer.client().connect(address).get(cap[0], cap[1], offset, out, timeout=30)
    return bytes(out)


def _imp_put(state: dict, address: bytes, cap: tuple, offset: int, data: bytes) -> None:
    from gpushare._ucx import _peer

    _peer.client().connect(address).put(cap[0], cap[1], offset, data, timeout=30)
