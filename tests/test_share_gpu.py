"""The sharing API with CUDA memory between real processes (needs a CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

import gpushare as gs

from _gpu_share_peer import dtoh as _dtoh_bytes, htod as _htod
from _procs import Child
import _share_peer

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _dtoh(address: int, n: int, device: int = 0) -> np.ndarray:
    return np.frombuffer(_dtoh_bytes(address, n, device), np.uint8)


@pytest.fixture(scope="module")
def peer():
    child = Child(_share_peer.setup, timeout=120)
    yield child
    child.close()


def test_vmm_buffer_goes_over_posix_fd_and_writes_are_shared(peer):
    buf = gs.allocate(4 * MiB, device=0)
    try:
        data = np.arange(4 * MiB, dtype=np.uint64).astype(np.uint8)
        _htod(int(buf.handle), data)
        share = gs.export(buf, lifetime="revoked")
        assert "posix-fd" in share.offers and "ucx-rma" in share.offers
        info = peer.call("open", "vmm", share)
        # One H200 has no NVLink fabric nor IMEX: fabric is skipped, saying why.
        assert info["path"] == "posix-fd", info
        if "fabric" in share.offers:
            assert "not fabric" in info["why"]
        assert peer.call("get", "vmm", 1000, 16) == data[1000:1016].tobytes()
        peer.call("put", "vmm", 0, b"from the importer")
        assert _dtoh(int(buf.handle), 17).tobytes() == b"from the importer"
        peer.call("close", "vmm")
        share.revoke()
    finally:
        buf.close()


def test_fabric_export_says_why_not_without_a_fabric():
    """One H200 has no NVLink fabric and no IMEX channel (the machine the GPU
    check runs on; the stand-in without GPUSHARE_STANDIN_FABRIC likewise):
    a fabric export is refused saying why, and a share offers no fabric."""
    buf = gs.allocate(2 * MiB, device=0)
    try:
        with pytest.raises(gs.UnsupportedError, match="(?i)fabric|imex"):
            gs.export_buffer(buf, handle_type="fabric")
        share = gs.export(buf, lifetime="revoked")
        assert "fabric" not in share.offers
        share.revoke()
    finally:
        buf.close()


@pytest.mark.kernels
def test_cupy_pool_array_goes_over_cuda_ipc(peer):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    a = cupy.arange(MiB, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()  # written before it is shared, as a producer must
    share = gs.export(a, lifetime="revoked")
    assert share.offers[1:] == ("cuda-ipc", "ucx-rma")
    info = peer.call("open", "cupy", share)
    assert info["path"] == "cuda-ipc", info
    assert "not from gpushare.allocate" in info["why"]
    peer.call("put", "cupy", 10, b"\xaa\xbb")
    cupy.cuda.runtime.deviceSynchronize()
    assert int(a[10]) == 0xAA and int(a[11]) == 0xBB
    peer.call("close", "cupy")
    share.revoke()


@pytest.mark.kernels
def test_cupy_kernel_writes_through_a_mapped_view(peer):
    pytest.importorskip("cupy", reason="CuPy is not installed")
    buf = gs.allocate(MiB, device=0)
    try:
        _htod(int(buf.handle), np.zeros(MiB, np.uint8))
        share = gs.export(buf, lifetime="revoked")
        assert peer.call("open", "k", share)["path"] == "posix-fd"
        peer.call("cupy_write", "k", 4242, 17)  # cupy.asarray(view): zero-copy, a kernel writes
        assert int(_dtoh(int(buf.handle), MiB)[4242]) == 17
        peer.call("close", "k")
        share.revoke()
    finally:
        buf.close()


@pytest.mark.kernels
def test_torch_cuda_tensor_goes_over_cuda_ipc(peer):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA")
    t = torch.arange(4096, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # written before it is shared, as a producer must
    share = gs.export(t, lifetime="revoked")
    info = peer.call("open", "torch", share)
    assert info["path"] == "cuda-ipc", info
    assert peer.call("get", "torch", 0, 8) == bytes(range(8))
    peer.call("close", "torch")
    share.revoke()


@pytest.mark.kernels
def test_torch_expandable_segment_tensor_goes_over_posix_fd(peer):
    """torch's expandable segments map pages of their own (cuMemCreate, POSIX fd handles): a tensor
    across three of them maps in the importer as torch.multiprocessing maps it, not over ucx-rma."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA")
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        t = torch.arange(48 * MiB, dtype=torch.int64, device="cuda").to(torch.uint8)  # 48 MiB: pages of 20
        torch.cuda.synchronize()
        share = gs.export(t, lifetime="revoked")
        assert "posix-fd" in share.offers, share.offers
        info = peer.call("open", "xseg", share)
        assert info["path"] == "posix-fd", info
        assert peer.call("get", "xseg", 40 * MiB + 3, 4) == bytes([3, 4, 5, 6])
        peer.call("close", "xseg")
        share.revoke()
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


