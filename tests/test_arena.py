"""gs.Arena: many arrays in few shareable buffers, so that a bundle of them
has one offer per chunk; blocks come back when their arrays go."""

from __future__ import annotations

import gc
import hashlib

import numpy as np
import pytest

import gpushare as gs
from _bundle_peer import cuda_sums
from _procs import Child


@pytest.fixture(scope="module")
def bpeer():
    import _bundle_peer

    child = Child(_bundle_peer.setup)
    yield child
    child.close()


def test_blocks_are_reused_and_merged_when_their_arrays_go():
    arena = gs.Arena(chunk_size=1 << 16)
    a, b, c = (arena.empty(1000, "uint8") for _ in range(3))
    assert arena.stats() == {"chunks": 1, "bytes": 1 << 16, "in_use": 3 * 1024}
    addresses = [x.__array_interface__["data"][0] for x in (a, b, c)]
    assert addresses[1] - addresses[0] == 1024 and addresses[2] - addresses[1] == 1024
    del a, b
    gc.collect()
    assert arena.stats()["in_use"] == 1024
    d = arena.empty(2000, "uint8")  # fits the two freed blocks, merged
    assert d.__array_interface__["data"][0] == addresses[0]
    big = arena.empty(1 << 17, "uint8")  # larger than a chunk: a chunk of its own
    assert arena.stats()["chunks"] == 2
    view = big[10:20]
    del big
    gc.collect()
    assert arena.stats()["in_use"] == 1024 + 2048 + (1 << 17)  # a view keeps its block
    del view, c, d
    gc.collect()
    assert arena.stats()["in_use"] == 0


def test_arena_arrays_are_one_offer_per_chunk_in_another_process(bpeer):
    arena = gs.Arena(chunk_size=1 << 20)
    state = {f"layers.{i}.w": arena.empty((64, 64), "float32") for i in range(40)}
    for i, t in enumerate(state.values()):
        t[...] = i
    share = gs.export(state)
    assert len(share._bundle.parts) == 1 and share._bundle.parts[0].offers[1] == "host-fd"
    opened = bpeer.call("open", "arena", share)
    assert opened["paths"] == ("host-fd",) and opened["mappings"] == 1
    seen = bpeer.call("describe", "arena")
    for i in range(40):
        got = seen[f"/layers.{i}.w"]
        assert got["zero_copy"] and tuple(got["shape"]) == (64, 64) and got["dtype"] == "float32"
        assert got["digest"] == hashlib.sha256(np.full((64, 64), i, np.float32).tobytes()).hexdigest()
    bpeer.call("close", "arena")


def test_arena_refuses_bad_arguments_and_use_after_close():
    with pytest.raises(gs.InvalidInputError, match="device"):
        gs.Arena(device=-1)
    with pytest.raises(gs.InvalidInputError, match="chunk_size"):
        gs.Arena(chunk_size=0)
    arena = gs.Arena()
    kept = arena.empty(4)
    arena.close()
    kept[:] = 1.0  # its chunk lives while the array does
    with pytest.raises(gs.ClosedError):
        arena.empty(4)
    with pytest.raises(gs.InvalidInputError, match="CuPy"):
        gs.Arena(device=0).cupy_malloc(16)


@pytest.mark.gpu
@pytest.mark.kernels
def test_cupy_arrays_from_the_arena_allocator_share_one_offer():
    cupy = pytest.importorskip("cupy", reason="needs CuPy (pip install 'gpushare[cupy]')")
    import multiprocessing as mp

    arena = gs.Arena(device=0, chunk_size=8 << 20)
    with cupy.cuda.using_allocator(arena.cupy_malloc):
        state = {f"w{i}": cupy.full((256, 256), i, dtype=cupy.float32) for i in range(8)}
    cupy.cuda.Device(0).synchronize()
    share = gs.export(state)
    assert len(share._bundle.parts) == 1 and "posix-fd" in share._bundle.parts[0].offers
    with mp.get_context("spawn").Pool(1) as workers:
        paths, sums = workers.apply(cuda_sums, (share, "cupy"))
    assert paths == ("posix-fd",) and sums == {f"w{i}": 256.0 * 256 * i for i in range(8)}
