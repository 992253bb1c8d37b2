"""Peer for the GPU RMA tests: registers CUDA memory allocated by UCX, in a
process that makes no CUDA context current."""

from __future__ import annotations

import hashlib
import os

import numpy as np


def allocate(size: int):
    """cuda.core device memory from the device's pool; cuda.core 1.2 asks
    for the stream that orders the allocation.  cuda.core needs a current
    device: it is made current in a thread of its own, so the caller's
    thread keeps whatever it had (gpushare must not rely on one)."""
    from _procs import in_thread

    def make():
        from cuda.core import Device

        dev = Device(0)
        dev.set_current()
        stream = dev.create_stream()
        buf = dev.allocate(size, stream=stream)
        stream.sync()
        return buf

    return in_thread(make)


def dtoh(address: int, n: int) -> np.ndarray:
    from _gpu_share_peer import dtoh as dtoh_bytes

    return np.frombuffer(dtoh_bytes(address, n), np.uint8)


def htod(address: int, data: np.ndarray) -> None:
    from _gpu_share_peer import htod as htod_bytes

    htod_bytes(address, data)


def setup(size: int) -> dict:
    from gpushare import ucx
    from _gpu_share_peer import current_context

    # A fresh process that made no context current: gpushare.ucx must
    # allocate the CUDA memory all the same.
    before = current_context()
    agent = ucx.Agent()
    mh = agent.create_memory_handle(size, memory_type="cuda")
    key = mh.create_remote_key()
    state = {"agent": agent, "mh": mh, "_handlers": HANDLERS}
    state["_reply"] = {
        "address": agent.address, "key": key.serialize(), "base": mh.base_address,
        "memory_type": mh.memory_type, "pid": os.getpid(), "context_before": before,
        "context_after": current_context(),
    }
    return state


def _digest(state: dict, offset: int, n: int) -> str:
    return hashlib.sha256(dtoh(state["mh"].base_address + offset, n)).hexdigest()


def _fill(state: dict, offset: int, n: int, seed: int) -> str:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    htod(state["mh"].base_address + offset, data)
    return hashlib.sha256(data).hexdigest()


HANDLERS = {"digest": _digest, "fill": _fill}
