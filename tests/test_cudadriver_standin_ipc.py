"""The CUDA driver stand-in keeps the driver's contract for memory shared
between processes: VMM handles (POSIX fds, fabric), legacy IPC, pools, and
malformed handles.  As in test_cudadriver_standin.py, every test runs its
code in child processes that load the stand-in."""

from __future__ import annotations

import pytest
from _standin_run import lines, run  # noqa: F401 - run is a fixture

pytestmark = pytest.mark.cudadriver


def test_posix_fd_export_and_import_between_processes(run):
    out = run(
        """
        setup(0)
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=1, rdma=True), 0))
        va = vmm_map(h, GRAN, (0, RW))
        htod(va, b"shared!"); ok(drv.cuCtxSynchronize())
        fd = ok(drv.cuMemExportToShareableHandle(h, POSIX, 0))
        print(peer(f'''
        setup(0)
        h = ok(drv.cuMemImportFromShareableHandle({fd}, POSIX))
        prop = ok(drv.cuMemGetAllocationPropertiesFromHandle(h))
        print(int(prop.requestedHandleTypes), prop.location.id, prop.allocFlags.gpuDirectRDMACapable)
        va = vmm_map(h, {GRAN}, (0, RW))
        print(dtoh(va, 7))
        htod(va, b"answer!"); ok(drv.cuCtxSynchronize())
        ''', pass_fds=[fd]).strip())
        print(dtoh(va, 7))
        h2 = ok(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=0), 0))
        print(err(drv.cuMemExportToShareableHandle(h2, POSIX, 0)))
        """
    )
    assert lines(out) == ["1 0 1", "b'shared!'", "b'answer!'", "CUDA_ERROR_INVALID_VALUE"]


def test_fabric_tokens_import_in_another_process_when_enabled(run):
    out = run(
        """
        setup(0)
        d = ok(drv.cuDeviceGet(0))
        print(ok(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, d)))
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=8), 0))
        va = vmm_map(h, GRAN, (0, RW))
        htod(va, b"fabric"); ok(drv.cuCtxSynchronize())
        tok = bytes(ok(drv.cuMemExportToShareableHandle(h, FABRIC, 0)).data)
        print(len(tok))
        print(peer(f'''
        setup(1)
        fh = drv.CUmemFabricHandle(); fh.data = {tok!r}
        h = ok(drv.cuMemImportFromShareableHandle(fh.getPtr(), FABRIC))
        va = vmm_map(h, {GRAN}, (1, RW))
        print(dtoh(va, 6))
        ''').strip())
        ok(drv.cuMemUnmap(va, GRAN)); ok(drv.cuMemRelease(h))   # the exporter's last handle: the token dies
        print(peer(f'''
        setup(0)
        fh = drv.CUmemFabricHandle(); fh.data = {tok!r}
        print(err(drv.cuMemImportFromShareableHandle(fh.getPtr(), FABRIC)))
        ''').strip())
        """,
        GPUSHARE_STANDIN_FABRIC="1",
    )
    assert lines(out) == ["1", "64", "b'fabric'", "CUDA_ERROR_INVALID_VALUE"]


def test_fabric_names_go_with_the_exporting_process(run):
    out = run(
        """
        import glob
        pid = peer('''
        import glob
        setup(0)
        ok(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=8), 0))   # never released
        print(len(glob.glob(f"/dev/shm/gsf-{os.getpid()}-*")), os.getpid())
        ''').split()
        print(pid[0], glob.glob(f"/dev/shm/gsf-{pid[1]}-*"))
        """,
        GPUSHARE_STANDIN_FABRIC="1",
    )
    assert lines(out) == ["1 []"]


def test_fabric_handles_are_refused_when_not_enabled(run):
    out = run(
        """
        setup(0)
        d = ok(drv.cuDeviceGet(0))
        print(ok(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, d)))
        print(err(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=8), 0)))
        print(err(drv.cuMemCreate(GRAN, vmm_prop(0, handle_types=9), 0)))
        """
    )
    assert lines(out) == ["0", "CUDA_ERROR_NOT_PERMITTED", "CUDA_ERROR_NOT_PERMITTED"]


