"""gpushare's CUDA paths between real processes, without kernels (needs a
CUDA device).

Nothing here runs a CuPy or torch kernel: bytes move with driver copies, so
these tests also run against the CUDA driver stand-in in the normal test
suite (``tests/test_gpu_on_standin.py``): there a contract check of the
tests and of gpushare's side of the driver's contract, never GPU
verification.  Where the outcome depends on the machine, each test asserts
what the machine class the GPU check runs on gives: one H200, no NVLink
fabric, no IMEX channel.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpushare as gs

from _gpu_share_peer import dtoh, htod, pattern

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_gpushare_demo_reports_cuda_memory_and_passes():
    """The README's first command on a machine with a GPU: it must export
    CUDA device memory (not fall back to host memory), pass over the best
    path, which on one H200 without a fabric is posix-fd, and over ucx-rma."""
    r = subprocess.run([sys.executable, "-m", "gpushare", "demo", "--size-mib", "8", "--repeat", "1", "--json"],
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"gpushare demo exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    report = json.loads(r.stdout)
    assert report["memory"] == "CUDA device 0", report
    assert report["passed"] is True, report
    assert [run["path"] for run in report["runs"]] == ["posix-fd", "ucx-rma"], report
    assert all(run["get_ok"] and run["put_ok"] for run in report["runs"]), report


def test_ucx_allocates_cuda_memory_in_a_fresh_process_with_no_current_context(fresh_gpu_peer):
    """gpushare.ucx's own CUDA allocation in a process that made no context
    current (UCX allocates only under a current context): the memory is
    device memory, holds bytes, and no context is left current."""
    p = fresh_gpu_peer()
    got = p.call("ucx_cuda_alloc", 3 * MiB + 5, timeout=120)
    assert got["before"] is None and got["after"] is None, got
    assert got["memory_type"] == "cuda" and got["size"] >= 3 * MiB + 5, got
    assert got["pointer_type"] == "CU_MEMORYTYPE_DEVICE", got
    assert got["bytes_ok"], got


def test_exportable_pool_memory_between_processes(fresh_gpu_peer, gpu_peer):
    """Memory from cuda.core's DeviceMemoryResource with ipc_enabled=True
    (an exportable stream-ordered pool) goes over cuda-ipc through the
    pool's own export, offset and all, and moves bytes both ways."""
    exporter = fresh_gpu_peer()
    n, offset = 64 * 1024, 4096
    share = exporter.call("export_pool", n, offset, 0x3C)
    assert "cuda-ipc" in share.offers
    info = gpu_peer.call("open", "pool", share)
    assert info["path"] == "cuda-ipc", info
    assert gpu_peer.call("get", "pool", 0, n) == b"\x3c" * n
    data = pattern(4096, 3)
    gpu_peer.call("put", "pool", 100, data)
    assert exporter.call("read_exported", 0, 100, 4096) == data
    assert exporter.call("read_exported", 0, 0, 100) == b"\x3c" * 100
    gpu_peer.call("close", "pool")
    exporter.call("revoke_exported", 0)


@pytest.mark.parametrize("prefer", ["posix-fd", "ucx-rma"])
def test_get_async_and_put_async_on_a_cuda_stream(gpu_peer, prefer):
    """put_async from and get_async into device memory on a non-blocking
    cuda.core stream: the put waits for the copy queued before it on the
    stream, the get lands before the copy queued after it."""
    n = 2 * MiB + 77
    buf = gs.allocate(n, device=0)
    try:
        htod(int(buf.handle), bytes(n))
        share = gs.export(buf, lifetime="revoked")
        assert gpu_peer.call("open", "async", share, {"prefer": [prefer]})["path"] == prefer
        got = gpu_peer.call("async_on_stream", "async", n, 5, timeout=120)
        assert dtoh(int(buf.handle), n) == pattern(n, 5)  # the put's bytes, visible here
        assert got["put"] and got["got"] == pattern(n, 5)
        gpu_peer.call("close", "async")
        share.revoke()
    finally:
        buf.close()


def test_a_channel_of_cuda_slots_delivers_every_step_in_place(gpu_peer):
    """A channel over CUDA memory: the consumer maps the slots (posix-fd,
    zero-copy) and reads each step's bytes as the producer wrote them."""
    from _gpu_share_peer import memset

    with gs.channel((4, 1024), "<u2", consumers=1, slots=2, device=0) as producer:
        assert producer.handle.device == 0
        assert gpu_peer.call("channel_join", producer.handle) == {"paths": ("posix-fd", "posix-fd"), "zero_copy": True}
        for t in range(5):
            arr = producer.acquire(timeout=30)
            memset(arr.ptr, 10 + t, arr.nbytes)  # written (and synchronised) before it is published
            assert producer.publish() == t
            got = gpu_peer.call("channel_wait")
            assert (got["step"], got["type"], got["shape"], got["typestr"], got["readonly"]) == (
                t, "CudaArray", (4, 1024), "<u2", True), got
            assert got["bytes"] == bytes([10 + t]) * 8192
    assert "closed the channel after 5 steps" in gpu_peer.call("channel_wait")["closed"]


