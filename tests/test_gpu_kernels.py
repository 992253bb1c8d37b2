"""gpushare with CuPy and torch kernels between real processes (needs a CUDA
device, and CuPy or a CUDA build of torch).

Marked ``kernels``: against the CUDA driver stand-in, which runs no kernel,
they skip; only a GPU runs them.  Outcomes that depend on the machine are
asserted for the machine class the GPU check runs on: one H200, no NVLink
fabric, no IMEX channel.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpushare as gs

from _gpu_share_peer import dtoh, htod, pattern

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]

MiB = 1 << 20


def _cupy():
    return pytest.importorskip("cupy", reason="CuPy is not installed (pip install gpushare[cupy])")


def _torch_cuda():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA")
    return torch


def test_ucx_rma_orders_cupy_work_on_a_non_blocking_stream(gpu_peer):
    """Over ucx-rma, a put of a CuPy array that a kernel fills on a
    non-blocking stream (behind a kernel that keeps the stream busy) carries
    the kernel's bytes, ordered by the array's own stream; a get into a
    CuPy array lands after the stream's earlier kernel and before its next."""
    _cupy()
    n = 8 * MiB
    buf = gs.allocate(n, device=0)
    try:
        htod(int(buf.handle), bytes(n))
        share = gs.export(buf, lifetime="revoked")
        assert gpu_peer.call("open", "rma", share, {"prefer": ["ucx-rma"]})["path"] == "ucx-rma"
        gpu_peer.call("rma_stream_put", "rma", n, 0x77, timeout=120)
        assert dtoh(int(buf.handle), n) == b"\x77" * n  # the kernel's bytes, not the zeros before it
        data = pattern(n, 4)
        htod(int(buf.handle), data)
        got = gpu_peer.call("rma_stream_get", "rma", n, timeout=120)
        assert got["first"] == data[:16]  # the get's bytes, not the fill queued before it
        assert got["sum"] == sum(data)  # and the kernel after the get saw them
        gpu_peer.call("close", "rma")
        share.revoke()
    finally:
        buf.close()


def test_read_only_posix_fd_share_reads_in_cupy_and_a_kernel_write_faults(gpu_peer, fresh_gpu_peer):
    """A read-only share of gpushare VMM memory maps read-only over
    posix-fd: CuPy reads it; a kernel that writes it faults (an illegal
    address, which leaves the context unusable, so in a throwaway process),
    and the exporter's bytes stay as they were."""
    _cupy()
    n = 2 * MiB
    buf = gs.allocate(n, device=0)
    try:
        data = pattern(n, 6)
        htod(int(buf.handle), data)
        share = gs.export(buf, lifetime="revoked", readonly=True)
        assert gpu_peer.call("open", "ro", share)["path"] == "posix-fd"
        assert gpu_peer.call("cupy_sum", "ro") == sum(data)
        gpu_peer.call("close", "ro")
        doomed = fresh_gpu_peer()
        assert doomed.call("open", "ro", share)["path"] == "posix-fd"
        said = doomed.call("cupy_write_fault", "ro", timeout=120)
        assert said.startswith("readonly=True: "), said
        assert "cudaErrorIllegalAddress" in said or "illegal memory access" in said, said
        doomed.close()
        assert dtoh(int(buf.handle), n) == data
        share.revoke()
    finally:
        buf.close()


def test_torch_expandable_segments_memory_opens_in_another_process(fresh_gpu_peer, gpu_peer):
    """torch's caching allocator with expandable segments maps CUDA virtual
    memory of its own (cuMemCreate), which legacy CUDA IPC cannot export:
    gpushare offers it over ucx-rma, which another process on this node
    opens, saying why it is the slow path, and moves the bytes both ways."""
    _torch_cuda()
    exporter = fresh_gpu_peer(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    n = 4 * MiB
    share = exporter.call("torch_export_expandable", n, 7, timeout=120)
    assert "cuda-ipc" not in share.offers and "ucx-rma" in share.offers, share.offers
    info = gpu_peer.call("open", "exp", share)
    assert info["path"] == "ucx-rma", info
    assert any("SlowPathWarning" in w for w in info["warnings"]), info
    assert gpu_peer.call("get", "exp", 0, 4096) == b"\x07" * 4096
    assert gpu_peer.call("get", "exp", n - 4096, 4096) == b"\x07" * 4096
    gpu_peer.call("put", "exp", 10, b"expandable")
    assert exporter.call("read_exported", 0, 8, 14) == b"\x07\x07expandable\x07\x07"
    gpu_peer.call("close", "exp")


def test_gs_empty_arrays_go_into_torch_and_cupy_through_dlpack(fresh_gpu_peer, gpu_peer):
    """A gs.empty CUDA array is one memory for torch and CuPy (DLPack, no
    copy): what a torch kernel writes, CuPy's kernel reads, and the other
    way; another process reading the array's share sees it all."""
    _torch_cuda()
    _cupy()
    maker = fresh_gpu_peer()
    got = maker.call("dlpack_into_torch_and_cupy", timeout=120)
    assert got["torch"] == ((8, 256), "torch.int32", "cuda"), got
    assert got["cupy"] == ((8, 256), "int32"), got
    assert got["same_memory"], got
    assert got["cupy_sum"] == 3 * 8 * 256 - 3 + 1000  # CuPy's kernel sees torch's writes
    assert got["torch_reads"] == 5  # and torch sees CuPy's
    share = got["share"]
    assert gpu_peer.call("open", "dl", share)["path"] == "posix-fd"
    assert gpu_peer.call("torch_sum", "dl") == 3 * 8 * 256 - 6 + 1000 + 5
    gpu_peer.call("close", "dl")
    maker.call("revoke_all", [share])


def test_close_waits_for_a_torch_kernel_still_reading_the_mapping(gpu_peer):
    """The importer's kernel on the mapping is still queued (behind one that
    keeps the stream busy) when the view closes: the unmapping waits for
    it, so the kernel reads the memory, not a hole that poisons the context."""
    _torch_cuda()
    n = 8 * MiB
    buf = gs.allocate(n, device=0)
    try:
        data = pattern(n, 5)
        htod(int(buf.handle), data)
        share = gs.export(buf, lifetime="revoked")
        assert gpu_peer.call("open", "busy", share)["path"] == "posix-fd"
        assert gpu_peer.call("torch_busy_read_then_close", "busy", timeout=120) == {"sum": sum(data)}
        share.revoke()
    finally:
        buf.close()


def test_a_torch_tensor_exported_with_its_fill_still_queued_arrives_filled(gpu_peer):
    """torch.multiprocessing sends an IPC event with each tensor; gpushare's
    export waits for the producer's stream: the importer maps the filled
    tensor, not the zeros before the fill."""
    _torch_cuda()
    n = 4 * MiB
    share = gpu_peer.call("torch_export_with_pending_fill", n, 0x42, timeout=120)
    view = gs.open(share)
    try:
        assert view.path == "cuda-ipc"
        out = np.zeros(n, np.uint8)
        view.get(out)
        assert out.tobytes() == b"\x42" * n
    finally:
        view.close()
