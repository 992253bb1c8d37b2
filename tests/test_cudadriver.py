"""gpushare's CUDA paths, run for real between processes against the CUDA
driver stand-in (``tests/cudadriver``).

A contract check, not GPU verification: the stand-in enforces the driver's
documented rules (a current context per thread, asynchronous copies that
land only at a synchronisation, ``CUDA_VISIBLE_DEVICES`` remapping, VMM
access per device) so that gpushare's mistakes show; it runs no kernel.
Each test names the defect it guards against.
"""

from __future__ import annotations

import os
import pickle

import pytest

import gpushare as gs
from _procs import Child

pytestmark = pytest.mark.cudadriver

MiB = 1 << 20


@pytest.fixture
def spawn(standin_peers):
    """Start peers that load the stand-in; each may see other devices."""
    from _cudadriver_peer import setup

    def start(visible: str | None = None, **env: str) -> Child:
        return standin_peers(setup, CUDA_VISIBLE_DEVICES=visible, **env)

    return start


def _pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


# -- defect 1: cuda.core 1.2.2's Device.allocate needs stream= ------------------


def test_gpu_test_helpers_allocate_with_a_stream(spawn):
    p = spawn()
    p.call("helper_allocate", "a", MiB)
    p.call("write", "a", 0, b"\x11" * 16)
    assert p.call("read", "a", 0, 16) == b"\x11" * 16


# -- defect 2: driver calls from any thread, finalizers included ----------------


@pytest.mark.parametrize("where", ["thread", "asyncio"])
def test_get_and_put_from_another_thread(spawn, where):
    exporter, importer = spawn(), spawn()
    data = _pattern(3 * MiB)
    exporter.call("allocate", "buf", 3 * MiB, 0, None, 0)
    exporter.call("write", "buf", 0, data)
    share = exporter.call("export", "buf")
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "posix-fd"
    assert importer.call("view_get", "v", 5, MiB, where) == data[5:5 + MiB]
    importer.call("view_put", "v", 7, b"\xab" * 1000, where)
    assert exporter.call("read", "buf", 7, 1000) == b"\xab" * 1000
    importer.call("close_view", "v", "thread")
    assert importer.call("vmm_mappings") == 0


@pytest.mark.parametrize("how", ["thread", "gc"])
def test_cuda_ipc_close_from_another_thread_releases_the_handle(spawn, how):
    exporter, importer = spawn(), spawn()
    exporter.call("legacy_alloc", "buf", MiB, 5)
    share = exporter.call("export", "buf")
    assert "cuda-ipc" in share.offers
    assert importer.call("open_view", "v", share)["path"] == "cuda-ipc"
    assert importer.call("view_get", "v", 0, 64, "thread") == b"\x05" * 64
    importer.call("close_view", "v", how)
    assert importer.call("ipc_handles") == 0


# -- defect 3: the caller's current context is left as it was -------------------


def test_allocate_and_open_leave_the_callers_device_alone(spawn):
    exporter, importer = spawn(), spawn()
    assert exporter.call("current_device") is None
    exporter.call("allocate", "buf", MiB, 1)
    assert exporter.call("current_device") is None  # no context was made current
    exporter.call("make_current", 0)
    exporter.call("allocate", "buf2", MiB, 1)
    assert exporter.call("current_device") == 0
    share = exporter.call("export", "buf2")
    importer.call("make_current", 1)
    opened = importer.call("open_view", "v", share)
    assert opened["current"] == 1
    importer.call("view_get", "v", 0, 16)
    assert importer.call("current_device") == 1


# -- defect 4: copies ordered after the caller's work, visible on return --------


@pytest.mark.parametrize("mode", ["stream", "array-interface"])
def test_put_waits_for_the_producers_stream_and_is_visible_on_return(spawn, mode):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 0)
    share = exporter.call("export", "buf")
    importer.call("open_view", "v", share)
    importer.call("put_from_stream", "v", 0x5A, MiB, mode)
    # The exporter reads its own memory: nothing in the importer synchronises
    # after put returns, so the bytes must already be there.
    assert exporter.call("read", "buf", 0, MiB) == b"\x5a" * MiB


def test_pageable_put_and_device_get_land_before_return(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 0)
    share = exporter.call("export", "buf")
    importer.call("open_view", "v", share)
    data = _pattern(MiB, 3)
    importer.call("view_put", "v", 0, data)
    assert exporter.call("read", "buf", 0, MiB) == data
    exporter.call("write", "buf", 0, _pattern(MiB, 9))
    assert importer.call("get_to_device", "v", MiB) == _pattern(MiB, 9)


