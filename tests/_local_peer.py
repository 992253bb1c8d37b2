"""The other process of tests/test_ucx_local.py: an Agent on UCX's one-node transports, proven
to the test's process through a Unix socket (the test's abstract-namespace listener)."""

from __future__ import annotations

import os
import socket
from typing import Any

TRANSPORTS = "posix,sysv,cma,tcp,self"
#: UCX 1.21 puts its shared-memory and cma lanes only on endpoints without peer-failure handling.
AGENT = {"transports": TRANSPORTS, "error_handling": False}


def setup(listener: str, allocate: bool = True) -> dict:
    from gpushare import ucx

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(listener)
    agent = ucx.Agent(**AGENT)
    # allocate: UCX allocates the memory (shared memory: a posix or sysv key); else a buffer of
    # ours is registered (reached over cma, which packs no key bytes).
    mh = agent.create_memory_handle(1 << 20) if allocate else agent.create_memory_handle(
        1 << 20, bytearray(1 << 20))
    mh.buffer[:4] = b"peer"
    state = {"agent": agent, "mh": mh, "sock": sock, "_handlers": HANDLERS}
    state["_reply"] = {"address": agent.address, "key": mh.create_remote_key().serialize(), "pid": os.getpid()}
    return state


def _connect(state: dict, address: bytes, key: bytes, proven: bool) -> dict:
    from gpushare import ucx

    peer = ucx.LocalPeer.from_socket(state["sock"]) if proven else None
    ep = state["agent"].connect(address, local_peer=peer)
    rk = ep.unpack_remote_key(key)
    out = bytearray(4)
    ep.mem_get(out, rk.base_address, rk).wait(30)
    ep.mem_put(b"back", rk.base_address + 4, rk).wait(30)
    ep.flush().wait(30)
    state["ep"], state["rk"] = ep, rk
    return {"got": bytes(out), "lanes": ep.transport_info()}


def _read(state: dict, offset: int, n: int) -> bytes:
    return bytes(state["mh"].buffer[offset:offset + n])


def _memfd(state: dict, size: int) -> int:
    """A memfd of ``size`` bytes held open here: its fd number (what a posix key names)."""
    fd = os.memfd_create("gpushare-test")
    os.ftruncate(fd, size)
    state.setdefault("fds", []).append(fd)
    return fd


def _sysv(state: dict, size: int) -> int:
    """A System V segment this process creates (removed when it exits): its id."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(0, size, 0o600 | 0o1000)  # IPC_PRIVATE, IPC_CREAT
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget failed")
    address = libc.shmat(shmid, None, 0)  # attached, then marked for removal: gone with this process
    libc.shmctl(shmid, 0, None)  # IPC_RMID
    state.setdefault("segments", []).append(address)
    return shmid


HANDLERS: dict[str, Any] = {"connect": _connect, "read": _read, "memfd": _memfd, "sysv": _sysv}
