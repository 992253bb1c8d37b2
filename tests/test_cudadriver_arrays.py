"""Typed CUDA arrays and CUDA channels between processes, against the CUDA
driver stand-in (``tests/cudadriver``): a contract check, not GPU verification."""

from __future__ import annotations

import pytest
from test_cudadriver import spawn  # noqa: F401 - the fixture

pytestmark = pytest.mark.cudadriver


def test_zeros_on_a_device_is_a_typed_cuda_array_that_posix_fd_carries(spawn):  # noqa: F811
    exporter, importer = spawn(), spawn()
    made = exporter.call("new_array", "a", (4, 6), "<f4", True)
    assert made["type"] == "CudaArray" and (made["shape"], made["typestr"]) == ((4, 6), "<f4")
    assert made["bytes"] == bytes(96) and made["dlpack"] == (2, 0)
    exporter.call("new_array", "b", (3, 5), "<i2", False, 0x2A)
    share = exporter.call("export", "b", {"readonly": True})
    assert share.offers == ("same-process", "posix-fd", "ucx-rma")
    assert (share.shape, share.typestr) == ((3, 5), "<i2")
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "posix-fd"
    seen = importer.call("view_array", "v")
    assert (seen["shape"], seen["typestr"], seen["readonly"]) == ((3, 5), "<i2", True)
    assert seen["dl"] == ((0, 16, 1), (3, 5), True)
    assert seen["bytes"] == b"\x2a" * 30


def test_part_of_a_cuda_array_keeps_the_mapped_path_with_its_offset(spawn):  # noqa: F811
    exporter, importer = spawn(), spawn()
    whole = bytes(range(256)) * 4  # 1 KiB: 16 rows of 16 float32
    made = exporter.call("new_array", "a", (16, 16), "<f4", False, whole)
    part = exporter.call("slice_array", "rows", "a", 4 * 64, (8, 16), "<f4")  # rows 4 to 11, as CuPy slices
    assert part["shape"] == (8, 16) and part["ptr"] == made["ptr"] + 256
    share = exporter.call("export", "rows")
    assert share.offers == ("same-process", "posix-fd", "ucx-rma")  # not only ucx-rma, as plain CUDA memory gets
    assert (share.offset, share.nbytes, share.shape) == (256, 512, (8, 16))
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "posix-fd" and opened["warnings"] == []
    seen = importer.call("view_array", "v")
    assert (seen["shape"], seen["typestr"]) == ((8, 16), "<f4")
    assert seen["bytes"] == whole[256:768]  # the part, through its own pointer
    assert importer.call("view_get", "v", 8, 4) == whole[264:268]
    importer.call("view_put", "v", 0, b"\xee" * 4)
    assert exporter.call("read_at", made["ptr"] + 252, 8) == whole[252:256] + b"\xee" * 4  # at the part's start
    importer.call("close_view", "v")


def test_a_cuda_channel_delivers_every_step_in_place(spawn):  # noqa: F811
    producer, consumer = spawn(), spawn()
    handle = producer.call("channel_create", (2, 8), "<u2", 2)
    assert handle.device == 0
    joined = consumer.call("channel_join", handle)
    assert joined == {"paths": ("posix-fd", "posix-fd"), "zero_copy": True}
    for t in range(5):
        assert producer.call("channel_send", 10 + t) == t
        got = consumer.call("channel_wait")
        assert got["type"] == "CudaArray" and got["step"] == t
        assert (got["shape"], got["typestr"], got["readonly"]) == ((2, 8), "<u2", True)
        assert got["bytes"] == bytes([10 + t]) * 32
    producer.call("channel_close")
    assert "closed the channel after 5 steps" in consumer.call("channel_wait")["closed"]