def test_legacy_ipc_between_processes_and_its_refusals(run):
    out = run(
        """
        setup(0)
        p = ok(drv.cuMemAlloc(100))
        htod(p, b"legacy"); ok(drv.cuCtxSynchronize())
        h = ok(drv.cuIpcGetMemHandle(p))
        handle = raw(h)
        print(err(drv.cuIpcOpenMemHandle(h, 1)))       # not in the exporting process
        print(peer(f'''
        setup(0)
        h = filled(drv.CUipcMemHandle(), {handle!r})
        p = ok(drv.cuIpcOpenMemHandle(h, 1))
        print(dtoh(p, 6), ok(drv.cuMemGetAddressRange(p))[1])
        htod(p, b"LEGACY"); ok(drv.cuCtxSynchronize())
        ok(drv.cuIpcCloseMemHandle(p))
        print(err(drv.cuIpcCloseMemHandle(p)))
        ''').strip())
        print(dtoh(p, 6))
        s = ok(drv.cuStreamCreate(0))
        q = ok(drv.cuMemAllocAsync(64, s))
        print(err(drv.cuIpcGetMemHandle(q)))           # pool memory is not legacy-IPC capable
        print(ok(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p)),
              ok(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, q)))
        """
    )
    assert lines(out) == [
        "CUDA_ERROR_INVALID_CONTEXT",
        "b'legacy' 100",
        "CUDA_ERROR_INVALID_VALUE",
        "b'LEGACY'",
        "CUDA_ERROR_INVALID_VALUE",
        "True False",
    ]


def test_legacy_ipc_handle_of_freed_memory_is_refused_even_when_its_fd_number_is_reused(run):
    out = run(
        """
        setup(0)
        def memfds():
            out = {}
            for fd in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if "gs-standin-ipc" in target:
                    out[fd] = target
            return out
        p = ok(drv.cuMemAlloc(64))
        first = memfds()
        handle = raw(ok(drv.cuIpcGetMemHandle(p)))
        ok(drv.cuMemFree(p))
        q = ok(drv.cuMemAlloc(64))                          # takes the same fd number
        second = memfds()
        print(len(first) == 1 and first.keys() == second.keys() and first != second)
        print(peer(f'''
        setup(0)
        print(err(drv.cuIpcOpenMemHandle(filled(drv.CUipcMemHandle(), {handle!r}), 1)))
        ''').strip())
        """
    )
    assert lines(out) == ["True", "CUDA_ERROR_INVALID_VALUE"]


def test_legacy_ipc_shows_unsynchronized_writes_as_old_bytes_in_the_importer(run):
    out = run(
        """
        setup(0)
        p = ok(drv.cuMemAlloc(8)); src = ok(drv.cuMemAlloc(8))
        htod(p, b"oldoldol"); htod(src, b"newnewne"); ok(drv.cuCtxSynchronize())
        handle = raw(ok(drv.cuIpcGetMemHandle(p)))
        s = ok(drv.cuStreamCreate(0))
        ok(drv.cuMemcpyDtoDAsync(p, src, 8, s))        # not synchronized
        code = f'''
        setup(0)
        h = filled(drv.CUipcMemHandle(), {handle!r})
        print(dtoh(ok(drv.cuIpcOpenMemHandle(h, 1)), 8))
        '''
        print(peer(code).strip())
        ok(drv.cuStreamSynchronize(s))
        print(peer(code).strip())
        """
    )
    assert lines(out) == ["b'oldoldol'", "b'newnewne'"]


def test_pool_ipc_export_and_import_between_processes(run):
    out = run(
        """
        setup(0)
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = POSIX
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        pool = ok(drv.cuMemPoolCreate(props))
        s = ok(drv.cuStreamCreate(0))
        p = ok(drv.cuMemAllocFromPoolAsync(4096, pool, s))
        ok(drv.cuMemcpyHtoDAsync(p, b"pooled", 6, s)); ok(drv.cuStreamSynchronize(s))
        fd = ok(drv.cuMemPoolExportToShareableHandle(pool, POSIX, 0))
        data = raw(ok(drv.cuMemPoolExportPointer(p)))
        print(peer(f'''
        setup(0)
        pool = ok(drv.cuMemPoolImportFromShareableHandle({fd}, POSIX, 0))
        d = filled(drv.CUmemPoolPtrExportData(), {data!r})
        p = ok(drv.cuMemPoolImportPointer(pool, d))
        print(dtoh(p, 6))
        ok(drv.cuMemFreeAsync(p, 0)); ok(drv.cuCtxSynchronize())
        ''', pass_fds=[fd]).strip())
        dflt = ok(drv.cuDeviceGetDefaultMemPool(ok(drv.cuDeviceGet(0))))
        print(err(drv.cuMemPoolExportToShareableHandle(dflt, POSIX, 0)))
        """
    )
    assert lines(out) == ["b'pooled'", "CUDA_ERROR_INVALID_VALUE"]


