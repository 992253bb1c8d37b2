"""gs.Arena.torch_mem_pool: torch's pluggable allocator over arena memory.

The library (``libgpushare_torch_alloc.so``) is built with the package and
checked here; the allocation path is checked against the CUDA driver
stand-in (tests/test_cudadriver_torch_alloc.py), and with real torch on a
GPU by the ``gpu`` test below."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import subprocess
import sys

import pytest
from _bundle_peer import cuda_sums

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


def test_torch_mem_pool_needs_cuda_memory_and_an_open_arena():
    with pytest.raises(gs.InvalidInputError, match="CUDA memory"):
        gs.Arena().torch_mem_pool()
    with pytest.raises(gs.InvalidInputError, match="CUDA memory"):
        gs.Arena().torch_allocator()
    arena = gs.Arena(device=0)
    arena.close()
    with pytest.raises(gs.ClosedError):
        arena.torch_mem_pool()


@pytest.mark.skipif(torch is None or hasattr(torch._C, "_cuda_customAllocator"),
                    reason="checks a CPU-only build of torch; this torch is absent or has CUDA")
def test_a_cpu_only_torch_is_told_it_needs_the_cuda_build():
    with pytest.raises(gs.UnsupportedError, match="built without CUDA"):
        gs.Arena(device=0).torch_allocator()


def test_importing_gpushare_imports_no_torch_and_loads_no_allocator_library():
    code = ("import sys, gpushare as gs; gs.Arena(device=0); maps = open('/proc/self/maps').read(); "
            "print('torch' in sys.modules, 'libgpushare_torch_alloc' in maps)")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


@pytest.mark.gpu
@pytest.mark.kernels
def test_tensors_of_a_torch_mem_pool_over_an_arena_share_one_offer_per_chunk():
    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs torch's CUDA build (torch.cuda.MemPool over a CUDA device); this torch is "
                    + ("not installed" if torch is None else f"{torch.__version__}, which sees no CUDA device"))
    arena = gs.Arena(device=0, chunk_size=64 << 20)
    pool = arena.torch_mem_pool()
    with torch.cuda.use_mem_pool(pool):
        state = {f"layers.{i}.w": torch.full((256, 256), float(i), device="cuda:0") for i in range(32)}
    torch.cuda.synchronize()
    assert _torch_alloc.served() >= 1 and arena.stats()["in_use"] >= 32 * 256 * 256 * 4
    from gpushare._cuda import vmm

    assert all(vmm.containing(t.data_ptr(), t.nbytes) is not None for t in state.values())  # in the chunks
    one = gs.export(state["layers.5.w"])
    found = vmm.containing(state["layers.5.w"].data_ptr(), 1)
    assert found is not None and one.offset == found[1] and "posix-fd" in one.offers
    share = gs.export(state)
    parts = share._bundle.parts
    assert len(parts) <= 2 and all("posix-fd" in p.offers for p in parts)  # 32 tensors, one chunk (two at most)
    with mp.get_context("spawn").Pool(1) as workers:
        paths, sums = workers.apply(cuda_sums, (share, "torch"))
    assert set(paths) == {"posix-fd"} and sums == {f"layers.{i}.w": 256.0 * 256 * i for i in range(32)}
    share.revoke()
    one.revoke()
    del state
    torch.cuda.synchronize()
    del pool
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.kernels
def test_an_ordinary_torch_cuda_state_dict_goes_with_a_handle_per_segment():
    """Every tensor its own storage, as torch.randn gives them: the bundle
    has one allocation per caching-allocator segment, far fewer than the
    2,000 tensors, and a spawned worker sums each one over cuda-ipc."""
    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA")
    state = {f"t{i}": torch.full((64,), float(i % 97), device="cuda:0") for i in range(2000)}
    torch.cuda.synchronize()
    segments = {s["address"] for s in torch.cuda.memory_snapshot() if s["device"] == 0}
    share = gs.export(state)
    assert share.count == 2000 and share.allocations <= len(segments) < 100, (share.allocations, len(segments))
    with mp.get_context("spawn").Pool(1) as workers:
        paths, sums = workers.apply(cuda_sums, (share, "torch"))
    assert set(paths) == {"cuda-ipc"} and sums == {f"t{i}": 64.0 * (i % 97) for i in range(2000)}
    share.revoke()
