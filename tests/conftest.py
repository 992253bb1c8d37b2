from __future__ import annotations

import functools
import os
import shutil
import subprocess

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
    return None


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
