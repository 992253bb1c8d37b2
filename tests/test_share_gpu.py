"""The sharing API with CUDA memory between real processes (needs a CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

import gpushare as gs

from _procs import Child
import _share_peer

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def peer():
    child = Child(_share_peer.setup, timeout=120)
    yield child
    child.close()


def _htod(address: int, data: np.ndarray) -> None:
    from gpushare._paths import _cuda

    drv = _cuda.driver()
    _cuda.check(drv.cuMemcpyHtoD(address, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")


def _dtoh(address: int, n: int) -> np.ndarray:
    from gpushare._paths import _cuda

    out = np.empty(n, np.uint8)
    drv = _cuda.driver()
    _cuda.check(drv.cuMemcpyDtoH(out.ctypes.data, address, n), "cuMemcpyDtoH")
    return out


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
    buf = gs.allocate(2 * MiB, device=0)
    try:
        try:
            gs.export_buffer(buf, handle_type="fabric")
        except gs.UnsupportedError as exc:
            assert "fabric" in str(exc).lower() or "imex" in str(exc).lower()
        else:
            pytest.skip("this device exports fabric handles: a fabric is present")
        share = gs.export(buf, lifetime="revoked")
        assert "fabric" not in share.offers
        share.revoke()
    finally:
        buf.close()


def test_cupy_pool_array_goes_over_cuda_ipc(peer):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    a = cupy.arange(MiB, dtype=cupy.uint8)
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


def test_torch_cuda_tensor_goes_over_cuda_ipc(peer):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA")
    t = torch.arange(4096, dtype=torch.uint8, device="cuda")
    share = gs.export(t, lifetime="revoked")
    info = peer.call("open", "torch", share)
    assert info["path"] == "cuda-ipc", info
    assert peer.call("get", "torch", 0, 8) == bytes(range(8))
    peer.call("close", "torch")
    share.revoke()
