"""CUDA same-node paths.  The ``gpu`` tests skip, saying why, where no CUDA
device is present; the others check what the library says on any machine."""

from __future__ import annotations

import json
import pickle

import pytest
from _procs import Child
from conftest import cuda_device_reason

import gpushare as gs


def _setup() -> dict:
    from _same_node_gpu_peer import setup

    return setup()


@pytest.fixture
def child():
    c = Child(_setup)
    yield c
    assert c.close() == 0


def test_capabilities_is_plain_data_and_says_why_not():
    caps = gs.capabilities()
    assert json.loads(json.dumps(caps)) == caps
    assert pickle.loads(pickle.dumps(caps)) == caps
    assert caps["host"]["handle_types"] == ["posix-fd"]
    assert set(caps["versions"]) == {"gpushare", "cuda-core", "cuda-bindings"}
    assert isinstance(caps["imex"]["present"], bool)
    if caps["imex"]["present"]:
        assert caps["imex"]["channels"]
    else:
        assert caps["imex"]["reason"]
    reason = cuda_device_reason()
    if reason is None:
        assert caps["cuda"]["available"] and caps["cuda"]["driver_version"] > 0
        for dev in caps["cuda"]["devices"]:
            assert "cuda-ipc" in dev["handle_types"]
            assert ("fabric" in dev["handle_types"]) == (dev["fabric_reason"] is None)
    elif reason.startswith("no CUDA driver"):
        assert caps["cuda"] == {
            "available": False,
            "reason": caps["cuda"]["reason"],
            "driver_version": None,
            "devices": [],
        }
        assert caps["cuda"]["reason"].startswith("no CUDA driver: libcuda.so.1 not found")


@pytest.mark.skipif(
    not (cuda_device_reason() or "").startswith("no CUDA driver"), reason="a CUDA driver is present"
)
def test_device_paths_say_there_is_no_driver():
    with pytest.raises(gs.UnsupportedError, match="no CUDA driver"):
        gs.allocate(1 << 20, device=0)
    fabric = gs.VirtualMemoryFabricBufferDescriptor.from_handles([bytes(64)], [2 << 20])
    with pytest.raises(gs.UnsupportedError, match="no CUDA driver"):
        gs.import_buffer(fabric)


@pytest.mark.gpu
@pytest.mark.kernels
def test_vmm_posix_fd_between_processes_kernel_writes_exporter_sees(child):
    cupy = pytest.importorskip("cupy")
    from _same_node_gpu_peer import as_cupy

    size = (4 << 20) + 123
    buf = gs.allocate(size, device=0, chunk_size=2 << 20)
    mine = None
    try:
        assert buf.size == size
        mine = as_cupy(buf)
        mine.fill(1)
        cupy.cuda.runtime.deviceSynchronize()
        desc = gs.export_buffer(buf, handle_type="posix-fd")
        assert isinstance(desc, gs.PosixFdBufferDescriptor)
        assert len(desc.sizes) >= 3 and desc.device == 0
        assert child.call("import", desc) == size
        assert child.call("sum") == size
        child.call("fill", 3)
        assert int(mine.sum(dtype="uint64")) == 3 * size  # the importer's kernel wrote our memory
        child.call("close")
    finally:
        del mine
        buf.close()


@pytest.mark.gpu
@pytest.mark.kernels
def test_cupy_pool_array_through_legacy_ipc(child):
    cupy = pytest.importorskip("cupy")
    whole = cupy.arange(1 << 16, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()  # written before another process reads it
    part = whole[1000:5000]  # not at the start of its allocation: the offset travels
    desc = gs.export_buffer(part)
    assert isinstance(desc, gs.CudaIpcBufferDescriptor)
    assert desc.offset >= 1000 and desc.size == 4000
    assert child.call("import", desc) == 4000
    assert child.call("sum") == int(part.sum(dtype="uint64"))
    child.call("fill", 9)
    cupy.cuda.runtime.deviceSynchronize()
    assert int(whole[1000:5000].sum(dtype="uint64")) == 9 * 4000
    assert int(whole[:1000].sum(dtype="uint64")) == int(
        cupy.arange(1000, dtype=cupy.uint8).sum(dtype="uint64")
    )
    child.call("close")


@pytest.mark.gpu
def test_fabric_export_says_why_and_falls_back_to_posix_fd(child):
    """What one H200 without an NVLink fabric or IMEX channel gives (the
    machine the GPU check runs on; the stand-in without
    GPUSHARE_STANDIN_FABRIC likewise): no fabric handle type, a reason, a
    refused fabric export, and posix-fd as the descriptor another process
    imports."""
    caps = gs.capabilities(0)["cuda"]["devices"][0]
    assert "fabric" not in caps["handle_types"], caps
    assert caps["fabric_reason"], caps
    buf = gs.allocate(2 << 20, device=0)
    try:
        with pytest.raises(gs.UnsupportedError, match="(?i)fabric|imex") as info:
            gs.export_buffer(buf, handle_type="fabric")
        assert str(info.value)
        desc = gs.export_buffer(buf)
        assert isinstance(desc, gs.PosixFdBufferDescriptor)  # the fallback
        assert child.call("import", pickle.loads(pickle.dumps(desc))) == buf.size
        child.call("close")
    finally:
        buf.close()


def test_several_handle_types_are_requested_as_one_mask():
    # Struct handling only: needs cuda-bindings, not a driver or a device.
    driver = pytest.importorskip("cuda.bindings.driver")
    import ctypes

    from gpushare._cuda.vmm import _prop

    t = driver.CUmemAllocationHandleType
    both = _prop(driver, 3, ["posix_fd", "fabric"])
    mask = int(t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) | int(t.CU_MEM_HANDLE_TYPE_FABRIC)
    assert ctypes.c_uint32.from_address(both.getPtr() + 4).value == mask
    assert both.location.id == 3
    assert both.type == driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert _prop(driver, 0, ["posix_fd"]).requestedHandleTypes == t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    assert _prop(driver, 0, ()).requestedHandleTypes == t.CU_MEM_HANDLE_TYPE_NONE