# -- defect 5: no unmapping under live arrays ------------------------------------


def test_close_defers_unmapping_while_a_dlpack_consumer_holds_the_memory(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 7)
    share = exporter.call("export", "buf")
    importer.call("open_view", "v", share)
    held = importer.call("take_dlpack", "v")
    assert held["shape"] == (2 * MiB,)
    importer.call("close_view", "v")
    assert importer.call("vmm_mappings") == 1  # still mapped for the consumer
    assert importer.call("read_at", held["ptr"], 32) == b"\x07" * 32
    importer.call("drop_consumers")
    assert importer.call("vmm_mappings") == 0


def test_close_defers_unmapping_while_an_array_interface_consumer_holds_the_view(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 9)
    share = exporter.call("export", "buf")
    importer.call("open_view", "v", share)
    held = importer.call("take_cai", "v")
    importer.call("close_view", "v")
    assert importer.call("vmm_mappings") == 1
    assert importer.call("read_at", held["ptr"], 32) == b"\x09" * 32
    importer.call("drop_consumers")
    assert importer.call("vmm_mappings") == 0


# -- defect 6: read-only means read-only access on the importer's mapping --------


def test_read_only_share_maps_read_only(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 3)
    share = exporter.call("export", "buf", {"readonly": True})
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "posix-fd"
    assert importer.call("access_flags", "v", opened["device"]) == "CU_MEM_ACCESS_FLAGS_PROT_READ"
    assert importer.call("take_dlpack", "v")["readonly"] is True
    cai = importer.call("take_cai", "v")
    assert cai["readonly"] is True
    assert importer.call("write_at", cai["ptr"], b"\xff" * 8, opened["device"]) != "CUDA_SUCCESS"
    assert exporter.call("read", "buf", 0, 8) == b"\x03" * 8


def test_read_only_share_refuses_cuda_ipc(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("legacy_alloc", "buf", MiB, 1)
    share = exporter.call("export", "buf", {"readonly": True})
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "ucx-rma"
    assert "not cuda-ipc: legacy CUDA IPC maps memory writable only" in opened["why"]


# -- defects 7 and 8: devices by UUID, CUDA_VISIBLE_DEVICES differing ------------


def test_devices_are_matched_by_uuid_across_visible_device_lists(spawn):
    exporter = spawn(visible="1")          # physical device 1 is its ordinal 0
    importer = spawn(visible="0,1")        # ... and this one's ordinal 1
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 0)
    exporter.call("write", "buf", 0, _pattern(2 * MiB))
    desc = exporter.call("export_buffer", "buf", "posix-fd")
    assert desc.owner_uuid == exporter.call("uuid_of", 0) == importer.call("uuid_of", 1)
    assert not desc.owner_uuid.startswith("GPU-")
    got = importer.call("import_buffer", "mine", desc)
    assert got["device"] == 1 and got["current"] is None
    assert importer.call("read", "mine", 0, 4096) == _pattern(2 * MiB)[:4096]
    importer.call("close_buf", "mine")
    share = exporter.call("export", "buf")
    opened = importer.call("open_view", "v", share)
    assert opened["device"] == 1 and opened["dlpack_device"] == (2, 1)
    assert importer.call("view_get", "v", 100, 100) == _pattern(2 * MiB)[100:200]


def test_open_maps_on_the_callers_current_device_or_the_one_asked_for(spawn):
    exporter = spawn(visible="1")
    importer = spawn(visible="0,1")
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 4)
    share = exporter.call("export", "buf")
    importer.call("make_current", 0)
    opened = importer.call("open_view", "a", share)
    assert opened["device"] == 0 and opened["current"] == 0
    assert importer.call("view_get", "a", 0, 8) == b"\x04" * 8
    opened = importer.call("open_view", "b", share, {"device": 1})
    assert opened["device"] == 1 and opened["current"] == 0
    with pytest.raises(gs.InvalidInputError, match="no CUDA device 5"):
        importer.call("open_view", "c", share, {"device": 5})


def test_cuda_ipc_maps_on_the_exporters_device_by_uuid(spawn):
    exporter = spawn(visible="1")
    importer = spawn(visible="0,1")
    exporter.call("legacy_alloc", "buf", MiB, 6)
    desc = exporter.call("export_buffer", "buf", "cuda-ipc")
    assert desc.owner_uuid == importer.call("uuid_of", 1)
    got = importer.call("import_buffer", "mine", desc)
    assert got["device"] == 1
    assert importer.call("read", "mine", 0, 8) == b"\x06" * 8


