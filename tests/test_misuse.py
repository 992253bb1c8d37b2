"""Allocation misuse and its costs: gs.zeros writes no host page, a size
beyond the machine fails at once with OutOfMemoryError naming the size."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import gpushare as gs
from gpushare import _memory

MiB = 1 << 20


def rss() -> int:
    """This process's resident memory (VmRSS) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def beyond_the_machine() -> int:
    limit = _memory.host_limit()
    assert limit is not None, "/proc/meminfo has no MemTotal"
    return sum(limit) + 1


@pytest.mark.parametrize("huge_pages", ["auto", False])
def test_zeros_on_host_writes_no_page(huge_pages):
    before = rss()
    a = gs.zeros((256 * MiB // 8,), np.float64, huge_pages=huge_pages)
    grown = rss() - before
    assert grown < 16 * MiB, f"gs.zeros of 256 MiB made {grown / MiB:.0f} MiB resident"
    assert a.shape == (256 * MiB // 8,) and a.dtype == np.float64
    assert not a.any()  # reading faults the pages in: zeros
    del a


def test_zeros_after_memory_was_used_and_freed_reads_zeros():
    for _ in range(3):
        used = gs.empty((8 * MiB,), np.uint8)
        used[...] = 0xFF
        del used
        a = gs.zeros((8 * MiB,), np.uint8)
        assert not a.any()
        a[...] = 0xA5  # the next round's memory may be these pages
        del a


@pytest.mark.parametrize("make", [gs.zeros, gs.empty])
def test_a_size_beyond_ram_and_swap_fails_at_once_naming_it(make):
    before = rss()
    with pytest.raises(gs.OutOfMemoryError) as info:
        make((1 << 40,))  # 8 TiB of float64
    assert isinstance(info.value, MemoryError) and isinstance(info.value, gs.GpuShareError)
    assert "8796093022208 bytes (8.0 TiB) of host memory is more than this machine can hold" in str(info.value)
    assert rss() - before < 16 * MiB


def test_the_limit_is_ram_plus_swap():
    size = beyond_the_machine()
    with pytest.raises(gs.OutOfMemoryError, match=f"^{size} bytes"):
        gs.empty((size,), np.uint8)
    ram, swap = _memory.host_limit() or (0, 0)
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert (ram, swap) == (meminfo["MemTotal"], meminfo["SwapTotal"])


def test_a_size_within_the_machine_is_not_refused():
    a = gs.empty((64 * MiB,), np.uint8)  # far below any machine that runs the suite
    assert a.nbytes == 64 * MiB
    del a


def test_the_cuda_drivers_out_of_memory_is_an_out_of_memory_error():
    exc = gs.CUDAError("CUDA_ERROR_OUT_OF_MEMORY", "cuMemCreate")
    assert type(exc) is gs.CUDAOutOfMemoryError
    assert isinstance(exc, gs.OutOfMemoryError) and isinstance(exc, MemoryError)
    assert exc.status == "CUDA_ERROR_OUT_OF_MEMORY" and str(exc) == "cuMemCreate [CUDA_ERROR_OUT_OF_MEMORY]"
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is gs.CUDAOutOfMemoryError and str(back) == str(exc)
    other = gs.CUDAError("CUDA_ERROR_INVALID_VALUE", "cuMemMap")
    assert type(other) is gs.CUDAError and not isinstance(other, MemoryError)


def test_human_sizes():
    assert [_memory.human(n) for n in (0, 1023, 1024, 3 * MiB // 2, 1 << 40, 1 << 53)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "1.0 TiB", "8.0 PiB"]


@pytest.mark.gpu
def test_zeros_beyond_a_devices_memory_names_the_size_and_device():
    with pytest.raises(gs.OutOfMemoryError) as info:
        gs.zeros((1 << 50,), np.uint8, device=0)  # 1 PiB
    assert isinstance(info.value, gs.CUDAError)
    assert "1125899906842624 bytes (1.0 PiB) on CUDA device 0" in str(info.value)


def test_allocate_beyond_the_machine_is_an_out_of_memory_error():
    for size, device in ((1 << 50, "host"), (beyond_the_machine(), "host"), (1 << 50, None)):
        with pytest.raises(gs.OutOfMemoryError, match=f"^{size} bytes"):
            gs.allocate(size) if device is None else gs.allocate(size, device=device)


def test_allocate_defaults_to_host_memory_as_empty_and_zeros_do():
    with gs.allocate(8192) as buf:
        assert isinstance(buf, gs.HostBuffer) and buf.device == "host"
