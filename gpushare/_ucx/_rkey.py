"""Check a peer's packed UCX remote key before UCX reads it.

``ucp_ep_rkey_unpack`` reads a packed remote key with no length
(``src/ucp/core/ucp_rkey.c:1068``), and each transport's component then
reads its own key at the size of its own struct, whatever the key's size
byte says (ucp_rkey.c:986-1019).  Shared-memory keys (posix, sysv) name
files, fds and segments that the importer opens and maps with its own
rights (``mm_posix.c:406-450, 718-745``, ``mm_sysv.c:55-69``); cuda_ipc
keys name IPC handles.  tcp, cuda_copy, self and cma keys carry no key
bytes at all: their packed key is the memory-domain map, the memory type, an
empty key per memory domain and the memory's system device (unknown for host
memory; for CUDA memory the GPU's, with its distances).  A memory domain's
key bytes are accepted only where the peer's worker address (checked first,
on the endpoint's connect) says which transports that domain serves:

- InfiniBand/RoCE domains: the key sizes UCX 1.21's IB domains pack (``_ib``);
- from a peer proven to be on this node (``_local.LocalPeer``): a ``posix``
  key (24 bytes: segment id, address, length) of a segment the peer shares
  through ``/proc/<pid>/fd``, no longer than that file, covering the key's
  region; a ``sysv`` key (12 bytes: segment id, address) of a segment the
  peer created, covering the region; a ``cuda_ipc`` key (192 bytes) with a
  legacy IPC handle, the peer's pid, a base and length covering the region,
  and a length no larger than the allocation the handle opens here;
- nothing else.

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

import os
import threading
import weakref
from typing import Any


from .._cuda import _driver
from .._errors import InvalidInputError, UnsupportedError
from . import _ib
from ._address import PeerAddress, check_worker_address
from ._common import KEY_MAGIC, MAX_KEY, unpack
from ._local import LocalPeer, check_posix_seg, check_sysv_seg, own_peer, sysv_segment_size

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


_POSIX_KEY, _SYSV_KEY, _CUDA_IPC_KEY = 24, 12, 192
_CUDA_IPC_LEGACY = 1  # uct_cuda_ipc_key_handle_t (cuda_ipc_md.h)


def _covers(what: str, start: int, length: int, region: tuple[int, int] | None) -> None:
    if length <= 0 or start + length > 1 << 64:
        raise InvalidInputError(f"{what} covers {length} bytes at {start:#x}")
    if region is not None and not (start <= region[0] and region[0] + region[1] <= start + length):
        raise InvalidInputError(f"{what} covers {length} bytes at {start:#x}, not the key's region of {region[1]} "
                                f"bytes at {region[0]:#x}")


def _posix_key(key: bytes, peer: LocalPeer, region: tuple[int, int] | None) -> None:
    what = "packed remote key's posix key"
    if len(key) != _POSIX_KEY:
        raise InvalidInputError(f"{what} is {len(key)} bytes; UCX 1.21 packs {_POSIX_KEY} for a segment shared "
                                "through /proc/<pid>/fd")
    seg_id, address, length = (int.from_bytes(key[i:i + 8], "little") for i in (0, 8, 16))
    check_posix_seg(seg_id, peer, what)
    _covers(what, address, length, region)
    mmid = seg_id & ((1 << 60) - 1)
    path = f"/proc/{peer.pid}/fd/{mmid >> 30}"
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise InvalidInputError(f"{what} names {path}, which this process cannot open ({exc.strerror})") from None
    if length > size:
        raise InvalidInputError(f"{what} maps {length} bytes of {path}, which holds {size}")


def _sysv_key(key: bytes, peer: LocalPeer, region: tuple[int, int] | None) -> None:
    what = "packed remote key's sysv key"
    if len(key) != _SYSV_KEY:
        raise InvalidInputError(f"{what} is {len(key)} bytes; UCX 1.21 packs {_SYSV_KEY}")
    shmid, address = int.from_bytes(key[:4], "little"), int.from_bytes(key[4:], "little")
    if shmid >> 31:
        raise InvalidInputError(f"{what} names System V segment {shmid}, which is out of range")
    check_sysv_seg(shmid, peer, what)
    _covers(what, address, sysv_segment_size(shmid), region)


def _cuda_ipc_key(key: bytes, peer: LocalPeer, region: tuple[int, int] | None) -> None:
    what = "packed remote key's cuda_ipc key"
    if len(key) != _CUDA_IPC_KEY:
        raise InvalidInputError(f"{what} is {len(key)} bytes; UCX 1.21 packs {_CUDA_IPC_KEY} in this pid namespace")
    kind = int.from_bytes(key[:4], "little")
    if kind != _CUDA_IPC_LEGACY:
        raise InvalidInputError(f"{what} carries a handle of type {kind}; only legacy IPC handles ({_CUDA_IPC_LEGACY}) "
                                "are accepted, whose allocation can be measured here")
    pid = int.from_bytes(key[152:156], "little")
    if pid != peer.pid:
        raise InvalidInputError(f"{what} is of process {pid}, not of the peer (pid {peer.pid})")
    base, length = int.from_bytes(key[160:168], "little"), int.from_bytes(key[168:176], "little")
    _covers(what, base, length, region)
    try:
        size = _driver.ipc_allocation_size(key[4:68], key[176:192])
    except Exception as exc:  # noqa: BLE001 - any failure to measure it refuses the key
        raise InvalidInputError(f"{what}'s IPC handle cannot be opened here to measure it ({exc})") from None
    if length > size:
        raise InvalidInputError(f"{what} says its allocation is {length} bytes; the handle opens {size}")


_ONE_NODE_KEYS = {"posix": _posix_key, "sysv": _sysv_key, "cuda_ipc": _cuda_ipc_key}
_KEYED = frozenset(_ONE_NODE_KEYS) | frozenset(_ib.IB_TRANSPORTS)


def _packs_keys(md: int, peer: PeerAddress | None) -> bool:
    return peer is not None and bool(peer.md_transports.get(md, frozenset()) & _KEYED)


def _md_key(md: int, key: bytes, peer: PeerAddress | None, region: tuple[int, int] | None) -> None:
    names = peer.md_transports.get(md, frozenset()) if peer is not None else frozenset()
    if names & set(_ib.IB_TRANSPORTS):
        _ib.check_ib_md_key(key)
        return
    one_node = sorted(names & set(_ONE_NODE_KEYS))
    if one_node:
        if peer is None or peer.local_peer is None:
            raise InvalidInputError(
                f"packed remote key carries a {one_node[0]} key for memory domain {md}, which names memory of this "
                "host: it is accepted only from a peer the kernel proved to be on this node "
                "(Agent.connect(address, local_peer=...))")
        peer.local_peer.check_alive()
        _ONE_NODE_KEYS[one_node[0]](key, peer.local_peer, region)
        return
    raise InvalidInputError(
        f"packed remote key carries {len(key)} key bytes for memory domain {md}, "
        + (f"whose transports ({', '.join(sorted(names))}) pack none" if names else
           "which the peer's worker address does not name with a transport that packs any")
        + ": a shared-memory, cuda_ipc or InfiniBand key is accepted only from the peer whose address names it")


def check_packed_key(packed: bytes, memory_type: int, peer: PeerAddress | None = None,
                     region: tuple[int, int] | None = None) -> None:
    """Raise :class:`InvalidInputError` unless ``packed`` is a UCX 1.21
    packed remote key of the memory type that gpushare's envelope code
    ``memory_type`` (0 host, 1 cuda) names, whose memory domains' key bytes
    are those ``peer``'s worker address admits (none without it), covering
    ``region`` (base, size) where given."""
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
        size = packed[pos]
        if pos + 1 + size > len(packed):
            raise InvalidInputError(f"packed remote key ends inside memory domain {md}'s {size}-byte key")
        # A domain whose transports pack keys is checked even with a size of 0: UCX reads its key
        # at the size of its own struct, whatever the size byte says.
        if size or _packs_keys(md, peer):
            _md_key(md, packed[pos + 1:pos + 1 + size], peer, region)
        pos += 1 + size
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
    :func:`check_packed_key` as a peer's would (against its own address, as a
    proven local peer); else why not.  Checked once per agent."""
    with _lock:
        problem = _checked.get(agent)
    if problem is not None:
        return problem
    raw = agent._native.address()
    with agent.create_memory_handle(1) as handle:
        mtype, serialized = unpack(handle.create_remote_key().serialize(), KEY_MAGIC, "remote key", MAX_KEY)
        try:
            own = check_worker_address(raw, raw, own_peer())
            check_packed_key(packed_key(serialized), mtype, own)
            problem = ""
        except InvalidInputError as exc:
            problem = str(exc)
    with _lock:
        _checked[agent] = problem
    return problem


def check_remote_key(serialized: bytes, memory_type: int, agent: Any, peer: PeerAddress | None = None,
                     region: tuple[int, int] | None = None) -> None:
    """Check a peer's serialized key (its libucxx envelope already checked)
    before ``agent``'s endpoint to ``peer`` (its checked address) unpacks it.

    Raises
    ------
    InvalidInputError
        If the packed key is not one gpushare accepts (see the module notes).
    UnsupportedError
        If ``agent``'s own keys are not: its transports make keys that
        gpushare could not check from a peer.
    """
    problem = _own_key_problem(agent)
    if problem:
        raise UnsupportedError(
            f"this agent's own remote keys are ones gpushare cannot check from a peer ({problem}); its transports "
            "(UCX_TLS, or Agent(transports=...)) make keys of a kind gpushare does not know"
        )
    check_packed_key(packed_key(serialized), memory_type, peer, region)
