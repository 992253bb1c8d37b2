"""UCX RMA with CUDA memory between two real processes (needs a CUDA device)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from gpushare import ucx

from _procs import Child
import _rma_gpu_peer as gpu_peer

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def cuda_peer():
    child = Child(gpu_peer.setup, 65 * MiB, timeout=120)
    yield child
    child.close()


@pytest.fixture(scope="module")
def link(cuda_peer):
    agent = ucx.Agent()  # no context made current in this process either
    ep = agent.connect(cuda_peer.hello["address"])
    rk = ep.unpack_remote_key(cuda_peer.hello["key"])
    yield agent, ep, rk
    agent.close()


def test_peer_region_is_cuda(cuda_peer, link):
    _, _, rk = link
    assert cuda_peer.hello["memory_type"] == "cuda"
    assert rk.memory_type == "cuda"


def test_peer_allocated_its_cuda_region_with_no_current_context(cuda_peer):
    """UCX allocates CUDA memory only under a current context; the peer made
    none current, and gpushare.ucx leaves none current after allocating."""
    assert cuda_peer.hello["context_before"] is None
    assert cuda_peer.hello["context_after"] is None
    assert cuda_peer.call("fill", 0, 4096, 7) == cuda_peer.call("digest", 0, 4096)  # device memory, bytes in and out


@pytest.mark.parametrize("size,offset", [(1, 0), (4096, 3), (MiB + 1, 4096), (64 * MiB, 0)])
def test_host_to_remote_cuda_and_back(cuda_peer, link, size, offset):
    _, ep, rk = link
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    ep.mem_put(data, rk.base_address + offset, rk).wait(60)
    ep.flush().wait(60)
    assert cuda_peer.call("digest", offset, size) == hashlib.sha256(data).hexdigest()
    out = np.zeros(size, np.uint8)
    ep.mem_get(out, rk.base_address + offset, rk).wait(60)
    assert np.array_equal(out, data)


@pytest.mark.parametrize("size", [4096, 8 * MiB])
def test_local_cuda_buffer_to_remote_cuda_and_back(cuda_peer, link, size):
    _, ep, rk = link
    src = gpu_peer.allocate(size)
    dst = gpu_peer.allocate(size)
    try:
        data = np.random.default_rng(size + 1).integers(0, 256, size, dtype=np.uint8)
        gpu_peer.htod(int(src.handle), data)
        ep.mem_put(src, rk.base_address, rk).wait(60)
        ep.flush().wait(60)
        assert cuda_peer.call("digest", 0, size) == hashlib.sha256(data).hexdigest()
        ep.mem_get(dst, rk.base_address, rk).wait(60)
        assert np.array_equal(gpu_peer.dtoh(int(dst.handle), size), data)
    finally:
        src.close()
        dst.close()


def test_register_local_cuda_buffer(link):
    agent, _, _ = link
    buf = gpu_peer.allocate(MiB)
    try:
        with agent.create_memory_handle(MiB, buf) as mh:
            assert mh.memory_type == "cuda"
            assert mh.base_address == int(buf.handle)
        with pytest.raises(ValueError, match="cuda memory"):
            agent.create_memory_handle(MiB, buf, memory_type="host")
    finally:
        buf.close()


@pytest.mark.kernels
def test_cupy_array_round_trip(link):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    _, ep, rk = link
    a = cupy.arange(1 << 16, dtype=cupy.uint32)
    ep.mem_put(a, rk.base_address, rk).wait(60)
    ep.flush().wait(60)
    b = cupy.zeros_like(a)
    ep.mem_get(b, rk.base_address, rk).wait(60)
    assert bool((a == b).all())
