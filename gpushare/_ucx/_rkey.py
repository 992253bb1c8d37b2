"""Check a peer's packed UCX remote key before UCX reads it.

``ucp_ep_rkey_unpack`` reads a packed remote key with no length
(``src/ucp/core/ucp_rkey.c:1068``), and each transport's component then
reads its own key at the size of its own struct, whatever the key's size
byte says (ucp_rkey.c:986-1019).  Shared-memory keys (posix, sysv) name
files, fds and segments that the importer opens and maps with its own
rights (``mm_posix.c:406-450, 718-745``, ``mm_sysv.c:55-69``); cuda_ipc
keys name IPC handles.  gpushare's transports (tcp, cuda_copy, self; also
cma) carry no key bytes at all: their packed key is the memory-domain map,
the memory type, an empty key per memory domain and the memory's system
device (unknown for host memory; for CUDA memory the GPU's, with its
distances).  So that is the only key accepted from a peer.

The key arrives as libucxx serializes it (``ucxx::RemoteKey::serialize``):
``size_t hash | size_t packed_size | packed | u64 base | u64 size``; the
native module checks that envelope (its sizes and hash), this module the
packed key inside it, in full, as UCX 1.21 packs it
(``ucp_rkey_pack_memh``, ucp_rkey.c:187-276)::

    u64 md_map | u8 mem_type | per set bit of md_map: u8 tl_size (= 0)
    | when md_map != 0: u8 sys_dev (0xFF unknown: host memory; else the
      device, < 64, with bit 7 "flush needed", then per system device
      {u8 device < 64, u8 latency, u8 bandwidth} and a 0xFF terminator)

and nothing after it (ucp_rkey.c:241-270; UCX reads the distances up to
the terminator, however far it is: ucp_rkey.c:816-832, 894-900).

Once per agent, before the first peer key, the agent packs a key of its
own and checks it the same way: an agent whose own transports make keys
this check refuses (``UCX_TLS`` with shared memory or cuda_ipc) refuses
peer keys with an error that says so, rather than forwarding them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .._errors import InvalidInputError, UnsupportedError
from ._common import KEY_MAGIC, MAX_KEY, unpack

__all__ = ["check_packed_key", "check_remote_key", "packed_key"]

_SIZE_T = 8
# ucs_memory_type_t: host, cuda, cuda managed; by the memory type of gpushare's envelope.
_HOST, _CUDA, _CUDA_MANAGED = 0, 1, 2
_MEMORY_TYPES = {0: (_HOST,), 1: (_CUDA, _CUDA_MANAGED), 2: (_CUDA, _CUDA_MANAGED)}
_UNKNOWN_SYS_DEVICE = 0xFF
_FLUSH_BIT, _MAX_SYS_DEVICES, _DISTANCE = 0x80, 64, 3  # ucp_rkey.h:80; a u64 map of devices; 3 bytes each


def packed_key(serialized: bytes) -> bytes:
    """The packed UCX key inside libucxx's serialized remote key."""
    if len(serialized) < 4 * _SIZE_T:
        raise InvalidInputError(f"serialized remote key is {len(serialized)} bytes; at least {4 * _SIZE_T}")
    size = int.from_bytes(serialized[_SIZE_T:2 * _SIZE_T], "little")
    if size != len(serialized) - 4 * _SIZE_T:
        raise InvalidInputError(f"serialized remote key says {size} packed bytes; "
                                f"it holds {len(serialized) - 4 * _SIZE_T}")
    return serialized[2 * _SIZE_T:2 * _SIZE_T + size]


def check_packed_key(packed: bytes, memory_type: int) -> None:
    """Raise :class:`InvalidInputError` unless ``packed`` is a UCX 1.21
    packed remote key with no transport key bytes, of the memory type that
    gpushare's envelope code ``memory_type`` (0 host, 1 cuda) names."""
    if len(packed) < 9:
        raise InvalidInputError(f"packed remote key is {len(packed)} bytes; at least 9 (memory domains, type)")
    md_map = int.from_bytes(packed[:8], "little")
    mem_type = packed[8]
    if mem_type not in _MEMORY_TYPES.get(memory_type, ()):
        raise InvalidInputError(f"packed remote key is of UCX memory type {mem_type}; the key says "
                                f"{'host' if memory_type == 0 else 'cuda'} memory")
    pos = 9
    for md in range(64):
        if not md_map >> md & 1:
            continue
        if pos >= len(packed):
            raise InvalidInputError(f"packed remote key ends before memory domain {md}'s key")
        if packed[pos]:
            raise InvalidInputError(
                f"packed remote key carries {packed[pos]} key bytes for memory domain {md}: a shared-memory or "
                "cuda_ipc key, which gpushare does not accept from a peer (only tcp, cuda_copy and self keys, "
                "which have none)")
        pos += 1
    if md_map:
        if pos >= len(packed):
            raise InvalidInputError("packed remote key ends before its system device")
        sys_dev = packed[pos]
        pos += 1
        if sys_dev != _UNKNOWN_SYS_DEVICE:
            # CUDA memory: the device (bit 7: "flush needed"), then the distance to each system
            # device {u8 device, u8 latency, u8 bandwidth} and an unknown device as terminator;
            # UCX reads distances up to that terminator, however far it is.
            if sys_dev & ~_FLUSH_BIT >= _MAX_SYS_DEVICES:
                raise InvalidInputError(f"packed remote key names system device {sys_dev & ~_FLUSH_BIT}")
            while True:
                if pos >= len(packed):
                    raise InvalidInputError("packed remote key ends before the end of its system distances")
                if packed[pos] == _UNKNOWN_SYS_DEVICE:
                    pos += 1
                    break
                if packed[pos] >= _MAX_SYS_DEVICES or pos + _DISTANCE > len(packed):
                    raise InvalidInputError(f"packed remote key has a distance to system device {packed[pos]} "
                                            f"in {len(packed) - pos} bytes")
                pos += _DISTANCE
    if pos != len(packed):
        raise InvalidInputError(f"packed remote key has {len(packed) - pos} bytes after its end")


_checked: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _own_key_problem(agent: Any) -> str:
    """'' when a key ``agent`` packs for its own host memory passes
    :func:`check_packed_key`; else why not.  Checked once per agent."""
    with _lock:
        problem = _checked.get(agent)
    if problem is not None:
        return problem
    with agent.create_memory_handle(1) as handle:
        mtype, serialized = unpack(handle.create_remote_key().serialize(), KEY_MAGIC, "remote key", MAX_KEY)
    try:
        check_packed_key(packed_key(serialized), mtype)
        problem = ""
    except InvalidInputError as exc:
        problem = str(exc)
    with _lock:
        _checked[agent] = problem
    return problem


def check_remote_key(serialized: bytes, memory_type: int, agent: Any) -> None:
    """Check a peer's serialized key (its libucxx envelope already checked)
    before ``agent``'s endpoint unpacks it.

    Raises
    ------
    InvalidInputError
        If the packed key is not one gpushare accepts (see the module notes).
    UnsupportedError
        If ``agent``'s own keys are not: its transports make keys that
        gpushare refuses from peers.
    """
    problem = _own_key_problem(agent)
    if problem:
        raise UnsupportedError(
            "this agent's own remote keys are ones gpushare refuses from a peer "
            f"({problem}); its transports (UCX_TLS, or Agent(transports=...)) include shared memory or cuda_ipc. "
            "Remote keys are accepted only over tcp, cuda_copy and self, e.g. UCX_TLS=tcp,cuda_copy"
        )
    check_packed_key(packed_key(serialized), memory_type)
