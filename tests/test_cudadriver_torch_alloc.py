"""gs.Arena as torch's pluggable allocator, checked against the CUDA driver
stand-in: segments torch would take through ``libgpushare_torch_alloc.so``
come out of the arena's chunks, tensors inside them export as one posix-fd
offer per chunk and arrive in another process, freed segments go back, and
what cannot be served is NULL, never a crash.  A contract check, not GPU
verification: torch itself is played with ctypes (the real thing is the
``gpu`` test in tests/test_torch_alloc.py)."""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.cudadriver

MiB = 1 << 20


@pytest.fixture
def spawn(standin_peers):
    """Start peers that load the stand-in, with torch's side of the allocator."""
    from _cudadriver_torch_peer import setup

    return lambda **env: standin_peers(setup, **env)


def test_torch_segments_come_from_the_arena_and_its_tensors_are_one_offer_per_chunk(spawn):
    exporter, importer = spawn(), spawn()
    got = exporter.call("torch_pool", "pool", 3, 4, 4096)
    segs = got["segments"]
    assert all(segs) and all(got["in_chunks"]) and got["served"] == 3
    assert got["stats"] == {"chunks": 1, "bytes": 8 * MiB, "in_use": 6 * MiB}  # three segments, one chunk
    assert got["parts"] == 1 and "posix-fd" in got["offers"][0]  # twelve tensors, one offer
    opened = importer.call("open_bundle", "v", got["share"])
    assert opened["paths"] == ("posix-fd",) and opened["vmm_mappings"] == 1 and opened["count"] == 12
    arrived = importer.call("bundle_get", "v")
    for i in range(3):
        for j in range(4):
            assert arrived[f"s{i}.t{j}"][3] == bytes([16 * i + j]) * 4096, (i, j)
    importer.call("close_bundle", "v")
    freed = exporter.call("torch_free", segs[1])
    assert freed["served"] == 2 and freed["stats"]["in_use"] == 4 * MiB
    again = exporter.call("torch_free", segs[1])  # twice: logged and ignored
    assert again == freed


def test_what_no_arena_can_serve_is_null_and_nothing_is_taken(spawn):
    exporter = spawn()
    exporter.call("torch_pool", "pool", 1, 1, 4096)
    got = exporter.call("torch_refusals")
    assert got["other_device"] is None and got["too_big"] is None
    assert got["stats"]["in_use"] == 2 * MiB  # the one segment, nothing more


def test_one_tensor_in_a_torch_segment_exports_on_posix_fd_with_its_offset(spawn):
    exporter, importer = spawn(), spawn()
    segs = exporter.call("torch_pool", "pool", 2, 4, 4096)["segments"]
    address = segs[1] + 2 * 4096  # tensor t2 of segment 1: filled with byte 18
    got = exporter.call("torch_one_tensor", "one", address, 4096)
    assert "posix-fd" in got["offers"] and got["offset"] == got["chunk_offset"]
    assert got["offset"] == segs[1] - segs[0] + 2 * 4096  # the segments lie one after another in one chunk
    opened = importer.call("open_view", "v", got["share"])
    assert opened["path"] == "posix-fd"
    assert importer.call("view_get", "v", 0, 4096) == bytes([18]) * 4096


def test_a_request_for_nothing_is_a_pointer_into_a_chunk_and_goes_back(spawn):
    exporter = spawn()
    exporter.call("torch_pool", "pool", 1, 1, 4096)
    got = exporter.call("torch_empty_request")
    assert got["ptr"] is not None and got["in_chunk"] and got["in_use"] == 256 and got["served"] == 2
    assert got["after"] == 0 and got["served_after"] == 1


def test_segments_taken_from_many_threads_at_once_do_not_overlap(spawn):
    exporter = spawn()
    exporter.call("torch_pool", "pool", 1, 1, 4096)
    got = exporter.call("torch_threads", 8, 16, 32 << 10)
    ptrs = sorted(got["ptrs"])
    assert len(ptrs) == 128 and all(ptrs)
    assert all(b - a >= 32 << 10 for a, b in itertools.pairwise(ptrs))  # no two segments overlap
    assert got["served"] == 129 and got["stats"] == {"chunks": 1, "bytes": 8 * MiB, "in_use": 6 * MiB}  # one chunk


def test_a_closed_arena_refuses_torch_and_still_takes_its_segments_back(spawn):
    exporter = spawn()
    segs = exporter.call("torch_pool", "pool", 2, 1, 4096)["segments"]
    got = exporter.call("torch_close_arena", segs[0])
    assert got["refused"] is None and got["given_back"] == 2 * MiB and got["served"] == 1


AT_EXIT = """
import atexit, ctypes
late = {}
def after_gpushare():  # registered first: runs after gpushare's own exit handlers
    lib = late["lib"]
    print("at exit:", lib.gpushare_torch_malloc(4096, 0, None))
    lib.gpushare_torch_free(late["held"], 2 << 20, 0, None)  # torch giving a segment back at exit
    print("freed at exit")
atexit.register(after_gpushare)
import gpushare as gs
from gpushare import _torch_alloc
arena = gs.Arena(device=0, chunk_size=8 << 20)
lib = late["lib"] = ctypes.CDLL(_torch_alloc.serve(arena))
lib.gpushare_torch_malloc.restype = ctypes.c_void_p
lib.gpushare_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.gpushare_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
held = late["held"] = lib.gpushare_torch_malloc(2 << 20, 0, None)
print("served:", held is not None, _torch_alloc.served())
"""


def test_at_exit_the_library_is_unhooked_and_answers_null(run_standin):
    out = run_standin(AT_EXIT).splitlines()
    assert out == ["served: True 1", "at exit: None", "freed at exit"]