# -- the fabric path ---------------------------------------------------------------


def test_fabric_handles_between_processes(spawn, tmp_path):
    exporter = spawn(GPUSHARE_STANDIN_FABRIC="1")
    importer = spawn(visible="1,0", GPUSHARE_STANDIN_FABRIC="1")
    for p in (exporter, importer):
        p.call("imex_channel", str(tmp_path / "imex"))
    exporter.call("allocate", "buf", 4 * MiB, 0, 2 * MiB, 0)
    exporter.call("write", "buf", 0, _pattern(4 * MiB, 2))
    desc = exporter.call("export_buffer", "buf", "fabric")
    assert type(desc).__name__ == "VirtualMemoryFabricBufferDescriptor" and len(desc.handles) == 2
    got = importer.call("import_buffer", "mine", desc)
    assert got["device"] == 1  # exporter's device 0 is physical 0: this process's 1
    assert importer.call("read", "mine", 2 * MiB - 8, 16) == _pattern(4 * MiB, 2)[2 * MiB - 8:2 * MiB + 8]
    importer.call("close_buf", "mine")
    share = exporter.call("export", "buf")
    assert "fabric" in share.offers and share.fabric
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "fabric", opened["why"]
    importer.call("view_put", "v", 0, b"over the fabric")
    assert exporter.call("read", "buf", 0, 15) == b"over the fabric"


def test_without_a_fabric_export_says_why_and_open_falls_to_posix_fd(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 1)
    with pytest.raises(gs.UnsupportedError, match="fabric"):
        exporter.call("export_buffer", "buf", "fabric")
    share = exporter.call("export", "buf")
    assert "fabric" not in share.offers
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "posix-fd" and not opened["warnings"]


# -- defect 9: capabilities by UUID, fabric only when complete -------------------


def test_capabilities_finds_devices_in_nvml_by_uuid(spawn):
    # NVML numbers devices physically; this process sees physical 1 as 0.
    p = spawn(visible="1,0", GPUSHARE_STANDIN_FABRIC="1", GPUSHARE_STANDIN_CLIQUES="10,11")
    caps = p.call("capabilities")
    devices = caps["cuda"]["devices"]
    assert [d["uuid"] for d in devices] == [p.call("uuid_of", 0), p.call("uuid_of", 1)]
    assert [d["name"] for d in devices] == ["gpushare CUDA driver stand-in"] * 2  # gpushare doctor prints it
    assert all(not d["uuid"].startswith("GPU-") for d in devices)
    assert [d["fabric"]["clique_id"] for d in devices] == [11, 10]
    assert all(d["fabric"]["cluster_uuid"] and d["fabric"]["reason"] is None for d in devices)


def test_capabilities_counts_no_clique_until_the_fabric_is_ready(spawn):
    p = spawn(GPUSHARE_STANDIN_FABRIC="incomplete")
    devices = p.call("capabilities")["cuda"]["devices"]
    assert len(devices) == 2  # the stand-in's default: the loop below checks both
    for d in devices:
        assert d["fabric"]["clique_id"] is None and d["fabric"]["cluster_uuid"] is None
        assert "not ready" in d["fabric"]["reason"]


# -- defect 10: VMM memory registrable for GPUDirect RDMA ------------------------


def test_allocations_are_gpudirect_rdma_capable(spawn):
    p = spawn()
    p.call("allocate", "buf", 2 * MiB, 0)
    assert p.call("rdma_flag", "buf") == 1


# -- defect 11: pool memory is not offered over legacy IPC -----------------------


def test_pool_memory_is_refused_by_legacy_ipc_with_the_reason(spawn):
    p = spawn()
    p.call("pool_alloc", "buf", MiB)
    with pytest.raises(gs.UnsupportedError, match="stream-ordered memory pool that was not made exportable"):
        p.call("export_buffer", "buf", "cuda-ipc")
    share = p.call("export", "buf")
    assert "cuda-ipc" not in share.offers