def test_pool_memory_is_accessible_from_other_devices_only_as_granted(run):
    # One process per refused access: an illegal address poisons the device.
    out = run(
        """
setup(1)
mine = ok(drv.cuMemAlloc(64)); htod(mine, b"1" * 64)
setup(0)
pool = ok(drv.cuMemPoolCreate(pool_props(0)))
p = ok(drv.cuMemAllocFromPoolAsync(64, pool, 0)); htod(p, b"0" * 64); ok(drv.cuCtxSynchronize())
print(pool_flags(pool, 0), pool_flags(pool, 1))
print(err(drv.cuMemPoolSetAccess(pool, [access(0, RO)], 1)))      # the resident device keeps its access
ok(drv.cuMemPoolSetAccess(pool, [access(1, RO)], 1))
print(pool_flags(pool, 1), copy_on(1, mine, p, 64), dtoh(mine, 2))  # device 1 may read now ...
print(copy_on(1, p, mine, 64))                                     # ... but not write
"""
    )
    assert lines(out) == ["3 0", "CUDA_ERROR_INVALID_DEVICE", "1 CUDA_SUCCESS b'00'", "CUDA_ERROR_ILLEGAL_ADDRESS"]
    refused = run(
        """
setup(1)
mine = ok(drv.cuMemAlloc(64))
setup(0)
p = ok(drv.cuMemAllocAsync(64, 0))                                # the default pool: device 0 only
print(copy_on(1, mine, p, 64), err(drv.cuMemAlloc(8)))
"""
    )
    assert lines(refused) == ["CUDA_ERROR_ILLEGAL_ADDRESS CUDA_ERROR_ILLEGAL_ADDRESS"]


def test_an_imported_pool_is_accessible_only_from_its_resident_device_until_granted(run):
    out = run(
        """
setup(0)
pool = ok(drv.cuMemPoolCreate(pool_props(0)))
ok(drv.cuMemPoolSetAccess(pool, [access(1, RW)], 1))             # granted here: not carried over
p = ok(drv.cuMemAllocFromPoolAsync(64, pool, 0)); htod(p, b"exported" * 8); ok(drv.cuCtxSynchronize())
fd = ok(drv.cuMemPoolExportToShareableHandle(pool, POSIX, 0))
data = raw(ok(drv.cuMemPoolExportPointer(p)))
importer = f'''
setup(0)
pool = ok(drv.cuMemPoolImportFromShareableHandle({fd}, POSIX, 0))
p = ok(drv.cuMemPoolImportPointer(pool, filled(drv.CUmemPoolPtrExportData(), {data!r})))
setup(1)
mine = ok(drv.cuMemAlloc(64))
print(pool_flags(pool, 0), pool_flags(pool, 1))
'''
print(peer(importer + '''
ok(drv.cuMemPoolSetAccess(pool, [access(1, RW)], 1))
print(pool_flags(pool, 1), copy_on(1, mine, p, 64), dtoh(mine, 8))
''', pass_fds=[fd]).strip())
print(peer(importer + "print(copy_on(1, mine, p, 64))", pass_fds=[fd]).strip())
"""
    )
    assert lines(out) == ["3 0", "3 CUDA_SUCCESS b'exported'", "3 0", "CUDA_ERROR_ILLEGAL_ADDRESS"]


