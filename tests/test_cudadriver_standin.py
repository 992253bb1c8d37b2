"""The CUDA driver stand-in (tests/cudadriver) keeps the driver's contract.

Every test runs its code in child processes that load the stand-in through
LD_LIBRARY_PATH; the pytest process never does.  These are checks of the
stand-in, which gpushare's own CUDA tests then rely on; those of sharing
memory between processes (VMM handles, legacy IPC, pools) are in
test_cudadriver_standin_ipc.py.
"""

from __future__ import annotations

import textwrap

import pytest
from _standin_run import lines, run  # noqa: F401 - run is a fixture

pytestmark = pytest.mark.cudadriver


def test_cuda_core_device_stream_allocate_and_copy(run):
    out = run(
        """
        from cuda.core import Device
        d = Device(0)
        d.set_current()
        print(d.name)
        s = d.create_stream()
        a = d.allocate(4096, stream=s)
        b = d.allocate(4096, stream=s)
        ok(drv.cuMemcpyHtoDAsync(int(a.handle), b"x" * 4096, 4096, int(s.handle)))
        b.copy_from(a, stream=s)
        e = s.record()
        e.sync()
        print(dtoh(int(b.handle), 4096) == b"x" * 4096)
        a.close(s); b.close(s); s.sync()
        """
    )
    assert lines(out) == ["gpushare CUDA driver stand-in", "True"]


def test_calls_without_a_current_context_fail_with_invalid_context(run):
    out = run(
        """
        ok(drv.cuInit(0))
        print(err(drv.cuMemAlloc(1024)))
        print(err(drv.cuStreamCreate(0)))
        print(err(drv.cuCtxSynchronize()))
        print(err(drv.cuMemcpyHtoD(0x1000, b"x", 1)))
        print(err(drv.cuMemAllocAsync(1024, 0)))
        # VMM calls that name their device work without a context
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = ok(drv.cuMemAddressReserve(GRAN, 0, 0, 0))
        ok(drv.cuMemMap(va, GRAN, 0, h, 0))
        ok(drv.cuMemSetAccess(va, GRAN, [access(0, RW)], 1))
        ok(drv.cuMemUnmap(va, GRAN)); ok(drv.cuMemAddressFree(va, GRAN)); ok(drv.cuMemRelease(h))
        print("vmm ok")
        """
    )
    assert lines(out) == ["CUDA_ERROR_INVALID_CONTEXT"] * 5 + ["vmm ok"]


def test_device_to_device_copy_shows_old_bytes_until_synchronized(run):
    out = run(
        """
        setup()
        src = ok(drv.cuMemAlloc(64)); dst = ok(drv.cuMemAlloc(64))
        htod(src, b"n" * 64); htod(dst, b"o" * 64)
        ok(drv.cuCtxSynchronize())
        s = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
        ok(drv.cuMemcpyDtoDAsync(dst, src, 64, s))
        print(peek(dst, 1), dtoh(dst, 1))       # the legacy stream does not wait for a non-blocking one
        print(err(drv.cuStreamQuery(s)))        # pending work is reported ...
        print(err(drv.cuStreamQuery(s)))        # ... and completes afterwards
        print(peek(dst, 1))
        ok(drv.cuMemcpyDtoDAsync(dst, src, 64, 0))   # legacy stream, sync DtoH drains it
        print(dtoh(dst, 64) == b"n" * 64)
        htod(src, b"b" * 64)
        blocking = ok(drv.cuStreamCreate(0))
        ok(drv.cuMemcpyDtoDAsync(dst, src, 64, blocking))
        print(peek(dst, 1), dtoh(dst, 1))       # the legacy stream waits for blocking streams
        """
    )
    assert lines(out) == ["b'o' b'o'", "CUDA_ERROR_NOT_READY", "CUDA_SUCCESS", "b'n'", "True", "b'n' b'b'"]


def test_pageable_host_to_device_copy_lands_only_at_synchronization(run):
    out = run(
        """
        import ctypes
        setup()
        dst = ok(drv.cuMemAlloc(16))
        src = ctypes.create_string_buffer(b"A" * 16, 16)
        ok(drv.cuMemcpyHtoD(dst, ctypes.addressof(src), 16))   # staged, not yet written
        ctypes.memmove(src, b"B" * 16, 16)                     # the staged copy keeps the old source
        print(peek(dst, 16))
        ok(drv.cuCtxSynchronize())
        print(peek(dst, 16))
        s = ok(drv.cuStreamCreate(0))
        ok(drv.cuMemcpyHtoDAsync(dst, b"C" * 16, 16, s))
        print(peek(dst, 1))
        ok(drv.cuStreamSynchronize(s))
        print(peek(dst, 1))
        """
    )
    assert lines(out) == [repr(b"\0" * 16), repr(b"A" * 16), "b'A'", "b'C'"]


