"""gpushare.multiprocessing with CUDA memory, against the CUDA driver
stand-in (``tests/cudadriver``): a ``gs.allocate(device=0)`` cuda.core
``Buffer`` and a ``gs.zeros(device=0)`` array in one Queue message come back
as a ``Buffer`` and a ``CudaArray`` over the same memory, and the sender's
hold ends when the receiver lets them go.  A contract check, not GPU verification."""

from __future__ import annotations

import pytest
import test_cudadriver
from _procs import wait_for

spawn = test_cudadriver.spawn  # the fixture

pytestmark = pytest.mark.cudadriver


def test_a_buffer_and_a_cuda_array_travel_mapped_in_one_message(spawn):
    sender, receiver = spawn(), spawn()
    sender.call("allocate", "buf", 1 << 20, 0, None, 0x5A)
    made = sender.call("new_array", "arr", (8, 4), "<i4", False, 0x11)
    data = sender.call("mp_dumps", ["buf", "arr"])
    got = receiver.call("mp_loads", data)
    assert got["buf"]["type"] == "cuda.Buffer" and got["buf"]["bytes"] == b"\x5a" * (1 << 20)
    assert got["arr"]["type"] == "gpushare.CudaArray" and got["arr"]["bytes"] == b"\x11" * 128
    assert sender.call("mp_outstanding") == 1  # one bundle for the message, held for the receiver
    # mapped: what the receiver writes, the sender reads
    assert receiver.call("write_at", got["arr"]["ptr"], b"\x22" * 16) == "CUDA_SUCCESS"
    assert sender.call("read_at", made["ptr"], 16) == b"\x22" * 16
    receiver.call("drop_buf", "buf")
    assert sender.call("mp_outstanding") == 1  # the array still holds the lease
    receiver.call("drop_buf", "arr")
    assert wait_for(lambda: sender.call("mp_outstanding") == 0)
