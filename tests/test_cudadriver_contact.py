"""What a first run on a GPU would reject in gpushare's CUDA code, checked
against the CUDA driver stand-in (``tests/cudadriver``): the demo's copies
need a context and a synchronisation, torch tensors are read through DLPack
so that their stream's work comes first, no process retains a context on a
device it does not use, imported pools are granted to the device they are
used on, fabric needs an IMEX channel, and closing waits for gpushare's own
copies only.

A contract check, not GPU verification.  Every test but the last (torch on
the CPU, no stand-in) starts its processes with the stand-in loaded; the
pytest process never loads it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import standin_env

MiB = 1 << 20


@pytest.fixture
def spawn(standin_peers):
    """Start peers that load the stand-in (2 devices unless told otherwise)."""
    from _cudadriver_contact_peer import setup

    return lambda **env: standin_peers(setup, **env)


def _run(standin_lib: str, args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=standin_env(standin_lib, **env))


# -- gpushare demo on a CUDA device ----------------------------------------------


@pytest.mark.cudadriver
def test_demo_command_passes_on_cuda_device_memory(standin_lib):
    r = _run(standin_lib, ["-m", "gpushare", "demo", "--size-mib", "4", "--repeat", "2"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of CUDA device 0 from process" in r.stdout.splitlines()[0], r.stdout
    assert "bytes match the exporter's: True" in r.stdout and "the exporter sees the bytes: True" in r.stdout
    assert r.stdout.strip().endswith("demo passed"), r.stdout


@pytest.mark.cudadriver
def test_run_demo_reports_cuda_memory_and_every_byte_matching(standin_lib):
    code = ("import sys\nfrom gpushare._demo import run_demo\nlines = []\n"
            "code = run_demo(2 << 20, 1, lines.append, as_json=True, progress=None)\n"
            "print(lines[-1]); sys.exit(code)\n")
    r = _run(standin_lib, ["-c", code])
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["memory"] == "CUDA device 0" and report["passed"] is True, report
    assert report["runs"][0]["path"] == "posix-fd", report
    assert all(run["get_ok"] and run["put_ok"] for run in report["runs"]), report


# -- torch tensors: DLPack orders the producer's stream ------------------------------


@pytest.mark.cudadriver
def test_a_torch_like_tensor_is_read_through_dlpack_after_its_streams_work(spawn):
    # The tensor's memset is queued on its non-blocking current stream; its
    # __cuda_array_interface__ (version 2, as torch's) names no stream.
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 0)
    importer.call("open_view", "v", exporter.call("export", "buf"))
    resolved = importer.call("put_torch_like", "v", 0x6B, MiB)
    assert resolved["memory_type"] == "cuda" and resolved["nbytes"] == MiB
    assert resolved["device"] == 0  # DLPack says the device; the array interface does not
    assert exporter.call("read", "buf", 0, MiB) == b"\x6b" * MiB


# -- no primary context on a device the process does not use ------------------------

_CONTEXTS = """
import threading
import gpushare as gs
from cuda.bindings import driver as drv
from cuda.core import Device

def active(ordinal):
    err, dev = drv.cuDeviceGet(ordinal)
    err, flags, on = drv.cuDevicePrimaryCtxGetState(dev)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    return int(on)

class Cai:  # device memory as CuPy hands it over: pointer and size, no device
    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}

arr = gs.empty((1 << 20,), "uint8", device=1)        # VMM memory of device 1
share = gs.export(arr)                                 # from a thread with no current context
legacy = {}
def allocate_on_device_1():                            # a worker thread that uses device 1
    Device(1).set_current()
    err, legacy["ptr"] = drv.cuMemAlloc(1 << 20)
    assert err == drv.CUresult.CUDA_SUCCESS, err