def test_events_order_streams_and_report_pending_work(run):
    out = run(
        """
        setup()
        a = ok(drv.cuMemAlloc(8)); b = ok(drv.cuMemAlloc(8)); c = ok(drv.cuMemAlloc(8))
        htod(a, b"12345678"); ok(drv.cuCtxSynchronize())
        nb = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        s1 = ok(drv.cuStreamCreate(nb)); s2 = ok(drv.cuStreamCreate(nb))
        ev = ok(drv.cuEventCreate(0))
        ok(drv.cuMemcpyDtoDAsync(b, a, 8, s1)); ok(drv.cuEventRecord(ev, s1))
        ok(drv.cuStreamWaitEvent(s2, ev, 0)); ok(drv.cuMemcpyDtoDAsync(c, b, 8, s2))
        ok(drv.cuStreamSynchronize(s2))          # runs s1 up to the event first
        print(peek(c, 8))
        ev2 = ok(drv.cuEventCreate(0))
        ok(drv.cuEventRecord(ev, s1)); ok(drv.cuMemcpyDtoDAsync(c, a, 1, s1)); ok(drv.cuEventRecord(ev2, s1))
        print(err(drv.cuEventElapsedTime(ev, ev2)))
        print(err(drv.cuEventQuery(ev2)), err(drv.cuEventQuery(ev2)))
        print(ok(drv.cuEventElapsedTime(ev, ev2)) >= 0)
        """
    )
    assert lines(out) == ["b'12345678'", "CUDA_ERROR_NOT_READY", "CUDA_ERROR_NOT_READY CUDA_SUCCESS", "True"]


def test_visible_devices_remap_ordinals_and_uuids_match_across_processes(run):
    code = """
        ok(drv.cuInit(0))
        n = ok(drv.cuDeviceGetCount())
        print(n, *[bytes(ok(drv.cuDeviceGetUuid(ok(drv.cuDeviceGet(i)))).bytes).hex() for i in range(n)])
        """
    plain = lines(run(code))[0].split()
    swapped = lines(run(code, CUDA_VISIBLE_DEVICES="1,0"))[0].split()
    assert plain[0] == swapped[0] == "2"
    assert plain[1] != plain[2]
    assert swapped[1:] == [plain[2], plain[1]]
    u1 = plain[2]
    by_uuid = f"GPU-{u1[:8]}"
    assert lines(run(code, CUDA_VISIBLE_DEVICES=by_uuid))[0].split() == ["1", u1]
    assert lines(run(code, CUDA_VISIBLE_DEVICES="1,7,0"))[0].split() == ["1", u1]  # stops at 7
    assert lines(run(code, CUDA_VISIBLE_DEVICES="0,0"))[0].split() == ["1", plain[1]]
    assert lines(run(code, GPUSHARE_STANDIN_DEVICES="3"))[0].split()[0] == "3"
    none = run("print(err(drv.cuInit(0)))", CUDA_VISIBLE_DEVICES="")
    assert lines(none) == ["CUDA_ERROR_NO_DEVICE"]


