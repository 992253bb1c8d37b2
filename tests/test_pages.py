"""Huge pages for gpushare.allocate host memory, and pre-faulting on import:
what the system grants, checked in the kernel's own accounting."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest

import gpushare as gs
from gpushare._paths import host_fd

from _procs import Child
import _share_peer

MiB = 1 << 20
THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
NR = "/proc/sys/vm/nr_hugepages"


def _smaps(address: int) -> dict[str, int]:
    """The kernel's counters (kB) for this process's mapping that holds ``address``."""
    out: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head.endswith(":") and line.split()[-1] == "kB":
                out[head[:-1]] = int(line.split()[1])
    return out


def _setting(path: str, value: str) -> str:
    """Set a kernel setting for one test (root); what it was, to put back."""
    if path == THP:
        before = host_fd.shmem_thp()
    else:
        with open(path) as f:
            before = f.read().strip()
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        pytest.skip(f"cannot change {path} here ({exc.strerror}): needs root")
    return before


@pytest.fixture
def shmem_thp_advise():
    before = _setting(THP, "advise")
    yield
    with open(THP, "w") as f:
        f.write(before)


@pytest.fixture
def reserved_huge_pages():
    with open(NR) as f:
        before = f.read().strip()
    before = _setting(NR, str(int(before) + 16))
    if int(host_fd._hugetlb_free()) < 16:
        with open(NR, "w") as f:
            f.write(before)
        pytest.skip("the kernel could not reserve 16 huge pages")
    yield
    with open(NR, "w") as f:
        f.write(before)


def test_bad_huge_page_requests_are_refused():
    for bad in (True, "yes", 2):
        with pytest.raises(gs.InvalidInputError, match="huge_pages"):
            gs.allocate(4096, device="host", huge_pages=bad)
    with pytest.raises(gs.InvalidInputError, match="multiple of the huge page size"):
        gs.allocate(8 * MiB, device="host", huge_pages="hugetlb", chunk_size=3 * MiB)
    with pytest.raises(gs.InvalidInputError, match="for host memory"):
        gs.allocate(4096, device=0, huge_pages=False)


def test_large_buffers_start_on_a_huge_page_boundary_on_both_sides():
    src = gs.empty(4 * MiB, np.uint8, huge_pages=False)
    assert src.ctypes.data % host_fd.HUGE == 0
    src[:] = 7
    small = gs.allocate(4096, device="host")
    assert small.huge_pages is None  # "auto" leaves small buffers alone
    share = gs.export(src)
    with gs.open(share, exclude=["same-process"]) as view:
        assert view.path == "host-fd" and view._mapped.address % host_fd.HUGE == 0
        assert (np.asarray(view) == 7).all()
    small.close()


def test_no_reserved_huge_pages_is_a_clear_error():
    if int(host_fd._hugetlb_free()) * host_fd.HUGE >= 64 * MiB:
        pytest.skip("this system has reserved huge pages free")
    with pytest.raises(gs.UnsupportedError, match="reserve more with `sysctl vm.nr_hugepages=N`"):
        gs.allocate(64 * MiB, device="host", huge_pages="hugetlb")


def test_transparent_huge_pages_back_the_buffer_where_shmem_allows_them(shmem_thp_advise):
    a = gs.empty(8 * MiB, np.uint8)  # huge_pages="auto"
    a.fill(3)
    assert a.base.buffer.huge_pages == "thp"  # the HostBuffer under the array
    counters = _smaps(a.ctypes.data)
    assert counters.get("ShmemPmdMapped", 0) + counters.get("FilePmdMapped", 0) >= 4096  # kB in 2 MiB pages
    plain = gs.empty(8 * MiB, np.uint8, huge_pages=False)
    plain.fill(3)
    counters = _smaps(plain.ctypes.data)
    assert counters.get("ShmemPmdMapped", 0) + counters.get("FilePmdMapped", 0) == 0


def test_reserved_huge_pages_go_to_another_process(reserved_huge_pages):
    buf = gs.allocate(6 * MiB, device="host", huge_pages="hugetlb")
    assert buf.huge_pages == "hugetlb" and buf.sizes == (6 * MiB,)
    assert _smaps(buf.ptr).get("Shared_Hugetlb", 0) + _smaps(buf.ptr).get("Private_Hugetlb", 0) == 6 * 1024
    np.asarray(buf)[:] = np.arange(6 * MiB) % 253
    child = Child(_share_peer.setup)
    try:
        share = gs.export(buf)
        assert child.call("open", "h", share)["path"] == "host-fd"
        assert child.call("get", "h", 5 * MiB, 8) == (np.arange(5 * MiB, 5 * MiB + 8) % 253).astype(np.uint8).tobytes()
        child.call("put", "h", 0, b"huge")
        assert bytes(np.asarray(buf)[:4]) == b"huge"
        child.call("close", "h")
    finally:
        child.close()
    del share
    buf.close()


def _faults_during(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_prefault_moves_the_page_faults_of_the_first_copy_into_the_open():
    exporter = Child(_share_peer.setup)
    try:
        share = exporter.call("export", "host4k", 32 * MiB, {"lifetime": "revoked"})
        dst = np.ones(32 * MiB, np.uint8)  # touched: its own pages fault no more
        for prefault, most, least in ((False, None, 200), (True, 50, None)):
            view = gs.open(share, prefault=prefault)
            faults = _faults_during(lambda: view.get(dst))
            assert view.path == "host-fd"
            assert dst[:4].tobytes() == bytes(range(4))
            if most is not None:
                assert faults <= most, f"{faults} page faults after a prefault"
            if least is not None:
                assert faults >= least, f"only {faults} page faults without a prefault"
            view.close()
        with pytest.raises(gs.InvalidInputError, match="prefault"):
            gs.open(share, prefault="yes")
    finally:
        exporter.close()
    assert os.getpid()  # the exporter's exit leaves this process's mappings alone
