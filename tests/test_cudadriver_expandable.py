"""Another allocator's CUDA virtual memory (torch's expandable segments:
allocations mapped back to back into one reservation) over posix-fd, against
the CUDA driver stand-in (``tests/cudadriver``): a contract check, not GPU
verification."""

from __future__ import annotations

import numpy as np
import pytest
from test_cudadriver import spawn  # noqa: F401 - the fixture

pytestmark = pytest.mark.cudadriver

MiB = 1 << 20
CHUNK = 2 * MiB  # torch's page below 1 MiB requests (the stand-in's granularity)


def _pattern(start: int, n: int) -> bytes:
    return ((np.arange(start, start + n, dtype=np.uint64)) & 0xFF).astype(np.uint8).tobytes()


def test_a_tensor_across_three_pages_of_a_segment_opens_mapped_with_its_bytes(spawn):  # noqa: F811
    exporter, importer = spawn(), spawn()
    va = exporter.call("expandable_alloc", "seg", CHUNK, 4)
    start, n = CHUNK - 4096, CHUNK + 8192  # from the end of page 0 into page 2
    assert exporter.call("expandable_tensor", "t", "seg", start, n) == va + start
    share = exporter.call("export", "t")
    assert share.offers == ("same-process", "posix-fd", "ucx-rma")
    assert (share.offset, share.nbytes) == (start, n)  # its place in the pages it lies in
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "posix-fd" and opened["warnings"] == []
    seen = importer.call("view_array", "v")
    assert seen["bytes"] == _pattern(start, n)
    assert importer.call("vmm_mappings") == 1
    # The same memory: a put lands in the exporter's page 1.
    importer.call("view_put", "v", 8192, b"\xee" * 16)
    assert exporter.call("read_at", va + start + 8192, 16) == b"\xee" * 16
    importer.call("close_view", "v")
    assert importer.call("vmm_mappings") == 0


def test_a_bundle_of_tensors_in_one_segment_maps_its_pages_once_each(standin_peers):
    from _cudadriver_bundle_peer import setup

    exporter, importer = standin_peers(setup), standin_peers(setup)
    exporter.call("expandable_alloc", "seg", CHUNK, 3)
    places = {"a": (0, 4096), "b": (4096, 1024), "c": (CHUNK + 512, CHUNK)}  # c runs into page 2
    for name, (start, n) in places.items():
        exporter.call("expandable_tensor", name, "seg", start, n)
    share = exporter.call("export_tree", "bundle", {name: name for name in places})
    opened = importer.call("open_bundle", "v", share)
    # a and b lie in page 0, one allocation; c in pages 1 and 2, another
    assert opened["paths"] == ("posix-fd", "posix-fd") and opened["count"] == 3
    assert opened["vmm_mappings"] == 2
    for name, (start, n) in places.items():
        assert importer.call("bundle_mapped_bytes", "v", name) == _pattern(start, n), name
    assert importer.call("close_bundle", "v") == {"vmm_mappings": 0}


def test_memory_whose_allocations_do_not_export_as_fds_goes_over_ucx_rma(spawn):  # noqa: F811
    exporter = spawn()
    exporter.call("expandable_alloc", "seg", CHUNK, 2, False)
    exporter.call("expandable_tensor", "t", "seg", 0, CHUNK + 4096)
    share = exporter.call("export", "t")
    assert share.offers == ("same-process", "ucx-rma")
