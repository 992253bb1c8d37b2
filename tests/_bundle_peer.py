"""The other process of the bundle tests: opens bundles it is sent and
reports what it sees, tensor by tensor."""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

import numpy as np


def setup() -> dict:
    return {"_handlers": HANDLERS, "bundles": {}, "_reply": {"pid": os.getpid()}}


def cuda_sums(share: Any, framework: str) -> tuple[tuple[str, ...], dict[str, float]]:
    """In a worker process: open a bundle of CUDA tensors and sum each one
    zero-copy with ``framework`` ("cupy" or "torch"): (its paths, the sums)."""
    import gpushare as gs

    if framework == "cupy":
        import cupy

        def as_array(v: Any) -> Any:
            return cupy.asarray(v)
    else:
        import torch

        def as_array(v: Any) -> Any:
            return torch.from_dlpack(v)
    with gs.open(share) as bundle:
        return bundle.paths, {k: float(as_array(v).sum()) for k, v in bundle.items()}


def memfd_mappings() -> int:
    """Mappings of memfds in this process (host-fd maps one per memfd)."""
    with open("/proc/self/maps") as f:
        return sum("/memfd:" in line for line in f)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open(state: dict, name: str, share: Any, kwargs: dict | None = None) -> dict:
    import gpushare as gs
    from gpushare._importer import get_importer

    before_maps, before_fds = memfd_mappings(), open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bundle = gs.open(share, **(kwargs or {}))
    state["bundles"][name] = bundle
    return {"paths": bundle.paths, "why": bundle.why, "count": bundle.count,
            "mappings": memfd_mappings() - before_maps, "fds": open_fds() - before_fds,
            "leases": get_importer().stats()["leases"],
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def _leaves(node: Any, out: dict, where: str) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _leaves(v, out, f"{where}/{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _leaves(v, out, f"{where}/{i}")
    else:
        out[where] = node


def _describe(state: dict, name: str) -> dict:
    """Per tensor: dtype, shape, digest of its values, whether it is mapped
    zero-copy (NumPy sees the mapping, not a copy), read-only."""
    bundle = state["bundles"][name]
    views: dict = {}
    _leaves(bundle.tree(), views, "")
    got: dict = {}
    _leaves(bundle.get(), got, "")
    out = {}
    for where, view in views.items():
        arr = got[where]
        entry = {"dtype": str(arr.dtype), "shape": arr.shape, "digest": hashlib.sha256(
            np.ascontiguousarray(arr).tobytes()).hexdigest(), "path": view.path, "typestr": view.typestr}
        if view.path in ("host-fd", "same-process"):
            mapped = np.asarray(view)
            entry["zero_copy"] = mapped.ctypes.data == view._local().address
            entry["mapped_digest"] = hashlib.sha256(np.ascontiguousarray(mapped).tobytes()).hexdigest()
            entry["writeable"] = bool(mapped.flags.writeable)
        out[where] = entry
    return out


def _write(state: dict, name: str, values: dict) -> None:
    """Put new values into tensors by key (one batch)."""
    state["bundles"][name].put(values)


def _close(state: dict, name: str) -> dict:
    from gpushare._importer import get_importer

    state["bundles"].pop(name).close()
    return {"leases": get_importer().stats()["leases"]}


def _get_one(state: dict, name: str, key: str) -> bytes:
    view = state["bundles"][name][key]
    out = np.empty(view.shape, dtype=np.dtype(view.typestr))
    view.get(out)
    return out.tobytes()


def _digest_all(state: dict, name: str) -> str:
    """One digest of every tensor's bytes as ``bundle.get()`` gives them, in key order."""
    got: dict = {}
    _leaves(state["bundles"][name].get(), got, "")
    h = hashlib.sha256()
    for where in sorted(got):
        h.update(where.encode() + b"\0" + np.ascontiguousarray(got[where]).tobytes())
    return h.hexdigest()


def _fill(state: dict, name: str, base: int) -> None:
    """Put into every tensor of a flat bundle of uint8 arrays ``(base + i) % 251``, ``i`` its key's number."""
    bundle = state["bundles"][name]
    views = bundle.tree()
    bundle.put({k: np.full(v.shape, (base + int(k[1:])) % 251, np.uint8) for k, v in views.items()})


HANDLERS = {"open": _open, "describe": _describe, "write": _write, "close": _close, "get_one": _get_one,
            "digest_all": _digest_all, "fill": _fill}
