"""Bundles of CUDA memory, checked against the CUDA driver stand-in: tensors
of one gpushare.allocate buffer are one posix-fd offer and one VMM mapping,
other CUDA memory goes over cuda-ipc, host tensors beside them over cma, all
in one open.  A contract check, not GPU verification: the processes load the
stand-in; the pytest process never does."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cudadriver

MiB = 1 << 20


@pytest.fixture
def spawn(standin_peers):
    """Start peers that load the stand-in, with the bundle steps."""
    from _cudadriver_bundle_peer import setup

    return lambda **env: standin_peers(setup, **env)


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def test_a_bundle_of_cuda_and_host_tensors_opens_each_allocation_once(spawn):
    exporter, importer = spawn(), spawn()
    pool = _pattern(16384, 3)
    ptr = exporter.call("new_array", "pool", (4096,), "float32", False, pool)["ptr"]
    exporter.call("slice_array", "a", "pool", 0, (1024,), "<f4")
    exporter.call("slice_array", "b", "pool", 4096, (32, 32), "<f4")
    exporter.call("slice_array", "c", "pool", 8192, (2048,), "|u1")
    exporter.call("legacy_alloc", "leg", 4096, 0x5A)
    share = exporter.call("export_tree", "bundle", {"a": "a", "b": "b", "c": "c", "leg": "leg"},
                          {"h": _pattern(100, 9)})
    opened = importer.call("open_bundle", "v", share)
    # one allocation per kind of memory: gs.empty's buffer, the cuMemAlloc block, the host array
    assert opened["paths"] == ("posix-fd", "cuda-ipc", "cma") and opened["count"] == 5
    assert opened["vmm_mappings"] == 1  # three tensors of one buffer: one VMM mapping
    assert opened["devices"] == {"a": 0, "b": 0, "c": 0, "leg": 0, "h": "host"}
    got = importer.call("bundle_get", "v")
    assert got["a"] == ("CudaArray", (1024,), "<f4", pool[:4096])
    assert got["b"] == ("CudaArray", (32, 32), "<f4", pool[4096:8192])
    assert got["c"] == ("CudaArray", (2048,), "|u1", pool[8192:10240])
    assert got["leg"][3] == b"\x5a" * 4096
    assert got["h"] == ("ndarray", (100,), "|u1", _pattern(100, 9))
    assert importer.call("bundle_mapped_bytes", "v", "b") == pool[4096:8192]
    importer.call("bundle_put", "v", {"b": b"\x11" * 4096, "h": b"\x22" * 100, "leg": b"\x33" * 4096})
    assert exporter.call("read_at", ptr + 4096, 4096) == b"\x11" * 4096
    assert exporter.call("read_at", ptr, 4096) == pool[:4096]  # the others untouched
    assert exporter.call("read", "leg", 0, 4096) == b"\x33" * 4096
    assert importer.call("close_bundle", "v")["vmm_mappings"] == 0


def test_a_bundle_maps_on_the_device_the_importer_names(spawn):
    exporter, importer = spawn(CUDA_VISIBLE_DEVICES="1"), spawn()  # the exporter's device 0 is physical 1
    exporter.call("new_array", "pool", (2 * MiB,), "|u1", False, 0x44)
    exporter.call("slice_array", "x", "pool", 0, (MiB,), "|u1")
    exporter.call("slice_array", "y", "pool", MiB, (MiB,), "|u1")
    share = exporter.call("export_tree", "bundle", {"x": "x", "y": "y"})
    opened = importer.call("open_bundle", "v", share)
    assert opened["paths"] == ("posix-fd",) and opened["devices"] == {"x": 1, "y": 1}  # matched by UUID
    assert importer.call("bundle_mapped_bytes", "v", "y")[:16] == b"\x44" * 16
    importer.call("close_bundle", "v")


def test_arrays_of_a_cuda_arena_are_one_offer(spawn):
    exporter, importer = spawn(), spawn()
    share = exporter.call("arena_tree", "arena", 20, 4096)
    opened = importer.call("open_bundle", "v", share)
    assert opened["paths"] == ("posix-fd",) and opened["vmm_mappings"] == 1 and opened["count"] == 20
    got = importer.call("bundle_get", "v")
    assert all(got[f"t{i}"][3] == bytes([i]) * 4096 for i in range(20))
    importer.call("close_bundle", "v")


def test_a_bundle_of_fabric_memory_opens_over_fabric_one_handle_per_allocation(spawn, tmp_path):
    """With an NVLink fabric and an IMEX channel on both sides, a bundle's
    allocations of fabric-exportable memory go over the fabric path, one
    import each; the tensors are views into them."""
    exporter = spawn(GPUSHARE_STANDIN_FABRIC="1")
    importer = spawn(visible="1,0", GPUSHARE_STANDIN_FABRIC="1")
    for p in (exporter, importer):
        p.call("imex_channel", str(tmp_path / "imex"))
    pool = _pattern(4 * MiB, 5)
    exporter.call("allocate", "buf", 4 * MiB, 0, 2 * MiB, 0)
    exporter.call("write", "buf", 0, pool)
    exporter.call("slice_array", "lo", "buf", 0, (MiB,), "|u1")
    exporter.call("slice_array", "hi", "buf", 3 * MiB, (256, 1024), "<f4")
    share = exporter.call("export_tree", "bundle", {"lo": "lo", "hi": "hi"})
    opened = importer.call("open_bundle", "v", share)
    assert opened["paths"] == ("fabric",) and opened["count"] == 2
    assert opened["vmm_mappings"] == 1  # one allocation, one mapping, both tensors in it
    # mapped on this thread's current device (physical 1), which the fabric reaches; over posix-fd
    # it would be the memory's own device (this process's 1), as above
    assert opened["devices"] == {"lo": 0, "hi": 0}
    got = importer.call("bundle_get", "v")
    assert got["lo"] == ("CudaArray", (MiB,), "|u1", pool[:MiB])
    assert got["hi"] == ("CudaArray", (256, 1024), "<f4", pool[3 * MiB:])
    importer.call("bundle_put", "v", {"lo": b"\x5c" * MiB})
    assert exporter.call("read", "buf", 0, 16) == b"\x5c" * 16
    assert exporter.call("read", "buf", MiB, 16) == pool[MiB:MiB + 16]  # the rest untouched
    assert importer.call("close_bundle", "v")["vmm_mappings"] == 0


def test_a_bundle_without_an_imex_channel_says_why_and_opens_over_posix_fd(spawn, tmp_path):
    """The exporter offers the fabric path but this importer has no IMEX
    channel: the bundle opens over posix-fd and ``why`` says what ruled the
    fabric out."""
    exporter = spawn(GPUSHARE_STANDIN_FABRIC="1")
    importer = spawn(GPUSHARE_STANDIN_FABRIC="1")
    exporter.call("imex_channel", str(tmp_path / "imex"))
    exporter.call("allocate", "buf", 2 * MiB, 0, 2 * MiB, 0x21)
    exporter.call("slice_array", "a", "buf", 0, (1024,), "<f4")
    share = exporter.call("export_tree", "bundle", {"a": "a"})
    opened = importer.call("open_bundle", "v", share)
    assert opened["paths"] == ("posix-fd",)
    assert "not fabric" in opened["why"] and "IMEX" in opened["why"], opened["why"]
    assert importer.call("bundle_get", "v")["a"][3] == b"\x21" * 4096
    importer.call("close_bundle", "v")


def test_a_bundle_of_cuda_tensors_over_ucx_rma_gets_and_puts_in_one_batch(spawn):
    """Asked for ucx-rma, a bundle of CUDA tensors (one gs.allocate buffer of
    two 2 MiB allocations, and a cuMemAlloc block) opens one region per
    allocation and moves their bytes over UCX (cuda_copy), both ways."""
    exporter, importer = spawn(), spawn()
    pool = _pattern(4 * MiB, 11)
    exporter.call("allocate", "buf", 4 * MiB, 0, 2 * MiB, 0)
    exporter.call("write", "buf", 0, pool)
    exporter.call("slice_array", "x", "buf", 2 * MiB - 4096, (2048,), "<f4")  # across the two allocations
    exporter.call("slice_array", "y", "buf", 3 * MiB, (64, 64), "<i4")
    exporter.call("legacy_alloc", "leg", 8192, 0x6B)
    share = exporter.call("export_tree", "bundle", {"x": "x", "y": "y", "leg": "leg"})
    opened = importer.call("open_bundle", "v", share, {"prefer": ["ucx-rma"]})
    assert opened["paths"] == ("ucx-rma", "ucx-rma") and opened["count"] == 3
    assert opened["vmm_mappings"] == 0  # nothing mapped here: every byte travels
    got = importer.call("bundle_get", "v")
    assert got["x"] == ("CudaArray", (2048,), "<f4", pool[2 * MiB - 4096:2 * MiB + 4096])
    assert got["y"] == ("CudaArray", (64, 64), "<i4", pool[3 * MiB:3 * MiB + 16384])
    assert got["leg"][3] == b"\x6b" * 8192
    importer.call("bundle_put", "v", {"x": b"\x0f" * 8192, "leg": b"\x70" * 8192})
    assert exporter.call("read", "buf", 2 * MiB - 4096, 8192) == b"\x0f" * 8192
    assert exporter.call("read", "buf", 2 * MiB - 4104, 8) == pool[2 * MiB - 4104:2 * MiB - 4096]  # not past it
    assert exporter.call("read", "leg", 0, 8192) == b"\x70" * 8192
    importer.call("close_bundle", "v")


def test_a_bundle_of_exportable_pool_memory_goes_over_the_pools_own_export(spawn):
    """Tensors in memory of an IPC-enabled stream-ordered pool (cuda.core's
    DeviceMemoryResource) go over cuda-ipc with the pool's own export, one
    offer for the pool allocation they share."""
    exporter, importer = spawn(), spawn()
    exporter.call("ipc_pool_alloc", "blk", 64 << 10, 4096, 0x3C)
    exporter.call("write", "blk", 8192, _pattern(4096, 2))
    exporter.call("slice_array", "p", "blk", 0, (1024,), "<f4")
    exporter.call("slice_array", "q", "blk", 8192, (16, 64), "<i4")
    share = exporter.call("export_tree", "bundle", {"p": "p", "q": "q"})
    opened = importer.call("open_bundle", "v", share)
    assert opened["paths"] == ("cuda-ipc",) and opened["count"] == 2, opened  # one pool allocation
    got = importer.call("bundle_get", "v")
    assert got["p"] == ("CudaArray", (1024,), "<f4", b"\x3c" * 4096)
    assert got["q"] == ("CudaArray", (16, 64), "<i4", _pattern(4096, 2))
    importer.call("bundle_put", "v", {"p": b"\x01" * 4096})
    assert exporter.call("read", "blk", 0, 4096) == b"\x01" * 4096
    importer.call("close_bundle", "v")
    assert importer.call("ipc_handles") == 0


def test_tensors_of_one_cudamalloc_block_are_one_offer_of_their_span(spawn):
    """CuPy's pool and torch's caching allocator hand out parts of
    cudaMalloc blocks: tensors in one block are one allocation of the
    bundle, one CUDA IPC handle, and the part is the span from the first
    tensor to the end of the last (what a ucx-rma region would expose)."""
    exporter, importer = spawn(), spawn()
    exporter.call("legacy_alloc", "chunk", 1 << 20, 0x11)
    exporter.call("write", "chunk", 65536, _pattern(8192, 4))
    exporter.call("slice_array", "a", "chunk", 4096, (1024,), "<f4")  # bytes 4096..8192
    exporter.call("slice_array", "b", "chunk", 65536, (2048,), "<f4")  # bytes 65536..73728
    exporter.call("slice_array", "z", "chunk", 512, (0,), "<f4")  # empty: in no allocation
    exporter.call("legacy_alloc", "other", 8192, 0x22)
    share = exporter.call("export_tree", "bundle", {"a": "a", "b": "b", "c": "other", "z": "z"})
    assert [p.nbytes for p in share._bundle.parts] == [73728 - 4096, 8192]
    opened = importer.call("open_bundle", "v", share)
    assert opened["paths"] == ("cuda-ipc", "cuda-ipc") and opened["count"] == 4
    assert importer.call("ipc_handles") == 2  # one per cudaMalloc block
    got = importer.call("bundle_get", "v")
    assert got["a"] == ("CudaArray", (1024,), "<f4", b"\x11" * 4096)
    assert got["b"] == ("CudaArray", (2048,), "<f4", _pattern(8192, 4))
    assert got["c"][3] == b"\x22" * 8192
    assert got["z"][1:] == ((0,), "<f4", b"")
    importer.call("bundle_put", "v", {"b": b"\x33" * 8192})
    assert exporter.call("read", "chunk", 65536, 8192) == b"\x33" * 8192
    assert exporter.call("read", "chunk", 65536 - 8, 8) == b"\x11" * 8  # the bytes before it untouched
    importer.call("close_bundle", "v")
    assert importer.call("ipc_handles") == 0
    # over ucx-rma the first block's region is the tensors' span, not the whole 1 MiB block
    opened = importer.call("open_bundle", "w", share, {"prefer": ["ucx-rma"]})
    assert opened["paths"] == ("ucx-rma", "ucx-rma")
    assert importer.call("bundle_get", "w")["b"][3] == b"\x33" * 8192
    importer.call("close_bundle", "w")


@pytest.mark.parametrize(("blocks", "per_block"), [(300, 1), (63, 32)], ids=["300-blocks", "2016-in-63-blocks"])
def test_a_real_models_many_cuda_allocations_open_with_a_handle_per_block(spawn, blocks, per_block):
    """A state dict of torch CUDA tensors: 300 cuMemAlloc blocks (a 7B model
    has about 300 tensors), and 2,016 tensors packed in 63 blocks as a caching
    allocator packs them.  The grant (a CUDA IPC handle per block) is larger
    than one control frame and goes in several; one handle per block, every
    byte checked."""
    exporter, importer = spawn(), spawn()
    nbytes = 4096 if per_block == 1 else 512
    share = exporter.call("blocks_tree", "bundle", blocks, per_block, nbytes, timeout=240)
    assert share.count == blocks * per_block and share.allocations == blocks
    opened = importer.call("open_bundle", "v", share, timeout=240)
    assert set(opened["paths"]) == {"cuda-ipc"} and len(opened["paths"]) == blocks
    assert importer.call("ipc_handles") == blocks  # one per block, not per tensor
    checked = importer.call("bundle_check_fill", "v", nbytes, timeout=240)
    assert checked == {"checked": blocks * per_block, "wrong": []}
    importer.call("close_bundle", "v")
    assert importer.call("ipc_handles") == 0


def test_torch_cuda_tensors_group_by_caching_allocator_segment_not_by_storage(spawn):
    """Each tensor of an ordinary torch CUDA state dict has a storage of its
    own, and torch's caching allocator packs many storages in one segment
    (a cudaMalloc block): the bundle has one allocation, and one IPC handle,
    per segment.  2,000 tensors in 63 segments, every byte checked."""
    pytest.importorskip("torch", reason="torch is an optional extra: the tensors' exporter has torch loaded, as "
                        "gpushare's grouping checks: pip install torch")
    exporter, importer = spawn(), spawn()
    blocks, per_block, nbytes = 63, 32, 256  # 2,016 tensors
    share = exporter.call("blocks_tree", "bundle", blocks, per_block, nbytes, True, timeout=240)
    assert share.count == blocks * per_block and share.allocations == blocks
    opened = importer.call("open_bundle", "v", share, timeout=240)
    assert opened["paths"] == ("cuda-ipc",) * blocks
    assert importer.call("ipc_handles") == blocks
    assert importer.call("bundle_check_fill", "v", nbytes, timeout=240) == {"checked": blocks * per_block,
                                                                             "wrong": []}
    importer.call("close_bundle", "v")
    assert importer.call("ipc_handles") == 0