t = threading.Thread(target=allocate_on_device_1); t.start(); t.join()
other = gs.export(Cai(int(legacy["ptr"]), 1 << 20))   # legacy memory of device 1, context-less thread
print(share.device, other.device, "cuda-ipc" in other.offers, active(0), active(1))
"""


@pytest.mark.cudadriver
def test_exporting_memory_of_device_1_retains_no_context_on_device_0(run_standin):
    device, other_device, ipc, on0, on1 = run_standin(_CONTEXTS, timeout=120).split()
    assert (device, other_device, ipc) == ("1", "1", "True")
    assert on1 == "1"
    assert on0 == "0", "device 0's primary context was retained by a process that never used device 0"


_STRICT_POINTER_QUERY = """
from cuda.bindings import driver as drv
real = drv.cuPointerGetAttribute
def needs_context(attr, ptr):  # a driver that answers pointer queries only in a context
    err, ctx = drv.cuCtxGetCurrent()
    if ctx is None or int(ctx) == 0:
        return (drv.CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
    return real(attr, ptr)
drv.cuPointerGetAttribute = needs_context
"""


@pytest.mark.cudadriver
def test_a_driver_that_wants_a_context_for_pointer_queries_gets_one_already_held(run_standin):
    device, other_device, ipc, on0, on1 = run_standin(_STRICT_POINTER_QUERY + _CONTEXTS, timeout=120).split()
    assert (device, other_device, ipc, on0, on1) == ("1", "1", "True", "0", "1")


@pytest.mark.cudadriver
def test_importing_on_device_1_retains_no_context_on_device_0(spawn):
    exporter = spawn(CUDA_VISIBLE_DEVICES="1")       # physical 1 is its device 0
    importer = spawn()
    exporter.call("allocate", "buf", 2 * MiB, 0, None, 0x21)
    opened = importer.call("open_view", "v", exporter.call("export", "buf"))
    assert opened["device"] == 1
    assert importer.call("view_get", "v", 0, 64) == b"\x21" * 64
    importer.call("view_put", "v", 0, b"\x22" * 64)
    importer.call("close_view", "v")
    assert exporter.call("read", "buf", 0, 64) == b"\x22" * 64
    assert importer.call("primary_active", 0) == 0
    assert importer.call("primary_active", 1) == 1


# -- imported pools: access for the device they are used on -------------------------


@pytest.mark.cudadriver
def test_pool_memory_imported_on_a_peer_device_is_granted_to_it(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("ipc_pool_alloc", "buf", 8192, 0, 0x4D)
    desc = exporter.call("export_buffer", "buf", "cuda-ipc")
    got = importer.call("import_buffer", "mine", desc, 1)   # resident on device 0; used on device 1
    assert got["device"] == 1
    assert importer.call("pool_access", "mine", 1) == "CU_MEM_ACCESS_FLAGS_PROT_READWRITE"
    assert importer.call("read", "mine", 0, 8192) == b"\x4d" * 8192   # a copy on device 1
    importer.call("close_buf", "mine")
    share = exporter.call("export", "buf")
    opened = importer.call("open_view", "v", share, {"device": 1})
    assert opened["path"] == "cuda-ipc" and opened["device"] == 1
    importer.call("view_put", "v", 16, b"granted to device 1")
    assert exporter.call("read", "buf", 16, 19) == b"granted to device 1"
    importer.call("close_view", "v")
    assert importer.call("ipc_handles") == 0


@pytest.mark.cudadriver
def test_a_copy_on_another_device_is_granted_the_imported_pool(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("ipc_pool_alloc", "buf", 8192, 0, 0)
    opened = importer.call("open_view", "v", exporter.call("export", "buf"))
    assert opened["path"] == "cuda-ipc" and opened["device"] == 0   # its resident device
    importer.call("put_from_device", "v", 1, b"copied on device 1")
    assert exporter.call("read", "buf", 0, 18) == b"copied on device 1"


# -- fabric needs an IMEX channel ----------------------------------------------------


@pytest.mark.cudadriver
@pytest.mark.parametrize("entries", [None, [], ["README"], ["channel0"]])
def test_capabilities_lists_fabric_only_with_an_imex_channel(spawn, tmp_path, entries):
    p = spawn(GPUSHARE_STANDIN_FABRIC="1")  # every device supports fabric handles
    directory = tmp_path / "imex" if entries is not None else tmp_path / "absent"
    if entries == []:
        directory.mkdir()
    caps = p.call("capabilities_with", str(directory), entries or [])
    devices = caps["cuda"]["devices"]
    assert devices
    if entries == ["channel0"]:
        assert caps["imex"]["present"] and caps["imex"]["channels"] == ["channel0"]
        assert all("fabric" in d["handle_types"] and d["fabric_reason"] is None for d in devices), devices
    else:
        assert not caps["imex"]["present"] and caps["imex"]["reason"]
        for d in devices:
            assert "fabric" not in d["handle_types"], d
            assert "posix-fd" in d["handle_types"], d
            assert "IMEX" in d["fabric_reason"], d


# -- closing waits for the buffer's own copies, not for the user's other work --------


@pytest.mark.cudadriver
@pytest.mark.parametrize("kind,drop", [("posix-fd", False), ("cuda-ipc", False), ("posix-fd", True)],
                         ids=["posix-fd", "cuda-ipc", "request-dropped"])
def test_close_waits_for_its_own_copies_and_leaves_other_work_queued(spawn, kind, drop):
    exporter, importer = spawn(), spawn()
    if kind == "posix-fd":
        exporter.call("allocate", "buf", 2 * MiB, 0, None, 0)
    else:  # memory from an exportable pool
        exporter.call("ipc_pool_alloc", "buf", 64 << 10, 0, 0)
    opened = importer.call("open_view", "v", exporter.call("export", "buf"))
    assert opened["path"] == kind
    data = bytes(range(256)) * 16
    seen = importer.call("close_with_copy_in_flight", "v", data, 0x77, drop)
    # The unrelated memset on the user's own stream did not run at close ...
    assert seen["unrelated_at_close"] == b"\0" * 8, seen
    # ... and runs when the user synchronises its stream (the context is sound).
    assert seen["unrelated_later"] == b"\x77" * 8, seen
    # The put queued on the view landed before the memory was unmapped or freed.
    assert seen["request_done"] is True
    if drop:
        assert seen["inflight_after"] == 0, seen  # the dropped request's copy was let go
    assert exporter.call("read", "buf", 0, len(data)) == data


@pytest.mark.cudadriver
def test_zeros_returns_zeros_without_running_the_callers_other_work(spawn):
    seen = spawn().call("zeros_beside_pending_work", 64 << 10, 0x55)
    assert seen["zeros"] is True
    assert seen["unrelated_at_return"] == b"\0" * 16, seen      # neither user stream ran
    assert seen["unrelated_later"] == b"\x55" * 16, seen


# -- torch host tensors (no stand-in) -----------------------------------------------

_TORCH_HOST = """
import torch
from gpushare import _buffers
for dtype in (torch.float32, torch.bfloat16, torch.uint8):
    t = torch.arange(64).to(dtype)
    lb = _buffers.resolve(t, writable=True)
    assert (lb.memory_type, lb.address, lb.nbytes) == ("host", t.data_ptr(), t.nbytes), (dtype, lb)
    assert lb.device is None and lb.readonly is False, (dtype, lb)
    lb.release()
print("ok")
"""


def test_torch_host_tensors_resolve_as_host_memory():
    # In a process of its own: importing torch into a process that has loaded
    # UCX (this one may have) aborts in libc.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    r = subprocess.run([sys.executable, "-c", _TORCH_HOST], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
