"""The package surface: public names, import hygiene, examples, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gpushare

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_exactly_the_public_names():
    # gpushare.ray (it imports Ray) and gpushare.multiprocessing (importing it
    # registers pickling reducers) are submodules a program imports by name, never in __all__
    public = {n for n in dir(gpushare) if not n.startswith("_")} - {"ray", "multiprocessing"}
    public |= {"ucx", "__version__"}
    # gpushare.open is public, but a star import must not shadow the builtin.
    assert callable(gpushare.open) and "open" not in gpushare.__all__
    assert set(gpushare.__all__) == public - {"open"}
    assert len(gpushare.__all__) == len(set(gpushare.__all__))
    for name in gpushare.__all__:
        getattr(gpushare, name)


def test_channels_arrays_and_asyncio_are_public():
    for name in ("channel", "subscribe", "Producer", "Consumer", "Step", "ChannelHandle", "ChannelBrokenError",
                 "CudaArray", "empty", "zeros", "empty_like", "open_async"):
        assert name in gpushare.__all__, name
        assert getattr(gpushare, name).__module__ == "gpushare", name


def test_star_import_shadows_no_builtin():
    import builtins

    assert not set(gpushare.__all__) & set(dir(builtins))
    namespace: dict = {}
    exec("from gpushare import *", namespace)
    assert "open" not in namespace


def test_public_classes_and_errors_present_themselves_as_gpushare():
    from gpushare import ucx

    for name in gpushare.__all__:
        obj = getattr(gpushare, name)
        if isinstance(obj, type):
            assert obj.__module__ == "gpushare", name
    assert repr(gpushare.ClosedError) == "<class 'gpushare.ClosedError'>"
    for name in ("Agent", "Endpoint", "MemoryHandle", "RemoteKey", "Request"):
        assert getattr(ucx, name).__module__ == "gpushare.ucx"
    # pickles refer to the public name, which resolves
    import pickle

    err = pickle.loads(pickle.dumps(gpushare.AccessDeniedError("no")))
    assert type(err) is gpushare.AccessDeniedError and str(err) == "no"


def test_package_ships_py_typed():
    assert (ROOT / "gpushare" / "py.typed").is_file()


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
    assert "\r" not in r.stdout and "%" not in r.stdout  # no progress line where stdout is no terminal


def test_demo_shows_each_copys_progress_on_a_terminal():
    import pty

    main, tty = pty.openpty()
    chunks = []
    try:
        with subprocess.Popen([sys.executable, "-m", "gpushare", "demo", "--size-mib", "2", "--repeat", "1"],
                              stdout=tty, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL) as proc:
            os.close(tty)
            tty = -1
            while True:
                try:
                    data = os.read(main, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            assert proc.wait(120) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        os.close(main)
        if tty != -1:
            os.close(tty)
    out = b"".join(chunks).decode()
    for line in ("get 1/1 over host-fd: 100% (2 of 2 MiB)", "put 1/1 over host-fd: 100% (2 of 2 MiB)",
                 "get 1/1 over ucx-rma: 100% (2 of 2 MiB)", "put 1/1 over ucx-rma: 100% (2 of 2 MiB)"):
        assert f"\r{line}\x1b[K" in out, out
    # The progress line is cleared before each line of the report.
    assert "\r\x1b[Kpath: host-fd" in out and out.rstrip().endswith("demo passed"), out


def test_doctor_reports_capabilities_and_decisions():
    r = subprocess.run([sys.executable, "-m", "gpushare", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "UCX transports:" in r.stdout and "tcp/lo" in r.stdout
    ucx_dir = os.path.realpath(os.path.join(os.path.dirname(__import__("libucx").__file__), "lib"))
    assert f"UCX 1.21.0 (built against 1.21) from {ucx_dir}; libucxx 0.52." in r.stdout
    assert "host memory from gpushare.allocate, peer on same node: host-fd" in r.stdout
    assert "host memory from gpushare.allocate, peer on another node: ucx-rma" in r.stdout
    assert "  host-fd: works" in r.stdout and "  ucx-rma: works" in r.stdout
    r = subprocess.run([sys.executable, "-m", "gpushare", "doctor", "--json"], capture_output=True, text=True,
                       timeout=120)
    import json

    data = json.loads(r.stdout)
    assert {d["path"] for d in data["decisions"]} >= {"host-fd", "ucx-rma"}
    assert r.returncode == 0 and data["ok"] is True
    assert data["live_check"] == {"host-fd": "works", "cma": "works", "ucx-rma": "works"}
    lib = data["capabilities"]["ucx"]["library"]
    assert lib["loaded"] and lib["version"] == "1.21.0" and lib["directory"] == ucx_dir
    assert sorted(os.path.basename(f) for f in lib["files"]) == ["libucm.so.0", "libucp.so.0", "libucs.so.0",
                                                                 "libuct.so.0"]


def test_demo_json_and_progress():
    import io
    import json

    from gpushare._demo import run_demo

    lines: list[str] = []
    progress = io.StringIO()
    assert run_demo(1 << 20, 2, lines.append, as_json=True, progress=progress, progress_after=0.0) == 0
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["passed"] is True and report["size"] == 1 << 20
    assert [r["path"] for r in report["runs"]] == ["host-fd", "ucx-rma"]
    assert all(r["get_ok"] and r["put_ok"] and r["get_gbps"] > 0 for r in report["runs"])
    text = progress.getvalue()
    assert "importer: opened over host-fd" in text and "importer: get 2/2" in text and "importer: put 2/2" in text


def test_demo_progress_line_goes_where_asked_and_is_cleared():
    import io

    from gpushare._demo import run_demo

    lines: list[str] = []
    bar = io.StringIO()
    assert run_demo(3 << 20, 2, lines.append, progress=None, bar=bar) == 0
    text = bar.getvalue()
    for what in ("get 1/2", "get 2/2", "put 1/2", "put 2/2"):
        for path in ("host-fd", "ucx-rma"):
            assert f"\r{what} over {path}: 100% (3 of 3 MiB)\x1b[K" in text, text
    assert text.endswith("\r\x1b[K")  # nothing left on the line
    assert lines[-1] == "demo passed"


def test_cli_version_and_plain_help():
    r = subprocess.run([sys.executable, "-m", "gpushare", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"gpushare {gpushare.__version__}"
    for args in ([], ["demo"], ["doctor"]):
        r = subprocess.run([sys.executable, "-m", "gpushare", *args, "--help"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert "``" not in r.stdout and ":func:" not in r.stdout and ":class:" not in r.stdout, r.stdout
    assert "--json" in r.stdout  # doctor --help


def test_doctor_fails_when_no_path_works_between_two_processes():
    env = dict(os.environ, GPUSHARE_EXCLUDE_PATHS="host-fd,cma,ucx-rma")
    r = subprocess.run([sys.executable, "-m", "gpushare", "doctor"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "host-fd: FAILED: UnsupportedError" in r.stdout
    assert "no path works between two processes on this node" in r.stdout


def test_demo_rejects_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "gpushare", "demo", "--size-mib", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "must be at least 1" in r.stderr
