"""Peers on this node, as the kernel proves them, and what their UCX addresses and keys may name.

UCX's one-node transports take a peer's word for what to open: a ``cma`` interface address is
the pid whose memory ``process_vm_readv``/``writev`` then read and write; a ``posix`` address
or key names ``/proc/<pid>/fd/<fd>``, a ``sysv`` one a segment id, and UCX maps them; a
``cuda_ipc`` key carries an IPC handle, the pid it came from, and a base and length that UCX
trusts.  Each is opened with the importing process's own rights, so a forged address or key
would reach any process or segment of the same user.  gpushare therefore accepts them only from
a :class:`LocalPeer`: a process whose pid and user id the kernel reported for the other end of
a Unix socket (``SO_PEERCRED``; it cannot be forged), held by a pidfd so that a pid reused
after the peer's exit is noticed, and running as this user.  Then what the address and keys
name must be that peer's own:

- ``cma`` and ``cuda_ipc`` interface addresses: the peer's pid, in this pid namespace;
- ``posix``: segments shared through ``/proc/<pid>/fd/<fd>`` (UCX's default) of the peer's pid,
  in this pid namespace; named files (``UCX_POSIX_USE_PROC_LINK=n``) are refused;
- ``sysv``: segments the peer created (``/proc/sysvipc/shm``: creator pid) and this user owns;
- the device address of each (the host's system id): the one this process packs.

A ``cuda_ipc`` key's own pid must be the peer's too; its handle is checked where the key is
(``_rkey``).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

from .._errors import InvalidInputError

__all__ = ["LocalPeer", "ONE_NODE", "check_local_iface", "check_posix_seg", "check_sysv_seg", "own_peer",
           "sysv_segment_size"]

#: UCX 1.21's one-node transports whose addresses name processes or segments of this host.
ONE_NODE = ("posix", "sysv", "cma", "cuda_ipc")

_SO_PEERPIDFD = 77  # Linux 6.5: a pidfd of the peer as it was at connect()
# posix segment ids (mm_posix.c): flags in the top bits, then fd << 30 | pid in procfs mode.
_POSIX_PROCFS, _POSIX_SHM_OPEN, _POSIX_HUGETLB, _POSIX_PID_NS = 1 << 63, 1 << 62, 1 << 61, 1 << 60
_POSIX_FLAGS = _POSIX_PROCFS | _POSIX_SHM_OPEN | _POSIX_HUGETLB | _POSIX_PID_NS
_PROCFS_BITS = 30
# Interface addresses that are a pid_t (cma_iface.c, cuda_ipc_iface.c); cma's sets bit 31 when a
# pid namespace id follows.
_PID_ADDRESSED = frozenset({"cma", "cuda_ipc"})
_PID_NS_BIT = {"cma": 1 << 31}


@dataclass(frozen=True, eq=False)
class LocalPeer:
    """A process on this node, proven by the kernel: the other end of a Unix socket.

    Made with :meth:`from_socket`; pass it to :meth:`gpushare.ucx.Agent.connect` as
    ``local_peer=`` so that the peer's one-node transports (shared memory, CMA, cuda_ipc) may be
    used.  It holds a pidfd of the peer: once that process exits, its addresses and keys are
    refused even if another process gets its pid."""

    pid: int
    uid: int
    _pidfd: int = field(repr=False)

    def __post_init__(self) -> None:
        weakref.finalize(self, os.close, self._pidfd)

    def __reduce__(self) -> Any:
        raise TypeError("a LocalPeer holds a pidfd of this process and proves nothing elsewhere: make one in each "
                        "process with LocalPeer.from_socket")

    @classmethod
    def from_socket(cls, sock: socket.socket) -> LocalPeer:
        """The process at the other end of ``sock``, a connected ``AF_UNIX`` socket.

        Raises
        ------
        InvalidInputError
            If ``sock`` is not a connected Unix socket, or the peer runs as another user.
        """
        if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
            raise InvalidInputError(f"a local peer is proven by a connected AF_UNIX socket, not {sock!r}")
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError as exc:
            raise InvalidInputError(f"the socket reports no peer credentials ({exc}): is it connected?") from exc
        pid, uid, _ = struct.unpack("3i", creds)
        if pid <= 0:
            raise InvalidInputError("the socket has no peer process (it is not connected, or the peer is in "
                                    "another pid namespace)")
        if uid != os.geteuid():
            raise InvalidInputError(f"the socket's peer (pid {pid}) runs as user {uid}, not as this process's "
                                    f"user {os.geteuid()}: its one-node UCX transports are refused")
        pidfd = _peer_pidfd(sock, pid)
        return cls(pid, uid, pidfd)

    def alive(self) -> bool:
        """Whether the process is still running (its pidfd is not yet readable)."""
        return not select.select([self._pidfd], [], [], 0)[0]

    def check_alive(self) -> None:
        if not self.alive():
            raise InvalidInputError(f"the local peer (pid {self.pid}) has exited: its addresses and keys could "
                                    "now name another process")


def _peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd of the socket's peer: from the kernel where it gives one for the socket, else
    opened by pid, then checked against the credentials once more (a pid reused in between
    would have to belong to a process that is now this socket's peer)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4)
        return struct.unpack("i", raw)[0]
    except OSError:
        pass
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        raise InvalidInputError(f"the socket's peer (pid {pid}) has exited ({exc})") from exc
    return pidfd


def own_peer() -> LocalPeer:
    """This process as a :class:`LocalPeer` (for checking its own addresses and keys)."""
    return LocalPeer(os.getpid(), os.geteuid(), os.pidfd_open(os.getpid()))


def check_posix_seg(seg_id: int, peer: LocalPeer, what: str) -> None:
    """A posix shared-memory segment id must be one shared through ``/proc/<peer pid>/fd``."""
    if seg_id & _POSIX_PID_NS:
        raise InvalidInputError(f"{what} names a posix segment of another pid namespace")
    if not seg_id & _POSIX_PROCFS:
        raise InvalidInputError(f"{what} names a posix segment by file name (UCX_POSIX_USE_PROC_LINK=n), which "
                                "could be any process's: only segments shared through /proc/<pid>/fd are accepted")
    mmid = seg_id & ~_POSIX_FLAGS
    pid = mmid & ((1 << _PROCFS_BITS) - 1)
    if pid != peer.pid or mmid >> (2 * _PROCFS_BITS):
        raise InvalidInputError(f"{what} names a posix segment of process {pid}, not of the peer (pid {peer.pid})")


def _sysv_segments() -> dict[int, tuple[int, int, int]]:
    """shmid -> (creator pid, owner uid, size), from /proc/sysvipc/shm."""
    out: dict[int, tuple[int, int, int]] = {}
    try:
        with open("/proc/sysvipc/shm") as f:
            header = f.readline().split()
            col = {name: i for i, name in enumerate(header)}
            for line in f:
                v = line.split()
                out[int(v[col["shmid"]])] = (int(v[col["cpid"]]), int(v[col["uid"]]), int(v[col["size"]]))
    except (OSError, KeyError, ValueError, IndexError):
        return {}
    return out


def sysv_segment_size(shmid: int) -> int:
    """The size of System V segment ``shmid`` (0 when there is none)."""
    return _sysv_segments().get(shmid, (0, 0, 0))[2]


def check_sysv_seg(shmid: int, peer: LocalPeer, what: str) -> None:
    """A System V segment id must name a segment the peer created and this user owns."""
    seg = _sysv_segments().get(shmid)
    if seg is None:
        raise InvalidInputError(f"{what} names System V segment {shmid}, which does not exist")
    cpid, uid, _ = seg
    if cpid != peer.pid or uid != os.geteuid():
        raise InvalidInputError(f"{what} names System V segment {shmid} of process {cpid} (user {uid}), not one "
                                f"the peer (pid {peer.pid}) created as this user")


def check_local_iface(name: str, iface: bytes, peer: LocalPeer | None) -> None:
    """The interface address of one-node transport ``name`` must name the proven ``peer``."""
    what = f"UCX worker address's {name} interface address"
    if peer is None:
        raise InvalidInputError(
            f"UCX worker address names a {name} transport, whose addresses name files, segments or processes of "
            "this host: it is accepted only from a peer on this node that the kernel proves "
            "(Agent.connect(address, local_peer=ucx.LocalPeer.from_socket(unix_socket)))")
    peer.check_alive()
    if name in _PID_ADDRESSED:
        if len(iface) != 4:
            raise InvalidInputError(f"{what} is {len(iface)} bytes; UCX 1.21 packs a 4-byte pid in this pid namespace")
        pid = int.from_bytes(iface, "little")
        if pid & _PID_NS_BIT.get(name, 0):
            raise InvalidInputError(f"{what} names a process of another pid namespace")
        if pid != peer.pid:
            raise InvalidInputError(f"{what} names process {pid}, not the peer (pid {peer.pid})")
    elif name == "posix":
        if len(iface) != 8:
            raise InvalidInputError(f"{what} is {len(iface)} bytes; UCX 1.21 packs an 8-byte segment id")
        check_posix_seg(int.from_bytes(iface, "little"), peer, what)
    elif name == "sysv":
        if len(iface) != 8:
            raise InvalidInputError(f"{what} is {len(iface)} bytes; UCX 1.21 packs an 8-byte segment id")
        seg = int.from_bytes(iface, "little")
        if seg >> 31:
            raise InvalidInputError(f"{what} names System V segment {seg}, which is out of range")
        check_sysv_seg(seg, peer, what)
    else:  # pragma: no cover - callers pass ONE_NODE names
        raise InvalidInputError(f"{name} is not a one-node transport")
