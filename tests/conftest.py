from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest


@functools.cache
def cuda_device_reason() -> str | None:
    """None when a CUDA device is usable here, else why not (never faked)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # libcuda.so missing
        return f"no CUDA driver: {exc}"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no CUDA device: cuInit returned {err.name}"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count < 1:
        return "no CUDA device visible"
    err, name = driver.cuDeviceGetName(256, 0)
    if err == driver.CUresult.CUDA_SUCCESS and b"stand-in" in name:
        return "the CUDA driver is the test stand-in (tests/cudadriver), not a GPU"
    return None


STANDIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cudadriver")


@pytest.fixture(scope="session")
def standin_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory holding the CUDA driver stand-in ``libcuda.so.1``, built once.

    Skips when there is no C compiler, except under CI (env ``CI`` set),
    where a missing compiler fails the run.
    """
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        reason = f"no C compiler ({cc!r}) to build the CUDA driver stand-in"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("cudadriver")
    r = subprocess.run(
        [os.path.join(STANDIN_DIR, "build.sh"), str(out)], capture_output=True, text=True, timeout=300
    )
    if r.returncode != 0:
        pytest.fail(f"building the CUDA driver stand-in failed:\n{r.stdout}\n{r.stderr}")
    return os.path.dirname(r.stdout.strip().splitlines()[-1])


def standin_env(libdir: str, **env: str | None) -> dict[str, str]:
    """The environment of a process that loads the stand-in from ``libdir``.

    CUDA_VISIBLE_DEVICES and the stand-in's knobs are cleared unless given;
    a value of None removes a variable.
    """
    out = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_STANDIN_")}
    out.pop("CUDA_VISIBLE_DEVICES", None)
    out["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    for k, v in env.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@contextlib.contextmanager
def standin_children(libdir: str, **env: str | None) -> Iterator[None]:
    """Processes started inside (``_procs.Child``, multiprocessing spawn,
    subprocess) load the stand-in from ``libdir``, with ``env`` applied.

    Only children see it: the dynamic loader reads LD_LIBRARY_PATH when a
    process starts, so this process keeps its own driver (or none).
    """
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(standin_env(libdir, **env))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def run_standin(standin_lib: str):
    """Run Python source in a subprocess against the stand-in; returns its stdout.

    ``run(code, timeout=60, **env)`` fails the test with the child's output
    when it exits non-zero.  The pytest process itself never loads the stand-in.
    """

    def run(code: str, timeout: float = 60, **env: str | None) -> str:
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=standin_env(standin_lib, **env),
        )
        if r.returncode != 0:
            pytest.fail(f"child exited {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
        return r.stdout

    return run


@functools.cache
def netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    name = f"gs-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords:
            reason = cuda_device_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        if "netns" in item.keywords:
            reason = netns_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def peer() -> Iterator:
    """Another process that opens shares it is sent (``tests/_share_peer.py``),
    one per test module (modules that need another kind define their own)."""
    from _procs import Child
    import _share_peer

    child = Child(_share_peer.setup)
    yield child
    child.close()
