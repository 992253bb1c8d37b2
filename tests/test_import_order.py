"""Any library may load after gpushare started UCX in a process, and transfers keep working.

UCX's memory hooks once replaced the allocator in every loaded library's relocation table
(``UCX_MEM_MMAP_HOOK_MODE=reloc`` installs libucm's malloc by relocation where the node has no
InfiniBand); a library loaded later ran its constructors before it was patched, freed libucm's
blocks with glibc's ``free`` and aborted the process (CuPy and torch did).  gpushare now turns
UCX's memory events off there, so nothing is patched, and keeps a peer's death during a
rendezvous transfer harmless without a registration cache by passing its own memory handles.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import gpushare as gs

from _procs import Child
import _share_peer

HERE = os.path.dirname(os.path.abspath(__file__))
NBYTES = 4 << 20  # above the region server's eager limit: a rendezvous transfer

ALLOC_C = """
#include <stdlib.h>
#include <string.h>
void *gs_kept;
int gs_freed;
void gs_alloc(size_t n) { gs_kept = malloc(n); memset(gs_kept, 1, n); }
int gs_kept_is_freed(void) { return gs_freed; }
"""
FREE_C = """
#include <stdlib.h>
extern void *gs_kept;
extern int gs_freed;
__attribute__((constructor)) static void gs_free_at_load(void) { free(gs_kept); gs_kept = 0; gs_freed = 1; }
"""


@pytest.fixture(scope="module")
def clibs(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler to build the two test libraries")
    d = tmp_path_factory.mktemp("clibs")
    (d / "alloc.c").write_text(ALLOC_C)
    (d / "free.c").write_text(FREE_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libgsalloc.so"), str(d / "alloc.c")], check=True)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libgsfree.so"), str(d / "free.c"),
                    f"-L{d}", "-lgsalloc", f"-Wl,-rpath,{d}"], check=True)
    return str(d)


@pytest.fixture
def exported():
    buf = gs.allocate(NBYTES, device="host")
    arr = np.asarray(buf)
    arr[:] = 7
    share = gs.export(buf, lifetime="revoked")
    held = {"share": share, "arr": arr}
    del arr
    yield held  # pytest keeps what a fixture yields until its teardown: cleared there
    share.revoke()
    held.clear()
    buf.close()


def run_importer(share, what: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    from gpushare import _auth

    return subprocess.run([sys.executable, os.path.join(HERE, "_import_order_peer.py"), what, *args],
                          input=f"{share.to_bytes().hex()}\n{_auth.key().hex()}\n", capture_output=True, text=True,
                          timeout=240, env={**os.environ, **(env or {})})


def check_lived(r: subprocess.CompletedProcess, arr) -> None:
    if r.returncode < 0:
        pytest.fail(f"the importer died of {signal.Signals(-r.returncode).name}: {r.stderr[-2000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", "ucx-rma", "7", "7"], r.stdout
    assert (arr == 8).all()  # the put after the load arrived


def test_a_library_whose_constructor_frees_another_librarys_block_loads_after_ucx(clibs, exported):
    share, arr = exported["share"], exported["arr"]
    check_lived(run_importer(share, "clibs", clibs), arr)


def test_the_old_relocation_hooks_abort_on_the_same_libraries(clibs, exported):
    """The same program under the hook settings gpushare chose before dies: the test above can fail."""
    share = exported["share"]
    r = run_importer(share, "clibs", clibs, env={"UCX_MEM_MMAP_HOOK_MODE": "reloc", "UCX_MEM_EVENTS": "y"})
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stdout, r.stderr[-2000:])


def test_torch_imports_after_a_ucx_rma_open(exported):
    pytest.importorskip("torch", reason="torch is an optional extra: pip install torch to run this test")
    share, arr = exported["share"], exported["arr"]
    check_lived(run_importer(share, "torch"), arr)


def _hook_settings_after_loading(env: dict) -> list[str]:
    code = ("import os; from gpushare import ucx; ucx.server(); "
            "print(os.environ.get('UCX_MEM_EVENTS', '<unset>'), os.environ.get('UCX_MEM_MMAP_HOOK_MODE', '<unset>'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_MEM_")} | env
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_memory_events_are_off_unless_the_node_has_infiniband():
    """Chosen before UCX's libraries load (UCX reads them then), and inherited; the user's own
    setting of either variable wins."""
    from gpushare._ucx._loader import infiniband_present

    assert _hook_settings_after_loading({}) == (["<unset>", "<unset>"] if infiniband_present() else ["n", "<unset>"])
    assert _hook_settings_after_loading({"UCX_MEM_EVENTS": "y"}) == ["y", "<unset>"]
    assert _hook_settings_after_loading({"UCX_MEM_MMAP_HOOK_MODE": "bistro"}) == ["<unset>", "bistro"]


STORM = 50  # gets and as many puts, each of STORM_BYTES
STORM_BYTES = 4 << 20  # a rendezvous transfer each way (puts above 1 MiB, gets above 256 KiB)


@pytest.mark.parametrize("killed", ["exporter", "importer"])
def test_a_peer_killed_during_50_rendezvous_puts_and_gets_crashes_neither_side(killed):
    """UCX without a registration cache (memory events off) crashed when a peer failed during a
    rendezvous transfer whose memory handle UCX registered itself; with gpushare's own handles on
    both sides, the survivor reports the failures, and serves or opens anew."""
    exporter, importer = Child(_share_peer.setup), Child(_share_peer.setup)
    survivor, victim = (importer, exporter) if killed == "exporter" else (exporter, importer)
    try:
        share = exporter.call("export", "host", 64 << 20, {"lifetime": "revoked"})
        assert importer.call("open", "v", share, {"prefer": ["ucx-rma"]})["path"] == "ucx-rma"
        importer.call("storm_start", "v", STORM, STORM_BYTES)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.join(10)
        if killed == "exporter":
            outcomes = importer.call("storm_finish", 30, timeout=90)
            assert len(outcomes) == 2 * STORM and set(outcomes) <= {"ok", "UCXConnectionError",
                                                                    "ExporterUnreachableError", "UCXError",
                                                                    "UCXCanceledError"}, outcomes
            assert outcomes.count("ok") < 2 * STORM  # the kill met transfers in flight
            importer.call("close", "v")
        # The survivor lives and works: a fresh exporter-importer pair with it on one side.
        fresh = Child(_share_peer.setup)
        try:
            if killed == "exporter":
                again = fresh.call("export", "host", 8 << 20, {"lifetime": "revoked"})
                assert importer.call("open", "w", again, {"prefer": ["ucx-rma"]})["path"] == "ucx-rma"
                assert importer.call("get", "w", 1 << 20, 4) == bytes([0, 1, 2, 3])
            else:
                assert fresh.call("open", "w", share, {"prefer": ["ucx-rma"]})["path"] == "ucx-rma"
                assert fresh.call("get", "w", 1 << 20, 4) == bytes([0, 1, 2, 3])
        finally:
            assert fresh.close() == 0
        assert survivor.proc.is_alive()
    finally:
        for c in (exporter, importer):
            if c.proc.is_alive():
                assert c.close() == 0, f"the {'exporter' if c is exporter else 'importer'} exited badly"
            else:
                c.proc.join(5)
