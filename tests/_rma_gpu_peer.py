"""Peer for the GPU RMA tests: registers CUDA memory allocated by UCX."""

from __future__ import annotations

import hashlib
import os

import numpy as np


def _current_device():
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    return dev


def allocate(size: int):
    """cuda.core device memory from the device's pool; cuda.core 1.2 asks
    for the stream that orders the allocation."""
    dev = _current_device()
    stream = dev.create_stream()
    buf = dev.allocate(size, stream=stream)
    stream.sync()
    return buf


def dtoh(address: int, n: int) -> np.ndarray:
    from cuda.bindings import driver

    out = np.empty(n, np.uint8)
    (err,) = driver.cuMemcpyDtoH(out.ctypes.data, address, n)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyDtoH failed: {err.name}")
    return out


def htod(address: int, data: np.ndarray) -> None:
    from cuda.bindings import driver

    (err,) = driver.cuMemcpyHtoD(address, data.ctypes.data, data.nbytes)
    if err == driver.CUresult.CUDA_SUCCESS:
        # A pageable source is only staged when the call returns: the bytes
        # are in device memory (for UCX to read) after a synchronisation.
        (err,) = driver.cuCtxSynchronize()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyHtoD failed: {err.name}")


def setup(size: int) -> dict:
    from gpushare import ucx

    _current_device()
    agent = ucx.Agent()
    mh = agent.create_memory_handle(size, memory_type="cuda")
    key = mh.create_remote_key()
    state = {"agent": agent, "mh": mh, "_handlers": HANDLERS}
    state["_reply"] = {
        "address": agent.address, "key": key.serialize(), "base": mh.base_address,
        "memory_type": mh.memory_type, "pid": os.getpid(),
    }
    return state


def _digest(state: dict, offset: int, n: int) -> str:
    return hashlib.sha256(dtoh(state["mh"].base_address + offset, n)).hexdigest()


def _fill(state: dict, offset: int, n: int, seed: int) -> str:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    htod(state["mh"].base_address + offset, data)
    return hashlib.sha256(data).hexdigest()


HANDLERS = {"digest": _digest, "fill": _fill}