def test_legacy_ipc_after_the_exporter_exits(fresh_gpu_peer):
    """cuMemAlloc memory over cuda-ipc, then its exporter exits.

    CUDA documents that freeing exported memory before the importer closes
    its handle (``cuIpcCloseMemHandle``) is undefined behaviour, and an
    exiting process frees its memory: so the importer's bytes are not
    asserted after the exit.  What is defined, and asserted: the importer
    lives on, closing its views and buffers works, and opening the share or
    its descriptor anew fails with gpushare's errors, not a crash."""
    exporter, importer = fresh_gpu_peer(), fresh_gpu_peer()
    n = MiB
    share = exporter.call("export_legacy", n, 0x21, {"lifetime": "none"})
    desc = exporter.call("export_legacy_desc", n, 0x42)
    assert type(desc).__name__ == "CudaIpcBufferDescriptor"
    info = importer.call("open", "v", share)
    assert info["path"] == "cuda-ipc", info
    assert importer.call("get", "v", 0, 64) == b"\x21" * 64
    assert importer.call("import_read", "b", desc, 64) == b"\x42" * 64
    assert exporter.close() == 0
    importer.call("close", "v")
    importer.call("close_buf", "b")
    err = importer.call("open_error", share, 5.0, timeout=60)
    assert err.startswith("ExporterUnreachableError: ") and "has exited" in err, err
    err = importer.call("import_error", desc)
    # The driver refuses the handle of memory freed with its process (the
    # error's name is the driver's), or gpushare refuses first.
    assert err.split(":")[0] in ("CUDAError", "ExporterUnreachableError"), err
    assert importer.call("views") == []  # it lives on
    assert importer.close() == 0


def test_a_child_that_sees_the_device_by_uuid_opens_a_share(fresh_gpu_peer):
    """CUDA_VISIBLE_DEVICES=GPU-<uuid> in a child: it sees exactly that
    device (as its device 0) and opens a share of it from this process over
    posix-fd, both ways.  The last device is used, so that where there are
    several the child's ordinal differs from ours."""
    from gpushare._cuda import _driver as _cuda

    ordinal = _cuda.device_count() - 1
    uuid = _cuda.device_uuid(ordinal)
    child = fresh_gpu_peer(CUDA_VISIBLE_DEVICES=f"GPU-{uuid}")
    assert child.call("visible") == {"uuids": [uuid], "CUDA_VISIBLE_DEVICES": f"GPU-{uuid}"}
    n = MiB
    buf = gs.allocate(n, device=ordinal)
    try:
        data = pattern(n, 9)
        htod(int(buf.handle), data, ordinal)
        share = gs.export(buf, lifetime="revoked")
        info = child.call("open", "u", share)
        assert info["path"] == "posix-fd", info
        assert child.call("view_device", "u") == 0
        assert child.call("get", "u", 1000, 4096) == data[1000:5096]
        child.call("put", "u", 0, b"seen by uuid")
        assert dtoh(int(buf.handle), 12, ordinal) == b"seen by uuid"
        child.call("close", "u")
        share.revoke()
    finally:
        buf.close()


def test_fabric_allocation_without_imex_is_not_permitted_and_gpushare_falls_back(gpu_peer, record_property):
    """Records the driver's answer to cuMemCreate with the fabric handle
    type, and asserts what one H200 without an IMEX channel gives:
    ``CUDA_ERROR_NOT_PERMITTED`` (the driver API documents it for fabric
    handles when the process has no IMEX channel; the stand-in gives the
    same without GPUSHARE_STANDIN_FABRIC).  gpushare then says why there is
    no fabric, and a share of its memory opens over posix-fd."""
    from cuda.bindings import driver as drv

    from gpushare._cuda import _driver as _cuda

    _cuda.driver()
    dev = _cuda.check(drv.cuDeviceGet(0), "cuDeviceGet")
    supported = _cuda.check(drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev), "cuDeviceGetAttribute")
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    err, handle = drv.cuMemCreate(2 * MiB, prop, 0)  # 2 MiB: the H200's (and the stand-in's) granularity
    if err == drv.CUresult.CUDA_SUCCESS:
        drv.cuMemRelease(handle)
    record_property("fabric_supported_attribute", int(supported))
    record_property("cuMemCreate_fabric", err.name)
    print(f"cuMemCreate(fabric) on device 0: {err.name} (HANDLE_TYPE_FABRIC_SUPPORTED={int(supported)})")
    assert err.name == "CUDA_ERROR_NOT_PERMITTED", (err.name, int(supported))

    caps = gs.capabilities(0)["cuda"]["devices"][0]
    assert "fabric" not in caps["handle_types"] and caps["fabric_reason"], caps
    buf = gs.allocate(2 * MiB, device=0)
    try:
        with pytest.raises(gs.UnsupportedError, match="(?i)fabric|imex"):
            gs.export_buffer(buf, handle_type="fabric")
        assert isinstance(gs.export_buffer(buf), gs.PosixFdBufferDescriptor)
        share = gs.export(buf, lifetime="revoked")
        info = gpu_peer.call("open", "nofabric", share)
        assert info["path"] == "posix-fd", info
        if "fabric" in share.offers:
            assert "not fabric" in info["why"], info
        gpu_peer.call("close", "nofabric")
        share.revoke()
    finally:
        buf.close()


def test_device_to_device_get_and_put_over_posix_fd(gpu_peer):
    """view.get into and view.put from device memory of the importer's own
    (device to device through the mapping)."""
    n = 3 * MiB
    buf = gs.allocate(n, device=0)
    try:
        data = pattern(n, 11)
        htod(int(buf.handle), data)
        share = gs.export(buf, lifetime="revoked")
        assert gpu_peer.call("open", "d2d", share)["path"] == "posix-fd"
        assert gpu_peer.call("get_into_device", "d2d", 12345, MiB) == data[12345:12345 + MiB]
        gpu_peer.call("put_from_device", "d2d", 7, b"device to device")
        assert dtoh(int(buf.handle), 23)[7:] == b"device to device"
        gpu_peer.call("close", "d2d")
        share.revoke()
    finally:
        buf.close()