def test_vmm_memory_without_access_for_the_device_is_an_illegal_address(run):
    out = run(
        """
        setup(0)
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = vmm_map(h, GRAN, (0, RW))
        htod(va, b"ok"); print(dtoh(va, 2))
        _, ctx1 = setup(1)                      # device 1 has no access
        ok(drv.cuMemcpyDtoHAsync(bytearray(2), va, 2, 0))
        print(err(drv.cuCtxSynchronize()))
        print(err(drv.cuMemAlloc(16)))          # the context stays poisoned
        """
    )
    assert lines(out) == ["b'ok'", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ILLEGAL_ADDRESS"]


def test_vmm_read_only_access_refuses_writes(run):
    out = run(
        """
        setup(0)
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = vmm_map(h, GRAN, (0, RW))
        htod(va, b"ro"); ok(drv.cuCtxSynchronize())
        ok(drv.cuMemSetAccess(va, GRAN, [access(0, RO)], 1))
        loc = access(0, RO).location
        print(int(ok(drv.cuMemGetAccess(loc, va))))
        print(dtoh(va, 2))
        ok(drv.cuMemcpyHtoDAsync(va, b"xx", 2, 0))
        print(err(drv.cuCtxSynchronize()))
        """
    )
    assert lines(out) == ["1", "b'ro'", "CUDA_ERROR_ILLEGAL_ADDRESS"]


# Device memory of each kind, for a process that then touches it with the CPU:
# (what an exporting process does first, setting `q` (its own pointer to the
# memory), `child` and `fds`; or None) and the code that makes `p` in the
# process that touches it.
DEVICE_MEMORY = {
    "legacy": (None, "setup(0)\np = ok(drv.cuMemAlloc(4096))"),
    "vmm": (None, "setup(0)\nh = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))\np = vmm_map(h, GRAN, (0, RW), (1, RW))"),
    "pool": (None, "setup(0)\ns = ok(drv.cuStreamCreate(0))\np = ok(drv.cuMemAllocAsync(4096, s))"),
    "ipc-opened": (
        """
        setup(0)
        q = ok(drv.cuMemAlloc(4096))
        handle = raw(ok(drv.cuIpcGetMemHandle(q)))
        child += f"p = ok(drv.cuIpcOpenMemHandle(filled(drv.CUipcMemHandle(), {handle!r}), 1))"
        """,
        "setup(0)\n",
    ),
    "pool-imported": (
        """
        setup(0)
        pool = ok(drv.cuMemPoolCreate(pool_props(0)))
        s = ok(drv.cuStreamCreate(0))
        q = ok(drv.cuMemAllocFromPoolAsync(4096, pool, s)); ok(drv.cuStreamSynchronize(s))
        fds = [ok(drv.cuMemPoolExportToShareableHandle(pool, POSIX, 0))]
        data = raw(ok(drv.cuMemPoolExportPointer(q)))
        child += (f"pool = ok(drv.cuMemPoolImportFromShareableHandle({fds[0]}, POSIX, 0))\\n"
                  f"p = ok(drv.cuMemPoolImportPointer(pool, filled(drv.CUmemPoolPtrExportData(), {data!r})))")
        """,
        "setup(0)\n",
    ),
}
CPU_TOUCH = {"read": "ctypes.string_at(int(p), 1)", "write": "ctypes.memset(int(p), 0x55, 1)"}
TOUCH_AFTER_COPIES = """
htod(p, b"through the driver")
ok(drv.cuCtxSynchronize())
print(dtoh(p, 18), flush=True)
import ctypes
{touch}
print("the CPU reached device memory")
"""


@pytest.mark.parametrize(
    ("kind", "touch"), [(k, "read") for k in DEVICE_MEMORY] + [("legacy", "write"), ("vmm", "write"), ("pool", "write")]
)
def test_a_cpu_access_to_device_memory_kills_the_process_by_sigsegv(run, kind, touch):
    exporter, child = DEVICE_MEMORY[kind]
    code = "import signal\nq, fds, child = None, [], " + repr(child) + "\n"
    code += textwrap.dedent(exporter or "")
    code += "child += " + repr(TOUCH_AFTER_COPIES.format(touch=CPU_TOUCH[touch])) + "\n"
    code += "rc, out = peer_status(child, pass_fds=fds)\n"
    code += "print(rc == -signal.SIGSEGV, out.strip())\n"
    code += "if q is not None: print(dtoh(q, 18))\n"
    expected = ["True b'through the driver'"]
    if exporter:
        expected.append("b'through the driver'")  # the exporter sees what the importer wrote
    assert lines(run(code)) == expected


def test_copies_and_memsets_across_adjacent_vmm_mappings_reach_each_allocation(run):
    out = run(
        """
        setup(0)
        h1 = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0)); h2 = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = int(ok(drv.cuMemAddressReserve(2 * GRAN, 0, 0, 0)))
        ok(drv.cuMemMap(va, GRAN, 0, h1, 0)); ok(drv.cuMemMap(va + GRAN, GRAN, 0, h2, 0))
        ok(drv.cuMemSetAccess(va, 2 * GRAN, [access(0, RW)], 1))
        edge = va + GRAN - 4
        htod(edge, b"abcdefgh"); print(dtoh(edge, 8))
        ok(drv.cuMemsetD32(edge - 4, 0x41424344, 4)); print(dtoh(edge - 4, 16))
        htod(edge + 12, b"ijkl")
        b = vmm_map(h2, GRAN, (0, RW))                     # h2 alone, elsewhere: its first bytes
        print(dtoh(b, 12))
        """
    )
    assert lines(out) == ["b'abcdefgh'", "b'DCBADCBADCBADCBA'", "b'DCBADCBAijkl'"]


def test_vmm_access_granted_to_devices_is_not_granted_to_the_cpu(run):
    out = run(
        """
        setup(0)
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = vmm_map(h, GRAN, (0, RW), (1, RO))
        prot = [line.split()[1] for line in open("/proc/self/maps")
                if int(line.split("-")[0], 16) <= va < int(line.split()[0].split("-")[1], 16)]
        print(prot)
        """
    )
    assert lines(out) == ["['---p']"]


def test_the_stand_in_is_never_taken_for_a_gpu(run):
    out = run(
        """
        sys.path.insert(0, os.path.dirname(sys.path[0]))
        import conftest
        print(conftest.cuda_device_reason())
        """
    )
    assert "stand-in" in out


def test_current_context_is_per_thread_and_a_stack(run):
    out = run(
        """
        import threading
        dev0, ctx0 = setup(0)
        ctx1 = ok(drv.cuDevicePrimaryCtxRetain(ok(drv.cuDeviceGet(1))))
        seen = []
        t = threading.Thread(target=lambda: seen.append((int(ok(drv.cuCtxGetCurrent())), err(drv.cuMemAlloc(8)))))
        t.start(); t.join()
        print(seen[0][0], seen[0][1])                     # a new thread has no current context
        ok(drv.cuCtxPushCurrent(ctx1))
        print(int(ok(drv.cuCtxGetDevice())))
        print(int(ok(drv.cuCtxPopCurrent())) == int(ctx1), int(ok(drv.cuCtxGetDevice())))
        ok(drv.cuCtxSetCurrent(0))
        print(err(drv.cuCtxGetDevice()))
        """
    )
    assert lines(out) == ["0 CUDA_ERROR_INVALID_CONTEXT", "1", "True 0", "CUDA_ERROR_INVALID_CONTEXT"]


PTDS_CODE = """
import threading
from cuda.bindings import runtime
runtime.cudaGetDeviceCount()       # the runtime resolves per-thread variants too: they must not leak
setup(0)
a = ok(drv.cuMemAlloc(4)); b = ok(drv.cuMemAlloc(4))
htod(a, b"ptds"); ok(drv.cuCtxSynchronize())
ok(drv.cuMemcpyDtoDAsync(b, a, 4, 0))             # stream 0
res = []
def other():
    ok(drv.cuCtxSetCurrent(ok(drv.cuDevicePrimaryCtxRetain(ok(drv.cuDeviceGet(0))))))
    ok(drv.cuStreamSynchronize(0))                # the same stream only in legacy mode
    res.append(peek(b, 4))
t = threading.Thread(target=other); t.start(); t.join()
print(res[0])
ok(drv.cuStreamSynchronize(drv.CUstream(2)))       # CU_STREAM_PER_THREAD
print(peek(b, 4))
"""


def test_default_stream_is_legacy_unless_per_thread_mode_is_asked_for(run):
    assert lines(run(PTDS_CODE)) == ["b'ptds'", "b'ptds'"]
    per_thread = run(PTDS_CODE, CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM="1")
    assert lines(per_thread) == [repr(b"\0" * 4), "b'ptds'"]


def test_pointer_attributes_and_address_ranges_of_every_kind(run):
    out = run(
        """
        A = drv.CUpointer_attribute
        _, ctx = setup(0)
        def attrs(p):
            return [
                int(ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p))),
                ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)),
                int(ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p))) == int(p) - 16,
                ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_RANGE_SIZE, p)),
                int(ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, p))),
            ]
        legacy = ok(drv.cuMemAlloc(1000))
        print(*attrs(int(legacy) + 16), ok(drv.cuMemGetAddressRange(int(legacy) + 16))[1])
        s = ok(drv.cuStreamCreate(0))
        pool_ptr = ok(drv.cuMemAllocAsync(1000, s))
        pool = ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, pool_ptr))
        print(*attrs(int(pool_ptr) + 16), int(pool) != 0)
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(1, handle_types=1, rdma=True), 0))
        va = vmm_map(h, GRAN, (1, RW))
        print(*attrs(va + 16), ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, va)))
        h2 = ok(drv.cuMemRetainAllocationHandle(va + 100))
        print(int(h2) == int(h)); ok(drv.cuMemRelease(h2))
        host = ok(drv.cuMemAllocHost(64))
        print(*attrs(int(host) + 16)[:1], ok(drv.cuMemGetAddressRange(int(host)))[1])
        import ctypes
        unknown = ctypes.addressof(ctypes.create_string_buffer(8))
        print(err(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, unknown)),
              err(drv.cuMemGetAddressRange(unknown)))
        ok(drv.cuCtxSetCurrent(0))                         # pointer queries need no current context
        print(int(ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, legacy))),
              int(ok(drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va))),
              err(drv.cuMemGetAddressRange(legacy)))
        """
    )
    assert lines(out) == [
        "2 0 True 1000 0 1000",
        "2 0 True 1024 0 True",
        f"2 1 True {2 << 20} 1 1",
        "True",
        "1 64",
        "CUDA_ERROR_INVALID_VALUE CUDA_ERROR_NOT_FOUND",
        "2 2 CUDA_ERROR_INVALID_CONTEXT",
    ]


def test_pool_memory_freed_in_stream_order_is_then_an_illegal_address(run):
    out = run(
        """
        setup(0)
        s = ok(drv.cuStreamCreate(0))
        p = ok(drv.cuMemAllocAsync(256, s))
        ok(drv.cuMemcpyHtoDAsync(p, b"x" * 256, 256, s))
        ok(drv.cuMemFreeAsync(p, s))
        print(err(drv.cuMemFreeAsync(p, s)))              # a second free
        ok(drv.cuStreamSynchronize(s))
        ok(drv.cuMemsetD8Async(p, 0, 256, s))             # use after the free ran
        print(err(drv.cuStreamSynchronize(s)))
        """
    )
    assert lines(out) == ["CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_ILLEGAL_ADDRESS"]


def test_pinned_memory_copies_and_host_functions_run_in_stream_order(run):
    out = run(
        """
        import ctypes
        setup(0)
        host = ok(drv.cuMemAllocHost(8)); dev = ok(drv.cuMemAlloc(8)); back = ok(drv.cuMemAllocHost(8))
        ctypes.memmove(int(host), b"pinned!!", 8)
        s = ok(drv.cuStreamCreate(0))
        ok(drv.cuMemcpyHtoDAsync(dev, host, 8, s))
        ctypes.memmove(int(host), b"changed!", 8)         # pinned: read when the copy runs
        ok(drv.cuMemcpyDtoHAsync(back, dev, 8, s))
        seen = []                                         # a host function makes no CUDA calls
        cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: seen.append(ctypes.string_at(int(back), 8)))
        ok(drv.cuLaunchHostFunc(s, ctypes.cast(cb, ctypes.c_void_p).value, 0))
        ok(drv.cuMemsetD32Async(dev, 0x41414141, 2, s))
        print(seen)                                       # nothing ran yet
        ok(drv.cuStreamSynchronize(s))
        print(seen, peek(dev, 8))
        ok(drv.cuMemcpyHtoDAsync(dev, host, 8, s)); ok(drv.cuStreamSynchronize(s))
        print(peek(dev, 8))
        """
    )
    assert lines(out) == ["[]", "[b'changed!'] b'AAAAAAAA'", "b'changed!'"]


def test_cuda_calls_from_a_host_function_are_not_permitted(run):
    out = run(
        """
        import ctypes
        setup(0)
        s = ok(drv.cuStreamCreate(0))
        seen = []
        def fn(_):
            seen.append((err(drv.cuMemAlloc(8)), err(drv.cuStreamQuery(s)), err(drv.cuInit(0))))
        cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)
        ok(drv.cuLaunchHostFunc(s, ctypes.cast(cb, ctypes.c_void_p).value, 0))
        ok(drv.cuStreamSynchronize(s))
        print(*seen[0], err(drv.cuMemAlloc(8)))          # the thread may call again once it returned
        """
    )
    assert lines(out) == ["CUDA_ERROR_NOT_PERMITTED " * 3 + "CUDA_SUCCESS"]


NVML_CODE = """
from cuda.bindings import nvml
nvml.init_v2()
n = nvml.device_get_count_v2()
print(n)
for i in range(n):
    h = nvml.device_get_handle_by_index_v2(i)
    u = nvml.device_get_uuid(h)
    info = nvml.device_get_gpu_fabric_info_v(h)
    print(u, nvml.device_get_handle_by_uuid(u) == h, any(bytes(info.cluster_uuid)), info.clique_id, int(info.state))
nvml.shutdown()
ok(drv.cuInit(0))
print(*[bytes(ok(drv.cuDeviceGetUuid(ok(drv.cuDeviceGet(i)))).bytes).hex() for i in range(ok(drv.cuDeviceGetCount()))])
"""


def test_nvml_enumerates_physical_devices_with_the_cuda_uuids_and_fabric_state(run):
    out = lines(run(NVML_CODE, CUDA_VISIBLE_DEVICES="1", GPUSHARE_STANDIN_FABRIC="1"))
    assert out[0] == "2"  # NVML ignores CUDA_VISIBLE_DEVICES
    uuids = [line.split()[0] for line in out[1:3]]
    assert [line.split()[1:] for line in out[1:3]] == [["True", "True", "1", "3"]] * 2
    assert out[3] == uuids[1].removeprefix("GPU-").replace("-", "")  # ordinal 0 here is physical 1
    incomplete = lines(run(NVML_CODE, GPUSHARE_STANDIN_FABRIC="incomplete"))
    assert [line.split()[1:] for line in incomplete[1:3]] == [["True", "False", "0", "2"]] * 2
    off = lines(run(NVML_CODE))
    assert [line.split()[1:] for line in off[1:3]] == [["True", "False", "0", "0"]] * 2


def test_work_queued_at_exit_still_lands_in_shared_memory(run):
    out = run(
        """
        setup(0)
        p = ok(drv.cuMemAlloc(8))
        htod(p, b"before.."); ok(drv.cuCtxSynchronize())
        handle = raw(ok(drv.cuIpcGetMemHandle(p)))
        peer(f'''
        setup(0)
        p = ok(drv.cuIpcOpenMemHandle(filled(drv.CUipcMemHandle(), {handle!r}), 1))
        s = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
        ok(drv.cuMemcpyHtoDAsync(p, b"at exit!", 8, s))    # never synchronized
        ''')
        print(dtoh(p, 8))
        """
    )
    assert lines(out) == ["b'at exit!'"]


def test_cuda_calls_in_a_child_forked_after_cuinit_fail_as_not_initialized(run):
    out = run(
        """
        import glob
        pid = os.fork()                                    # before cuInit: the child may use CUDA
        if pid == 0:
            print("early child", err(drv.cuInit(0)), err(drv.cuDeviceGetCount()), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        setup(0)
        p = ok(drv.cuMemAlloc(8)); htod(p, b"parent.."); ok(drv.cuCtxSynchronize())
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=8), 0))
        names = glob.glob(f"/dev/shm/gsf-{os.getpid()}-*")
        s = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
        ok(drv.cuMemcpyHtoDAsync(p, b"queued..", 8, s))  # not yet run
        pid = os.fork()
        if pid == 0:
            print("child", err(drv.cuInit(0)), err(drv.cuDeviceGetCount()), err(drv.cuDeviceGet(0)),
                  err(drv.cuCtxGetCurrent()), err(drv.cuMemAlloc(8)), err(drv.cuCtxSynchronize()),
                  err(drv.cuMemcpyDtoH(bytearray(8), p, 8)), err(drv.cuInit(0)), flush=True)
            sys.exit(0)                                    # a whole exit, destructors included
        print(os.waitpid(pid, 0)[1])
        print(peek(p, 8), len(names), glob.glob(f"/dev/shm/gsf-{os.getpid()}-*") == names)
        ok(drv.cuStreamSynchronize(s)); print(dtoh(p, 8))
        """,
        GPUSHARE_STANDIN_FABRIC="1",
    )
    no = "CUDA_ERROR_NOT_INITIALIZED"
    assert lines(out) == [
        "early child CUDA_SUCCESS CUDA_SUCCESS",
        "child " + " ".join([no] * 8),
        "0",
        "b'parent..' 1 True",  # the child's exit neither ran the parent's work nor removed its names
        "b'queued..'",
    ]


def test_primary_context_release_and_reset(run):
    out = run(
        """
        dev, ctx = setup(0)
        print(ok(drv.cuDevicePrimaryCtxGetState(dev))[1])
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = vmm_map(h, GRAN)                              # no access granted to anyone
        ok(drv.cuMemcpyDtoHAsync(bytearray(1), va, 1, 0))
        print(err(drv.cuCtxSynchronize()), err(drv.cuStreamCreate(0)))
        ok(drv.cuDevicePrimaryCtxReset(dev))               # does not clear the poison
        print(ok(drv.cuDevicePrimaryCtxGetState(dev))[1], err(drv.cuMemAlloc(8)))
        ctx = ok(drv.cuDevicePrimaryCtxRetain(dev)); ok(drv.cuCtxSetCurrent(ctx))
        print(err(drv.cuMemAlloc(8)))
        ok(drv.cuDevicePrimaryCtxRelease(dev))
        print(err(drv.cuMemAlloc(8)))
        """
    )
    assert lines(out) == [
        "1",
        "CUDA_ERROR_ILLEGAL_ADDRESS CUDA_ERROR_ILLEGAL_ADDRESS",
        "0 CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    ]


def test_a_sticky_error_poisons_the_device_for_the_rest_of_the_process(run):
    out = run(
        """
        dev, ctx = setup(0)
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = vmm_map(h, GRAN)                              # no access granted to anyone
        p = ok(drv.cuMemAlloc(8)); htod(p, b"before.."); ok(drv.cuCtxSynchronize())
        own = ok(drv.cuCtxCreate(None, 0, dev))            # another context of device 0, current now
        s = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
        ok(drv.cuMemsetD8Async(p, 0x41, 8, s))             # queued there, never synchronised
        ok(drv.cuCtxPopCurrent())
        ok(drv.cuMemcpyDtoHAsync(bytearray(1), va, 1, 0))
        print(err(drv.cuCtxSynchronize()))
        ok(drv.cuCtxPushCurrent(own))
        print(err(drv.cuStreamSynchronize(s)), err(drv.cuMemAlloc(8)))
        ok(drv.cuCtxDestroy(own))
        fresh = ok(drv.cuCtxCreate(None, 0, dev))
        print(err(drv.cuMemAlloc(8)), err(drv.cuCtxSynchronize()))
        ok(drv.cuCtxDestroy(fresh))
        ok(drv.cuDevicePrimaryCtxReset(dev))
        setup(0)
        print(err(drv.cuMemAlloc(8)))
        setup(1)                                           # another device is not poisoned
        q = ok(drv.cuMemAlloc(8)); htod(q, b"device 1"); print(dtoh(q, 8))
        handle = raw(ok(drv.cuIpcGetMemHandle(p)))
        print(peer(f'''
        setup(0)                                           # a new process may use device 0 again
        p = ok(drv.cuIpcOpenMemHandle(filled(drv.CUipcMemHandle(), {handle!r}), 1))
        print(dtoh(p, 8))
        ''').strip())
        """
    )
    ill = "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert lines(out) == [
        ill,
        f"{ill} {ill}",   # the other context of the device: its queued memset never ran
        f"{ill} {ill}",   # a context created afterwards
        ill,              # the primary context after a reset
        "b'device 1'",
        "b'before..'",
    ]


def _child_setup() -> dict:
    import os

    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    _, name = driver.cuDeviceGetName(64, 0)
    _, count = driver.cuDeviceGetCount()
    reply = {"err": err.name, "name": name.split(b"\0")[0].decode(), "count": count, "env": os.environ["FOO"]}
    return {"_handlers": {}, "_reply": reply}


def test_children_started_under_standin_children_load_it(standin_lib):
    import os

    from _procs import Child
    from conftest import cuda_device_reason, standin_children

    before = dict(os.environ)
    with standin_children(standin_lib, CUDA_VISIBLE_DEVICES="1", FOO="bar"):
        child = Child(_child_setup)
    assert dict(os.environ) == before
    try:
        assert child.hello == {"err": "CUDA_SUCCESS", "name": "gpushare CUDA driver stand-in", "count": 1, "env": "bar"}
    finally:
        assert child.close() == 0
    cuda_device_reason()  # this process looks for a driver after the children did
    with open("/proc/self/maps") as maps:
        assert standin_lib not in maps.read()  # and never loads the stand-in


def test_released_memory_leaves_no_descriptors_mappings_or_shared_memory(run):
    out = run(
        """
        import glob
        def fds(): return len(os.listdir("/proc/self/fd"))
        def maps(): return sum("gs-standin" in line or "/gsf-" in line for line in open("/proc/self/maps"))
        setup(0)
        s = ok(drv.cuStreamCreate(0))
        for _ in range(2):        # the first round warms up lazily created pools
            before = (fds(), maps(), sorted(glob.glob(f"/dev/shm/gsf-{os.getpid()}-*")))
            p = ok(drv.cuMemAlloc(1 << 20)); ok(drv.cuIpcGetMemHandle(p)); ok(drv.cuMemFree(p))
            h = ok(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=9), 0))
            fd = ok(drv.cuMemExportToShareableHandle(h, POSIX, 0))
            h2 = ok(drv.cuMemImportFromShareableHandle(fd, POSIX))
            os.close(fd)
            va = vmm_map(h2, GRAN, (0, RW)); htod(va, b"x"); ok(drv.cuCtxSynchronize())
            ok(drv.cuMemUnmap(va, GRAN)); ok(drv.cuMemAddressFree(va, GRAN))
            va = vmm_map(h2, GRAN, (0, RW))
            ok(drv.cuMemAddressFree(va, GRAN))                          # unmaps what is still mapped
            ok(drv.cuMemRelease(h2)); ok(drv.cuMemRelease(h))
            props = drv.CUmemPoolProps()
            props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            props.handleTypes = POSIX
            props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            pool = ok(drv.cuMemPoolCreate(props))
            q = ok(drv.cuMemAllocFromPoolAsync(4096, pool, s)); ok(drv.cuMemPoolDestroy(pool))
            ok(drv.cuMemFreeAsync(q, s)); ok(drv.cuStreamSynchronize(s))   # the pool goes with its last block
            host = ok(drv.cuMemAllocHost(4096)); ok(drv.cuMemFreeHost(host))
            after = (fds(), maps(), sorted(glob.glob(f"/dev/shm/gsf-{os.getpid()}-*")))
        print(before == after, before[1:])
        """,
        GPUSHARE_STANDIN_FABRIC="1",
    )
    assert lines(out) == ["True (0, [])"]


@pytest.mark.parametrize("ci", [None, "1"])
def test_without_a_compiler_the_fixture_skips_except_under_ci(ci):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["CC"] = "/nonexistent/cc"
    if ci:
        env["CI"] = ci
    here = os.path.dirname(os.path.abspath(__file__))
    test = "test_cudadriver_standin.py::test_calls_without_a_current_context_fail_with_invalid_context"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", os.path.join(here, test)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=os.path.dirname(here),
    )
    assert "no C compiler ('/nonexistent/cc')" in r.stdout
    if ci:
        assert r.returncode != 0 and "1 error" in r.stdout
    else:
        assert r.returncode == 0 and "1 skipped" in r.stdout


