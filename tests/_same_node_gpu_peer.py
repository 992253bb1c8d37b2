"""The other process of the GPU same-node tests: imports device buffers."""

from __future__ import annotations

import os
from typing import Any

import gpushare as gs


def as_cupy(buf: Any) -> Any:
    """A CuPy uint8 view of a cuda.core Buffer (no copy)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(int(buf.handle), buf.size, buf, buf.device_id)
    return cupy.ndarray((buf.size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def setup() -> dict:
    return {"_handlers": HANDLERS, "_reply": {"pid": os.getpid()}}


def do_import(state: dict, desc: Any) -> int:
    state["buf"] = gs.import_buffer(desc)
    return state["buf"].size


def fill(state: dict, value: int) -> None:
    import cupy

    as_cupy(state["buf"]).fill(value)  # a CuPy kernel writes the imported memory
    cupy.cuda.runtime.deviceSynchronize()


def total(state: dict) -> int:
    return int(as_cupy(state["buf"]).sum(dtype="uint64"))


def close(state: dict) -> None:
    state.pop("buf").close()


def import_twice(state: dict, desc: Any) -> list[int]:
    """Open handles after importing ``desc`` twice, then after closing each."""
    from gpushare._paths.cuda_ipc import open_handle_count

    a, b = gs.import_buffer(desc), gs.import_buffer(desc)
    counts = [open_handle_count()]
    a.close()
    counts.append(open_handle_count())
    b.close()
    counts.append(open_handle_count())
    return counts


HANDLERS = {"import": do_import, "fill": fill, "sum": total, "close": close, "import_twice": import_twice}
