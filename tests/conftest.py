from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest


#: Set to 1 (by ``tests/test_gpu_on_standin.py``) in a pytest run whose
#: process loads the CUDA driver stand-in: ``gpu`` tests then take the
#: stand-in for the device, and those marked ``kernels`` skip.  A contract
#: check of the GPU tests themselves, never GPU verification.
STANDIN_GPU_ENV = "GPUSHARE_TEST_STANDIN_GPU"
KERNELS_ON_STANDIN = "needs kernels (CuPy/torch), the stand-in runs none"


def standin_gpu_run() -> bool:
    """Whether this pytest run takes the driver stand-in for the device."""
    return os.environ.get(STANDIN_GPU_ENV) == "1"


@functools.cache
def _cuda_device() -> tuple[str | None, bool]:
    """(why no CUDA device is usable here or None, whether it is the stand-in)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return "cuda-bindings is not installed (pip install cuda-bindings)", False
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # libcuda.so missing
        return f"no CUDA driver: {exc}", False
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no CUDA device: cuInit returned {err.name}", False
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count < 1:
        return "no CUDA device visible", False
    err, name = driver.cuDeviceGetName(256, 0)
    if err == driver.CUresult.CUDA_SUCCESS and b"stand-in" in name:
        return "the CUDA driver is the test stand-in (tests/cudadriver), not a GPU", True
    return None, False


def cuda_device_reason() -> str | None:
    """None when a CUDA device is usable here, else why not (never faked).

    The driver stand-in is refused, except in a run with
    ``GPUSHARE_TEST_STANDIN_GPU=1`` (see :data:`STANDIN_GPU_ENV`), where the
    ``gpu`` tests that need no kernels run against it as a contract check.
    """
    reason, standin = _cuda_device()
    if standin and standin_gpu_run():
        return None
    return reason


def kernels_reason() -> str | None:
    """None when CuPy/torch kernels can run on the device, else why not
    (only the stand-in, which has a device but runs no kernel, says so here)."""
    reason, standin = _cuda_device()
    if standin:
        return KERNELS_ON_STANDIN
    return reason


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
    out.pop(STANDIN_GPU_ENV, None)
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
def standin_peers(standin_lib: str):
    """Start ``_procs.Child`` peers that load the stand-in:
    ``start(setup, **env)`` with a peer module's ``setup`` and
    :func:`standin_children`'s ``env``; each is closed after the test."""
    from _procs import Child

    children: list[Child] = []

    def start(setup: Callable[[], dict], **env: str | None) -> Child:
        with standin_children(standin_lib, **env):
            child = Child(setup, timeout=120)
        children.append(child)
        return child

    yield start
    for child in children:
        child.close()


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kernels: a gpu test that runs CuPy or torch kernels (the CUDA runtime); skipped against the "
        "driver stand-in, which runs none",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords:
            reason = cuda_device_reason()
            if reason is None and "kernels" in item.keywords:
                reason = kernels_reason()
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


@pytest.fixture(scope="module")
def bundle_peer() -> Iterator:
    """Another process that opens bundles it is sent and reports what it
    sees (``tests/_bundle_peer.py``), one per test module."""
    from _procs import Child
    import _bundle_peer

    child = Child(_bundle_peer.setup, timeout=240)
    yield child
    child.close()


@pytest.fixture(scope="module")
def _gpu_peers() -> Iterator[dict]:
    """The module's gpu peer, once started; closed with the module."""
    held: dict = {}
    yield held
    if "child" in held:
        held["child"].close()


@pytest.fixture
def gpu_peer(_gpu_peers: dict) -> Any:
    """Another process that opens shares and moves device bytes
    (``tests/_gpu_share_peer.py``), one per test module.  One that died in an
    earlier test (a kernel that faulted, a crash: that test reported its
    signal and stderr) is replaced, so the tests after it run on a live peer."""
    from _procs import Child
    import _gpu_share_peer

    child = _gpu_peers.get("child")
    if child is None or not child.proc.is_alive():
        if child is not None:
            child.close()
        child = _gpu_peers["child"] = Child(_gpu_share_peer.setup, timeout=120)
    return child


@pytest.fixture
def fresh_gpu_peer(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Start peers of their own (``tests/_gpu_share_peer.py``), for tests that
    end them or spoil their state: ``start(**env)`` adds ``env`` to the new
    process's environment.  Each is closed after the test."""
    from _procs import Child
    import _gpu_share_peer

    children: list = []

    def start(**env: str):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            child = Child(_gpu_share_peer.setup, timeout=120)
        children.append(child)
        return child

    yield start
    for child in children:
        child.close()