def test_threads_using_it_at_once_get_their_own_results(run):
    out = run(
        """
        import threading
        dev, ctx = setup(0)
        errors, results = [], []
        def work(k):
            try:
                ok(drv.cuCtxSetCurrent(ctx))
                s = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
                for i in range(50):
                    a = ok(drv.cuMemAllocAsync(4096, s)); b = ok(drv.cuMemAlloc(4096))
                    ok(drv.cuMemsetD8Async(a, (k * 7 + i) % 256, 4096, s))
                    ok(drv.cuMemcpyDtoDAsync(b, a, 4096, s)); ok(drv.cuMemFreeAsync(a, s))
                    ok(drv.cuStreamSynchronize(s))
                    results.append(dtoh(b, 4096) == bytes([(k * 7 + i) % 256]) * 4096)
                    ok(drv.cuMemFree(b))
                ok(drv.cuStreamDestroy(s))
            except Exception as exc:
                errors.append(exc)
        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in ts: t.start()
        for t in ts: t.join(60)
        print(errors, len(results), all(results))
        """
    )
    assert lines(out) == ["[] 200 True"]


def test_ucx_cuda_transport_links_against_it(run):
    # UCX's CUDA transport links libcuda.so.1 by symbol name, not through
    # cuGetProcAddress: every symbol it needs must be there, or loading it
    # (or, lazily bound, the first call) kills the process.
    out = run(
        """
        import ctypes, glob
        import libucx
        libucx.load_library()
        lib = os.path.join(os.path.dirname(libucx.__file__), "lib", "ucx", "libuct_cuda.so.0")
        ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        print("loaded")
        """
    )
    assert lines(out) == ["loaded"]


def test_copies_into_unwritable_host_memory_fail_instead_of_crashing(run):
    out = run(
        """
        import mmap
        setup(0)
        p = ok(drv.cuMemAlloc(4096))
        m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
        import numpy as np
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        print(err(drv.cuMemcpyDtoH(addr, p, 4096)))
        print(err(drv.cuMemAlloc(8)))                       # a fault poisons the device like any other
        setup(1)
        ok(drv.cuMemHostRegister(addr, 4096, 8))            # CU_MEMHOSTREGISTER_READ_ONLY
        print(err(drv.cuMemsetD32(addr, 7, 1024)))          # a memset into it faults too
        """
    )
    assert lines(out) == ["CUDA_ERROR_ILLEGAL_ADDRESS"] * 3
