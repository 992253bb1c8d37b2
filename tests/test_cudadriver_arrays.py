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
