"""gs.Arena as torch's pluggable allocator, checked against the CUDA driver
stand-in: segments torch would take through ``libgpushare_torch_alloc.so``
come out of the arena's chunks, tensors inside them export as one posix-fd
offer per chunk and arrive in another process, freed segments go back, and
what cannot be served is NULL, never a crash.  A contract check, not GPU
verification: torch itself is played with ctypes (the real thing is the
``gpu`` test in tests/test_torch_alloc.py)."""

from __future__ import annotations

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