def test_cuda_core_ipc_memory_resource_between_processes(run):
    out = run(
        """
        from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
        d = Device(0); d.set_current()
        mr = DeviceMemoryResource(d, options=DeviceMemoryResourceOptions(ipc_enabled=True, max_size=64 << 20))
        s = d.create_stream()
        buf = mr.allocate(1024, stream=s)
        ok(drv.cuMemcpyHtoDAsync(int(buf.handle), b"core-ipc", 8, int(s.handle))); s.sync()
        fd = int(mr.allocation_handle.handle)
        import pickle
        blob = pickle.dumps(buf.ipc_descriptor)
        print(peer(f'''
        import pickle
        from cuda.core import Buffer, Device, DeviceMemoryResource
        d = Device(0); d.set_current(); s = d.create_stream()
        mr = DeviceMemoryResource.from_allocation_handle(d, {fd})
        buf = Buffer.from_ipc_descriptor(mr, pickle.loads({blob!r}), stream=s)
        print(dtoh(int(buf.handle), 8))
        buf.close(s); s.sync()
        ''', pass_fds=[fd]).strip())
        buf.close(s); s.sync()
        """
    )
    assert lines(out) == ["b'core-ipc'"]


def test_unmapping_under_queued_use_is_an_illegal_address_and_poisons_the_context(run):
    out = run(
        """
        setup(0)
        h = ok(drv.cuMemCreate(GRAN, vmm_prop(0), 0))
        va = vmm_map(h, GRAN, (0, RW))
        dst = ok(drv.cuMemAlloc(16))
        s = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
        ok(drv.cuMemcpyDtoDAsync(dst, va, 16, s))
        ok(drv.cuMemUnmap(va, GRAN))
        print(err(drv.cuStreamSynchronize(s)))
        print(err(drv.cuMemAlloc(16)), err(drv.cuStreamCreate(0)))
        """
    )
    assert lines(out) == ["CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ILLEGAL_ADDRESS CUDA_ERROR_ILLEGAL_ADDRESS"]


def test_malformed_handles_and_tokens_give_errors_not_crashes(run):
    out = run(
        """
        import os
        setup(0)
        posix = POSIX
        h = filled(drv.CUipcMemHandle(), os.urandom(64))
        print(err(drv.cuIpcOpenMemHandle(h, 1)))
        fd = os.open("/dev/null", os.O_RDONLY)
        print(err(drv.cuMemImportFromShareableHandle(fd, posix)))
        print(err(drv.cuMemPoolImportFromShareableHandle(fd, posix, 0)))
        os.close(fd)
        print(err(drv.cuMemImportFromShareableHandle(fd, posix)))       # closed fd
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = posix
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        pool = ok(drv.cuMemPoolCreate(props))
        pfd = ok(drv.cuMemPoolExportToShareableHandle(pool, posix, 0))
        print(peer(f'''
        setup(0)
        pool = ok(drv.cuMemPoolImportFromShareableHandle({pfd}, {int(posix)}, 0))
        print(err(drv.cuMemPoolImportPointer(pool, filled(drv.CUmemPoolPtrExportData(), os.urandom(64)))))
        ''', pass_fds=[pfd]).strip())
        print(err(drv.cuMemRelease(12345)), err(drv.cuMemMap(0x1000, GRAN, 0, 12345, 0)))
        """
    )
    assert lines(out) == ["CUDA_ERROR_INVALID_VALUE"] * 5 + ["CUDA_ERROR_INVALID_VALUE CUDA_ERROR_INVALID_VALUE"]


def test_malformed_fabric_tokens_give_errors(run):
    out = run(
        """
        import os
        setup(0)
        fabric = FABRIC
        fh = drv.CUmemFabricHandle(); fh.data = os.urandom(64)
        print(err(drv.cuMemImportFromShareableHandle(fh.getPtr(), fabric)))
        fh.data = b"GSFABv1" + bytes(57)
        print(err(drv.cuMemImportFromShareableHandle(fh.getPtr(), fabric)))
        """,
        GPUSHARE_STANDIN_FABRIC="1",
    )
    assert lines(out) == ["CUDA_ERROR_INVALID_VALUE"] * 2


def test_entry_points_it_lacks_fail_loudly(run):
    out = run(
        """
        setup(0)
        try:
            drv.cuModuleLoadData(b"\\0")
        except Exception as exc:
            print("raised", "cuModuleLoad" in str(exc))
        """,
        GPUSHARE_STANDIN_TRACE="0",
    )
    assert lines(out) == ["raised True"]
