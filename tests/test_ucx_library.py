"""The UCX gpushare loads: the libucx wheel's, whatever else the machine carries.

Machines often carry a UCX of their own in the system's library folder (HPC images do; CI installs
Debian's ``libucx0`` for these tests).  libucxx's own loader takes the wheel's UCX only when
``import librmm`` succeeds, so without librmm the system's copy was loaded, of another version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM_DIR = "/usr/lib/x86_64-linux-gnu"
SYSTEM_UCP = os.path.join(SYSTEM_DIR, "libucp.so.0")

needs_system_ucx = pytest.mark.skipif(
    not os.path.exists(SYSTEM_UCP),
    reason=f"no system UCX at {SYSTEM_UCP} (Debian's libucx0: apt-get install libucx0; CI installs it)")


@pytest.fixture
def ucx_on_path(tmp_path):
    """A folder holding the system's UCX libraries alone, for LD_LIBRARY_PATH (the system folder
    itself there would also replace the interpreter's own libraries)."""
    for name in ("libucp.so.0", "libucs.so.0", "libuct.so.0", "libucm.so.0"):
        os.symlink(os.path.join(SYSTEM_DIR, name), tmp_path / name)
    return str(tmp_path)


def wheel_dir() -> str:
    import libucx

    return os.path.realpath(os.path.join(os.path.dirname(libucx.__file__), "lib"))


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=180, env={**os.environ, **env})


@needs_system_ucx
def test_without_librmm_libucxx_alone_loads_the_system_ucx(ucx_on_path):
    """The machine is as hostile as intended: libucxx's loader, with librmm hidden and the system
    folder first on LD_LIBRARY_PATH, maps the system's UCX (what broke on the GPU machine)."""
    r = run("""
        import sys; sys.modules["librmm"] = None
        import libucxx
        libucxx.load_library()
        from gpushare._ucx import _libraries
        print("\\n".join(_libraries.mapped_ucx()))
    """, LD_LIBRARY_PATH=ucx_on_path)
    assert r.returncode == 0, r.stderr
    assert any(line.startswith(SYSTEM_DIR) for line in r.stdout.split()), r.stdout


@needs_system_ucx
def test_put_and_get_map_the_wheels_ucx_in_both_processes_with_a_system_ucx_present(ucx_on_path):
    # In a session of its own, so that its spawned importer goes too if it hangs (a wrong UCX made
    # both processes spin for good).
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_ucx_library_peer.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "LD_LIBRARY_PATH": ucx_on_path})
    try:
        stdout, stderr = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the exporter and its importer did not finish within 200 s: {stderr[-2000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the session is left
        except ProcessLookupError:
            pass
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["importer_exit"] == 0
    assert out["importer"]["path"] == "ucx-rma" and out["importer"]["first"] == 41
    assert out["exporter"]["after_put"] == 42  # the importer's put arrived
    for side in ("importer", "exporter"):
        files = out[side]["mapped"]
        assert sorted(os.path.basename(f) for f in files) == ["libucm.so.0", "libucp.so.0", "libucs.so.0",
                                                              "libuct.so.0"], (side, files)
        assert {os.path.dirname(f) for f in files} == {wheel_dir()}, (side, files)


@needs_system_ucx
def test_a_ucx_of_another_version_is_refused_naming_its_file_and_version():
    r = run("""
        import gpushare as gs
        from gpushare import ucx
        try:
            ucx.Agent()
        except gs.UCXLibraryError as exc:
            assert isinstance(exc, ImportError)
            print(exc)
    """, GPUSHARE_UCX_LIBRARY_DIR=SYSTEM_DIR)
    assert r.returncode == 0, r.stderr
    msg = r.stdout.strip()
    assert msg.startswith("UCX 1.13") and f"from {SYSTEM_DIR}" in msg, msg
    assert "built against UCX 1.21" in msg and "GPUSHARE_UCX_LIBRARY_DIR" in msg


@needs_system_ucx
def test_a_system_ucx_loaded_first_is_refused_before_gpushare_loads_a_second():
    r = run(f"""
        import ctypes
        ctypes.CDLL({SYSTEM_UCP!r})   # another library brought the system's UCX in first
        import gpushare as gs
        from gpushare import ucx
        from gpushare._ucx import _libraries
        try:
            ucx.Agent()
        except gs.UCXLibraryError as exc:
            print(exc)
        print(sorted({{f.rsplit("/", 1)[0] for f in _libraries.mapped_ucx()}}))
    """)
    assert r.returncode == 0, r.stderr
    msg, dirs = r.stdout.strip().splitlines()
    assert msg.startswith("another UCX is already loaded in this process: UCX 1.13"), msg
    assert SYSTEM_DIR in msg and wheel_dir() in msg
    assert dirs == repr([SYSTEM_DIR])  # nothing of the wheel's UCX was loaded beside it


def test_a_library_dir_without_ucx_is_refused():
    r = run("""
        import gpushare as gs
        from gpushare import ucx
        try:
            ucx.Agent()
        except gs.UCXLibraryError as exc:
            print(exc)
    """, GPUSHARE_UCX_LIBRARY_DIR="/nonexistent")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "GPUSHARE_UCX_LIBRARY_DIR='/nonexistent' holds no libucp.so.0"


def test_the_loaded_ucx_is_the_wheels_and_the_version_the_module_was_built_against():
    r = run("""
        from gpushare._ucx import _loader
        n = _loader.native()
        libs = _loader.loaded()
        print(libs.ucx_dir, tuple(n.ucx_built_version()) == libs.ucx_version[:2], tuple(n.ucx_version()))
    """)
    assert r.returncode == 0, r.stderr
    folder, same, version = r.stdout.split(maxsplit=2)
    assert folder == wheel_dir() and same == "True" and version.strip() == "(1, 21, 0)"
