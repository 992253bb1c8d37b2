"""gs.Arena.torch_mem_pool: torch's pluggable allocator over arena memory.

The library (``libgpushare_torch_alloc.so``) is built with the package and
checked here; the allocation path is checked against the CUDA driver
stand-in (tests/test_cudadriver_torch_alloc.py), and with real torch on a
GPU by the ``gpu`` test below."""

from __future__ import annotations

import ctypes
import multiprocessing as mp

import pytest

try:  # torch is optional; imported before UCX loads (see docs/ucx.md)
    import torch
except ImportError:  # pragma: no cover - CI installs it
    torch = None

import gpushare as gs
from gpushare import _torch_alloc


def test_the_library_is_built_beside_the_native_module_with_torchs_entry_points():
    lib = ctypes.CDLL(_torch_alloc.library_path())
    malloc = lib.gpushare_torch_malloc
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    assert callable(lib.gpushare_torch_free) and callable(lib.gpushare_torch_set_hooks)
    assert malloc(4096, 9, None) is None  # no arena serves device 9: NULL, which torch reports as out of memory


def test_one_arena_serves_torch_on_each_device():
    first, second = gs.Arena(device=5), gs.Arena(device=5)
    _torch_alloc.serve(first)
    _torch_alloc.serve(first)  # again: the same arena
    with pytest.raises(gs.InvalidInputError, match="already serves torch on device 5"):
        _torch_alloc.serve(second)
    first.close()
    _torch_alloc.serve(second)  # the first is closed: the second takes over
    second.close()


def test_torch_mem_pool_needs_cuda_memory():
    with pytest.raises(gs.InvalidInputError, match="CUDA memory"):
        gs.Arena().torch_mem_pool()


def _torch_reader(share):
    import torch

    import gpushare as gs

    with gs.open(share) as bundle:
        return bundle.paths, {k: float(torch.from_dlpack(v).sum()) for k, v in bundle.items()}


@pytest.mark.gpu
@pytest.mark.kernels
def test_tensors_of_a_torch_mem_pool_over_an_arena_share_one_offer_per_chunk():
    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs the CUDA build of torch on a CUDA device")
    arena = gs.Arena(device=0, chunk_size=64 << 20)
    pool = arena.torch_mem_pool()
    with torch.cuda.use_mem_pool(pool):
        state = {f"layers.{i}.w": torch.full((256, 256), float(i), device="cuda:0") for i in range(32)}
    torch.cuda.synchronize()
    assert _torch_alloc.served() >= 1
    share = gs.export(state)
    parts = share._bundle.parts
    assert len(parts) <= 2 and all("posix-fd" in p.offers for p in parts)  # 32 tensors, one chunk (two at most)
    with mp.get_context("spawn").Pool(1) as workers:
        paths, sums = workers.apply(_torch_reader, (share,))
    assert set(paths) == {"posix-fd"} and sums == {f"layers.{i}.w": 256.0 * 256 * i for i in range(32)}
    share.revoke()
    del state
    torch.cuda.synchronize()
    del pool
    torch.cuda.empty_cache()
