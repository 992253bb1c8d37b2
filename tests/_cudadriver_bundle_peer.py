"""Bundle steps for processes on the CUDA driver stand-in, used by
``tests/test_cudadriver_bundle.py``: every handler of
``tests/_cudadriver_peer.py`` plus the ones below."""

from __future__ import annotations

from typing import Any

import _cudadriver_peer as base
import numpy as np
from _cudadriver_peer import read_ptr, vmm_mappings, write_at


def setup() -> dict:
    state = base.setup()
    state["_handlers"] = {**base.HANDLERS, **HANDLERS}
    state["bundles"] = {}
    return state


def export_tree(state: dict, name: str, keys: dict[str, str], host: dict[str, bytes] | None = None) -> Any:
    """gs.export of {key: buffer kept as name} (and host arrays of the given bytes)."""
    import gpushare as gs

    tree: dict[str, Any] = {key: state["bufs"][buf] for key, buf in keys.items()}
    for key, data in (host or {}).items():
        tree[key] = state["bufs"][key] = np.frombuffer(data, np.uint8).copy()
    share = gs.export(tree)
    state["shares"][name] = share
    return share


def open_bundle(state: dict, name: str, share: Any, kwargs: dict | None = None) -> dict:
    import gpushare as gs

    before = vmm_mappings(state)
    bundle = gs.open(share, **(kwargs or {}))
    state["bundles"][name] = bundle
    return {"paths": bundle.paths, "count": bundle.count, "vmm_mappings": vmm_mappings(state) - before,
            "devices": {k: v.device for k, v in bundle.items()}, "why": bundle.why}


def bundle_get(state: dict, name: str) -> dict[str, tuple]:
    """bundle.get(): per key, what arrived (type, shape, typestr, bytes)."""
    out = {}
    for key, arr in state["bundles"][name].get().items():
        if isinstance(arr, np.ndarray):
            out[key] = ("ndarray", arr.shape, arr.dtype.str, arr.tobytes())
        else:
            cai = arr.__cuda_array_interface__
            out[key] = (type(arr).__name__, tuple(cai["shape"]), cai["typestr"],
                        read_ptr(int(cai["data"][0]), arr.nbytes))
    return out


def bundle_put(state: dict, name: str, values: dict[str, bytes]) -> None:
    """bundle.put of host bytes into tensors (one batch)."""
    state["bundles"][name].put({k: np.frombuffer(v, np.uint8).copy() for k, v in values.items()})


def bundle_mapped_bytes(state: dict, name: str, key: str) -> bytes:
    """A CUDA tensor's bytes read through its zero-copy mapping in this process."""
    view = state["bundles"][name][key]
    cai = view.__cuda_array_interface__
    return read_ptr(int(cai["data"][0]), view.nbytes, view.device)


def close_bundle(state: dict, name: str) -> dict:
    state["bundles"].pop(name).close()
    return {"vmm_mappings": vmm_mappings(state)}


def arena_tree(state: dict, name: str, count: int, nbytes: int) -> Any:
    """gs.export of ``count`` arrays from a CUDA arena (device 0), array i filled with byte i."""
    import gpushare as gs

    arena = state["arena"] = gs.Arena(device=0, chunk_size=2 << 20)
    tree = {}
    for i in range(count):
        arr = arena.empty(nbytes, "uint8")
        write_at(state, arr.ptr, bytes([i]) * nbytes)
        tree[f"t{i}"] = arr
    share = gs.export(tree)
    state["shares"][name] = share
    return share


class _Storage:
    """What ``untyped_storage()`` gives for a torch CUDA tensor: the memory
    of that tensor alone (each tensor of an ordinary state dict has a
    storage of its own), inside a caching-allocator segment."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self._ptr, self._nbytes = ptr, nbytes

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes


class TorchCudaTensor(base._CaiSlice):
    """A torch CUDA tensor as gpushare sees one (this machine's torch has no
    CUDA): ``__cuda_array_interface__``, a storage of its own, a torch type.
    Grouping by storage would make each one an allocation of its own."""

    __module__ = "torch"

    def untyped_storage(self) -> _Storage:
        cai = self.__cuda_array_interface__
        return _Storage(cai["data"][0], int(np.prod(cai["shape"])) * int(cai["typestr"][2:]))

    def new_empty(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("grouped by storage, not by caching-allocator segment")


def blocks_tree(state: dict, name: str, blocks: int, per_block: int, nbytes: int, torch_like: bool = False) -> Any:
    """gs.export of ``blocks * per_block`` tensors of ``nbytes`` each, in
    ``blocks`` cuMemAlloc blocks (as a caching allocator packs them): tensor
    ``k`` of block ``b`` is key ``t{b}_{k}``, its bytes all ``(b * 31 + k) % 251``.
    ``torch_like``: each tensor a :class:`TorchCudaTensor` with a storage of its own."""
    import gpushare as gs

    if torch_like:
        import torch  # noqa: F401  # a process of torch tensors has torch loaded, as gpushare's grouping checks
    kind = TorchCudaTensor if torch_like else base._CaiSlice
    tree: dict[str, Any] = {}
    for b in range(blocks):
        base.legacy_alloc(state, f"blk{b}", per_block * nbytes, 0)
        for k in range(per_block):
            base.write(state, f"blk{b}", k * nbytes, bytes([(b * 31 + k) % 251]) * nbytes)
            tree[f"t{b}_{k}"] = kind(state["bufs"][f"blk{b}"], k * nbytes, (nbytes,), "|u1")
    share = gs.export(tree)
    state["shares"][name] = share
    return share


def bundle_check_fill(state: dict, name: str, nbytes: int) -> dict:
    """bundle.get(), each tensor's bytes checked against blocks_tree's fill;
    the keys that differ, and how many were checked."""
    got = state["bundles"][name].get()
    wrong = []
    for key, arr in got.items():
        b, k = (int(x) for x in key[1:].split("_"))
        cai = arr.__cuda_array_interface__
        if read_ptr(int(cai["data"][0]), arr.nbytes) != bytes([(b * 31 + k) % 251]) * nbytes:
            wrong.append(key)
    return {"checked": len(got), "wrong": wrong}


HANDLERS = {"arena_tree": arena_tree, "export_tree": export_tree, "open_bundle": open_bundle, "bundle_get": bundle_get,
            "bundle_put": bundle_put, "bundle_mapped_bytes": bundle_mapped_bytes, "close_bundle": close_bundle,
            "blocks_tree": blocks_tree, "bundle_check_fill": bundle_check_fill}