def test_exportable_pool_memory_goes_over_the_pools_own_export(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("ipc_pool_alloc", "buf", 4096, 512, 0x3C)
    desc = exporter.call("export_buffer", "buf", "cuda-ipc")
    assert type(desc).__name__ == "CudaPoolBufferDescriptor" and desc.offset == 512 and desc.size == 4096
    assert pickle.loads(pickle.dumps(desc)) == desc
    got = importer.call("import_buffer", "mine", desc)
    assert got["size"] == 4096 and got["current"] is None
    assert importer.call("read", "mine", 0, 4096) == b"\x3c" * 4096
    importer.call("close_buf", "mine")
    assert importer.call("ipc_handles") == 0
    share = exporter.call("export", "buf")
    assert "cuda-ipc" in share.offers
    assert importer.call("open_view", "v", share)["path"] == "cuda-ipc"
    importer.call("view_put", "v", 8, b"pool ipc")
    assert exporter.call("read", "buf", 8, 8) == b"pool ipc"
    importer.call("close_view", "v", "gc")
    assert importer.call("ipc_handles") == 0


def test_legacy_allocations_go_over_cuda_ipc(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("legacy_alloc", "buf", MiB, 8)
    share = exporter.call("export", "buf")
    opened = importer.call("open_view", "v", share)
    assert opened["path"] == "cuda-ipc"
    assert importer.call("view_get", "v", 0, 64) == b"\x08" * 64
    importer.call("view_put", "v", 0, b"\x01" * 64)
    assert exporter.call("read", "buf", 0, 64) == b"\x01" * 64


# -- defect 12: UCX must not guess a CUDA buffer's memory type from its cache --


def test_agents_run_with_ucx_memory_type_cache_off(monkeypatch):
    from gpushare import ucx
    from gpushare._ucx import _agent, _loader, _node

    real = _loader.native()
    seen: list[dict] = []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def Agent(self, cfg, *args):  # noqa: N802 - the native name
            seen.append(dict(cfg))
            return real.Agent(cfg, *args)

        def Node(self, cfg, *args):  # noqa: N802 - the native name
            seen.append(dict(cfg))
            return real.Node(cfg, *args)

    monkeypatch.setattr(_agent, "native", lambda: Spy())
    ucx.Agent().close()
    ucx.Agent(config={"UCX_MEMTYPE_CACHE": "n"}).close()  # the process's own value
    monkeypatch.setattr(_node, "native", lambda: Spy())
    node = _node._Node()  # the process's one worker, which serves every share
    node.stop()
    # One setting of the whole process (libucs reads it when it loads), set
    # once in the environment; no worker's config names it.
    assert os.environ["UCX_MEMTYPE_CACHE"] == "n"
    assert _loader.native_memtype_cache() == "n"
    assert len(seen) == 3 and not any("MEMTYPE_CACHE" in cfg for cfg in seen)


# -- defect 13: multi-allocation VMM buffers over ucx-rma ------------------------


def test_the_ucx_worker_leaves_cuda_ipc_out_and_stages_gpu_memory(spawn):
    # cuda_ipc would expose a multi-allocation VMM buffer's first allocation only.
    tls = spawn().call("ucx_transports")
    assert "cuda_ipc" not in tls and "cuda_copy" in tls and "tcp" in tls
    assert spawn(UCX_TLS="tcp,cuda_copy,cuda_ipc").call("ucx_transports") == ["tcp", "cuda_copy"]


@pytest.mark.parametrize("fabric", ["0", "1"])
def test_chunked_vmm_buffer_over_ucx_rma(spawn, fabric):
    exporter, importer = spawn(GPUSHARE_STANDIN_FABRIC=fabric), spawn(GPUSHARE_STANDIN_FABRIC=fabric)
    size = 6 * MiB
    exporter.call("allocate", "buf", size, 0, 2 * MiB, 0)
    data = _pattern(size, 5)
    exporter.call("write", "buf", 0, data)
    share = exporter.call("export", "buf")
    opened = importer.call("open_view", "v", share, {"prefer": ["ucx-rma"]})
    assert opened["path"] == "ucx-rma"
    # Across both allocation boundaries, both ways.
    assert importer.call("view_get", "v", 2 * MiB - 100, 2 * MiB + 200) == data[2 * MiB - 100:4 * MiB + 100]
    importer.call("view_put", "v", 4 * MiB - 8, b"\xee" * 16)
    assert exporter.call("read", "buf", 4 * MiB - 8, 16) == b"\xee" * 16


def test_descriptors_from_the_stand_in_pickle(spawn):
    p = spawn()
    p.call("allocate", "buf", 2 * MiB, 0)
    desc = p.call("export_buffer", "buf", "posix-fd")
    assert pickle.loads(pickle.dumps(desc)) == desc
