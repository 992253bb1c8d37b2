"""The other process of the same-node tests: imports or exports host buffers."""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np

import gpushare as gs


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:gpushare" in line for line in f)


def counts(state: dict | None = None) -> dict[str, int]:
    gc.collect()
    return {"fds": fd_count(), "maps": memfd_maps()}


def importer_setup() -> dict:
    return {"_handlers": HANDLERS, "_reply": {"pid": os.getpid(), **counts()}}


def exporter_setup(size: int, chunk_size: int | None, fill: int) -> dict:
    buf = gs.allocate(size, device="host", chunk_size=chunk_size)
    np.asarray(buf)[:] = fill
    desc = gs.export_buffer(buf)
    return {"buf": buf, "_handlers": HANDLERS, "_reply": {"pid": os.getpid(), "desc": desc}}


def do_import(state: dict, desc: Any) -> dict:
    state["buf"] = gs.import_buffer(desc)
    return {"size": state["buf"].size, **counts()}


def try_import(state: dict, desc: Any) -> tuple[str, str]:
    try:
        buf = gs.import_buffer(desc)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    buf.close()
    return "ok", ""


def read(state: dict, offset: int, n: int) -> bytes:
    return np.asarray(state["buf"])[offset : offset + n].tobytes()


def write(state: dict, offset: int, data: bytes) -> None:
    np.asarray(state["buf"])[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


def close(state: dict) -> dict:
    state.pop("buf").close()
    return counts()


HANDLERS = {
    "import": do_import,
    "try_import": try_import,
    "read": read,
    "write": write,
    "close": close,
    "counts": counts,
}
