"""The package surface: public names, import hygiene, examples, CLI."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import gpushare

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_exactly_the_public_names():
    public = {n for n in dir(gpushare) if not n.startswith("_")} - {"annotations", "importlib", "TYPE_CHECKING", "Any"}
    public |= {"ucx", "__version__"}
    assert set(gpushare.__all__) == public
    assert len(gpushare.__all__) == len(set(gpushare.__all__))
    for name in gpushare.__all__:
        getattr(gpushare, name)


def test_ucx_all_names_exist():
    from gpushare import ucx

    for name in ucx.__all__:
        assert getattr(ucx, name) is not None


def test_every_error_is_a_gpushare_error():
    for name in gpushare.__all__:
        obj = getattr(gpushare, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, gpushare.GpuShareError), name
    assert issubclass(gpushare.SlowPathWarning, UserWarning)


def test_import_starts_nothing_and_loads_no_native_library():
    code = textwrap.dedent(
        """
        import os, sys, threading
        env = dict(os.environ)
        import gpushare
        from gpushare import ucx
        assert threading.active_count() == 1, threading.enumerate()
        assert dict(os.environ) == env, "environment changed"
        maps = open("/proc/self/maps").read()
        for lib in ("libucp", "libucs", "libucxx", "libcuda"):
            assert lib not in maps, lib + " loaded on import"
        assert "gpushare._ucx._native" not in sys.modules
        assert not any(m.startswith("cuda") for m in sys.modules), [m for m in sys.modules if m.startswith("cuda")]
        print("clean")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "clean"


def test_rma_example_runs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "rma_two_processes.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exporter: first element is now -1.0" in r.stdout
    assert r.stdout.strip().endswith("ok")


def test_demo_command_moves_data_and_reports():
    r = subprocess.run([sys.executable, "-m", "gpushare", "demo", "--size-mib", "4", "--repeat", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "path: host-fd" in r.stdout  # the best path on a machine without a GPU
    assert "forced path: ucx-rma" in r.stdout
    assert r.stdout.count("bytes match the exporter's: True") == 2
    assert r.stdout.count("the exporter sees the bytes: True") == 2
    assert "GB/s" in r.stdout and r.stdout.strip().endswith("demo passed")


def test_doctor_reports_capabilities_and_decisions():
    r = subprocess.run([sys.executable, "-m", "gpushare", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "UCX transports:" in r.stdout and "tcp/lo" in r.stdout
    assert "host memory from gpushare.allocate, peer on same node: host-fd" in r.stdout
    assert "host memory from gpushare.allocate, peer on another node: ucx-rma" in r.stdout
    r = subprocess.run([sys.executable, "-m", "gpushare", "doctor", "--json"], capture_output=True, text=True,
                       timeout=120)
    import json

    data = json.loads(r.stdout)
    assert {d["path"] for d in data["decisions"]} >= {"host-fd", "ucx-rma"}


def test_demo_rejects_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "gpushare", "demo", "--size-mib", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "must be at least 1" in r.stderr