@pytest.mark.kernels
def test_cupy_arrays_on_a_non_default_stream_between_processes(peer):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    buf = gs.allocate(MiB, device=0)
    try:
        _htod(int(buf.handle), np.ones(MiB, np.uint8))
        share = gs.export(buf, lifetime="revoked")
        assert peer.call("open", "s", share)["path"] == "posix-fd"
        got = peer.call("cupy_stream_roundtrip", "s", 3)
        assert got["sum"] == MiB
        # The put came after the fill on the importer's stream, and was
        # visible when it returned: the importer synchronised nothing itself.
        assert int(cupy.asarray(_dtoh(int(buf.handle), MiB)).sum()) == 3 * MiB
        peer.call("close", "s")
        share.revoke()
    finally:
        buf.close()


@pytest.mark.kernels
def test_torch_cuda_tensor_from_dlpack_of_a_view(peer):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA")
    t = torch.full((4096,), 2, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    share = gs.export(t, lifetime="revoked")
    assert peer.call("open", "td", share)["path"] == "cuda-ipc"
    assert peer.call("torch_sum", "td") == 2 * 4096
    peer.call("close", "td")
    share.revoke()


def test_get_from_another_thread(peer):
    buf = gs.allocate(MiB, device=0)
    try:
        data = (np.arange(MiB) % 251).astype(np.uint8)
        _htod(int(buf.handle), data)
        share = gs.export(buf, lifetime="revoked")
        peer.call("open", "t", share)
        assert peer.call("get_in_thread", "t", 77, 4096) == data[77:77 + 4096].tobytes()
        peer.call("close", "t")
        share.revoke()
    finally:
        buf.close()


def test_visible_devices_remapped_between_processes():
    from gpushare._cuda import _driver as _cuda

    if _cuda.device_count() < 2:
        pytest.skip("needs two GPUs: this machine has one")
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
    try:
        child = Child(_share_peer.setup, timeout=120)
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    try:
        buf = gs.allocate(MiB, device=1)
        _htod(int(buf.handle), np.full(MiB, 9, np.uint8), 1)  # device 1's memory, copied in its context
        share = gs.export(buf, lifetime="revoked")
        info = child.call("open", "r", share)
        assert child.call("get", "r", 0, 4) == b"\x09" * 4
        child.call("close", "r")
        share.revoke()
        buf.close()
        assert info["path"] == "posix-fd"
    finally:
        child.close()


def test_chunked_vmm_buffer_over_ucx_rma(peer):
    size = 6 * MiB
    buf = gs.allocate(size, device=0, chunk_size=2 * MiB)
    try:
        data = (np.arange(size) % 251).astype(np.uint8)
        _htod(int(buf.handle), data)
        share = gs.export(buf, lifetime="revoked")
        assert peer.call("open", "c", share, {"prefer": ["ucx-rma"]})["path"] == "ucx-rma"
        # Across both allocation boundaries, both ways.
        assert peer.call("get", "c", 2 * MiB - 100, 2 * MiB + 200) == data[2 * MiB - 100:4 * MiB + 100].tobytes()
        peer.call("put", "c", 4 * MiB - 8, b"\xee" * 16)
        assert _dtoh(int(buf.handle), size)[4 * MiB - 8:4 * MiB + 8].tobytes() == b"\xee" * 16
        peer.call("close", "c")
        share.revoke()
    finally:
        buf.close()
