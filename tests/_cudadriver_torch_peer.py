"""Steps for processes on the CUDA driver stand-in, used by
``tests/test_cudadriver_torch_alloc.py``: every bundle handler of
``tests/_cudadriver_bundle_peer.py`` plus torch's side of its pluggable
allocator, played with ctypes as torch's caching allocator calls it (torch
itself needs a GPU)."""

from __future__ import annotations

import ctypes
from typing import Any

import _cudadriver_bundle_peer as bundles
from _cudadriver_peer import write_at

MiB = 1 << 20


def setup() -> dict:
    state = bundles.setup()
    state["_handlers"] = {**state["_handlers"], **HANDLERS}
    return state


class _Tensor:
    """What a torch CUDA tensor shows gs.export: its address, bytes and type."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def _library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.gpushare_torch_malloc.restype = ctypes.c_void_p
    lib.gpushare_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpushare_torch_free.restype = None
    lib.gpushare_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def torch_pool(state: dict, name: str, segments: int, per_segment: int, nbytes: int) -> dict:
    """A CUDA arena serving torch; ``segments`` segments of 2 MiB taken
    through the library's entry point, ``per_segment`` tensors of ``nbytes``
    inside each (tensor j of segment i filled with byte 16 * i + j), exported
    as one bundle."""
    import gpushare as gs
    from gpushare import _torch_alloc
    from gpushare._cuda import vmm

    arena = state["torch_arena"] = gs.Arena(device=0, chunk_size=8 * MiB)
    lib = state["torch_lib"] = _library(_torch_alloc.serve(arena))
    segs = [lib.gpushare_torch_malloc(2 * MiB, 0, None) for _ in range(segments)]
    tree = {}
    for i, seg in enumerate(segs):
        for j in range(per_segment):
            write_at(state, seg + j * nbytes, bytes([16 * i + j]) * nbytes)
            tree[f"s{i}.t{j}"] = _Tensor(seg + j * nbytes, nbytes)
    share = gs.export(tree)
    state["shares"][name] = share
    parts = share._bundle.parts
    return {"share": share, "segments": segs, "stats": arena.stats(), "served": _torch_alloc.served(),
            "in_chunks": [vmm.containing(seg, 2 * MiB) is not None for seg in segs],
            "parts": len(parts), "offers": [p.offers for p in parts]}


def torch_free(state: dict, ptr: int) -> dict:
    """torch gives a segment back."""
    from gpushare import _torch_alloc

    state["torch_lib"].gpushare_torch_free(ptr, 2 * MiB, 0, None)
    return {"stats": state["torch_arena"].stats(), "served": _torch_alloc.served()}


def torch_refusals(state: dict) -> dict:
    """What the entry points answer where no arena can serve: NULL, no crash."""
    lib = state["torch_lib"]
    other_device = lib.gpushare_torch_malloc(MiB, 3, None)
    too_big = lib.gpushare_torch_malloc(1 << 62, 0, None)
    lib.gpushare_torch_free(0x1000, 4096, 0, None)  # never handed out
    lib.gpushare_torch_free(None, 0, 0, None)
    return {"other_device": other_device, "too_big": too_big, "stats": state["torch_arena"].stats()}


def torch_one_tensor(state: dict, name: str, address: int, nbytes: int) -> dict:
    """gs.export of one tensor inside a segment: its share's offer and offset,
    and its offset in the chunk as vmm.containing finds it."""
    import gpushare as gs
    from gpushare._cuda import vmm

    share = state["shares"][name] = gs.export(_Tensor(address, nbytes))
    found = vmm.containing(address, nbytes)
    return {"share": share, "offers": share.offers, "offset": share.offset,
            "chunk_offset": None if found is None else found[1]}


def torch_empty_request(state: dict) -> dict:
    """torch asks for 0 bytes: a pointer into a chunk all the same, and
    given back like any other."""
    from gpushare import _torch_alloc
    from gpushare._cuda import vmm

    arena, lib = state["torch_arena"], state["torch_lib"]
    before = arena.stats()["in_use"]
    ptr = lib.gpushare_torch_malloc(0, 0, None)
    taken = {"ptr": ptr, "in_chunk": ptr is not None and vmm.containing(ptr, 1) is not None,
             "in_use": arena.stats()["in_use"] - before, "served": _torch_alloc.served()}
    lib.gpushare_torch_free(ptr, 0, 0, None)
    return {**taken, "after": arena.stats()["in_use"] - before, "served_after": _torch_alloc.served()}


def torch_threads(state: dict, threads: int, each: int, nbytes: int) -> dict:
    """``threads`` threads take ``each`` segments at once through the entry point."""
    import threading

    from gpushare import _torch_alloc

    lib = state["torch_lib"]
    got: list[list[int | None]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def take(i: int) -> None:
        start.wait()
        got[i] = [lib.gpushare_torch_malloc(nbytes, 0, None) for _ in range(each)]

    workers = [threading.Thread(target=take, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    ptrs = [p for row in got for p in row]
    return {"ptrs": ptrs, "stats": state["torch_arena"].stats(), "served": _torch_alloc.served()}


def torch_close_arena(state: dict, held: int) -> dict:
    """The arena closes while torch holds segments: new requests are NULL,
    and a held segment still goes back when torch frees it."""
    from gpushare import _torch_alloc

    arena, lib = state["torch_arena"], state["torch_lib"]
    arena.close()
    refused = lib.gpushare_torch_malloc(MiB, 0, None)
    before = arena.stats()["in_use"]
    lib.gpushare_torch_free(held, 2 * MiB, 0, None)
    return {"refused": refused, "given_back": before - arena.stats()["in_use"], "served": _torch_alloc.served()}


HANDLERS: dict[str, Any] = {"torch_pool": torch_pool, "torch_free": torch_free, "torch_refusals": torch_refusals,
                            "torch_one_tensor": torch_one_tensor, "torch_empty_request": torch_empty_request,
                            "torch_threads": torch_threads, "torch_close_arena": torch_close_arena}
