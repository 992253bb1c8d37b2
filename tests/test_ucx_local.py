"""UCX's one-node transports between two agents: accepted from a peer the kernel proves, naming
only that peer's own processes and segments; refused otherwise."""

from __future__ import annotations

import gc
import os
import pickle
import socket
import uuid

import pytest

import gpushare as gs
from gpushare import ucx
from gpushare._ucx import _address, _common

from _procs import Child
import _local_peer


@pytest.fixture(autouse=True)
def _collected():
    """The pidfds of this module's LocalPeers are closed by their finalizers: collect them here,
    not during a later test that counts this process's fds."""
    yield
    gc.collect()


@pytest.fixture
def listener():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0gpushare-test-{uuid.uuid4().hex}"
    sock.bind(name)
    sock.listen(4)
    yield sock, name
    sock.close()


@pytest.fixture
def pair(listener):
    """(our agent and memory, the child, the accepted socket to it)."""
    sock, name = listener
    child = Child(_local_peer.setup, name)
    conn, _ = sock.accept()
    agent = ucx.Agent(**_local_peer.AGENT)
    mh = agent.create_memory_handle(1 << 20)
    mh.buffer[:4] = b"mine"
    yield agent, mh, child, conn
    conn.close()
    assert child.close() == 0
    agent.close()


def _raw(address: bytes) -> bytes:
    return _common.unpack(address, _common.ADDRESS_MAGIC, "agent address", _common.MAX_ADDRESS)[1]


def _one_node_names(address: bytes) -> set[str]:
    return {t.name for t in _address._parse(_raw(address)).transports} & {"posix", "sysv", "cma"}


def test_a_proven_peer_on_this_node_is_reached_over_its_one_node_transports(pair):
    agent, mh, child, conn = pair
    peer = ucx.LocalPeer.from_socket(conn)
    assert (peer.pid, peer.uid) == (child.hello["pid"], os.geteuid()) and peer.alive()
    assert _one_node_names(child.hello["address"])  # the address does name them
    ep = agent.connect(child.hello["address"], local_peer=peer)
    rk = ep.unpack_remote_key(child.hello["key"])  # a shared-memory key of the child's own segment
    out = bytearray(4)
    ep.mem_get(out, rk.base_address, rk).wait(30)
    ep.mem_put(b"ours", rk.base_address + 8, rk).wait(30)
    ep.flush().wait(30)
    assert bytes(out) == b"peer" and child.call("read", 8, 4) == b"ours"
    lanes = ep.transport_info()
    assert any(tl in lanes for tl in ("posix", "sysv", "cma")), lanes
    # And the other way: the child proves this process through the same socket.
    theirs = child.call("connect", agent.address, mh.create_remote_key().serialize(), True)
    assert theirs["got"] == b"mine" and bytes(mh.buffer[4:8]) == b"back"


def test_registered_memory_is_reached_over_cma_with_no_key_bytes(listener):
    sock, name = listener
    child = Child(_local_peer.setup, name, False)
    conn, _ = sock.accept()
    try:
        with ucx.Agent(**_local_peer.AGENT) as agent:
            ep = agent.connect(child.hello["address"], local_peer=ucx.LocalPeer.from_socket(conn))
            rk = ep.unpack_remote_key(child.hello["key"])
            out = bytearray(4)
            ep.mem_get(out, rk.base_address, rk).wait(30)
            assert bytes(out) == b"peer"
    finally:
        conn.close()
        assert child.close() == 0


def test_without_proof_one_node_transports_are_refused(pair):
    agent, mh, child, conn = pair
    with pytest.raises(gs.InvalidInputError, match="accepted only from a peer on this node that the kernel proves"):
        agent.connect(child.hello["address"])


def _forge(address: bytes, old: bytes, new: bytes) -> bytes:
    raw = _raw(address)
    assert old in raw
    return _common.pack(_common.ADDRESS_MAGIC, 0, raw.replace(old, new, 1))


def test_an_address_naming_another_process_is_refused(pair):
    agent, mh, child, conn = pair
    peer = ucx.LocalPeer.from_socket(conn)
    pid = child.hello["pid"].to_bytes(4, "little")
    forged = _forge(child.hello["address"], pid, os.getpid().to_bytes(4, "little"))
    with pytest.raises(gs.InvalidInputError, match=f"the peer \\(pid {child.hello['pid']}\\)"):
        agent.connect(forged, local_peer=peer)
    # Proven as another process than the one whose address it is: refused too.
    other = ucx.LocalPeer(os.getpid(), os.geteuid(), os.pidfd_open(os.getpid()))
    with pytest.raises(gs.InvalidInputError, match=f"the peer \\(pid {os.getpid()}\\)"):
        agent.connect(child.hello["address"], local_peer=other)


def _md_keys(packed: bytes) -> list[tuple[int, int, int]]:
    """(memory domain, offset, size) of each memory domain's key in a packed key."""
    md_map, pos, out = int.from_bytes(packed[:8], "little"), 9, []
    for md in range(64):
        if md_map >> md & 1:
            out.append((md, pos + 1, packed[pos]))
            pos += 1 + packed[pos]
    return out


def _with_packed(blob: bytes, change) -> bytes:
    """The key ``blob`` with its packed key changed by ``change(bytearray)``, checksums made right."""
    from _ucx_fuzz_child import serialized_key

    mtype, serialized = _common.unpack(blob, _common.KEY_MAGIC, "remote key", _common.MAX_KEY)
    size = int.from_bytes(serialized[8:16], "little")
    packed = bytearray(serialized[16:16 + size])
    base = int.from_bytes(serialized[16 + size:24 + size], "little")
    length = int.from_bytes(serialized[24 + size:32 + size], "little")
    change(packed, base, length)
    return _common.pack(_common.KEY_MAGIC, mtype, serialized_key(bytes(packed), base, length))


@pytest.fixture
def own_sysv_segment():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(0, 1 << 20, 0o600 | 0o1000)  # IPC_PRIVATE, IPC_CREAT
    assert shmid >= 0
    yield shmid
    libc.shmctl(shmid, 0, None)  # IPC_RMID


def _key(md: int, key: bytes) -> bytes:
    """A packed UCX 1.21 remote key of host memory with ``key`` as memory domain ``md``'s bytes."""
    return (1 << md).to_bytes(8, "little") + b"\0" + bytes([len(key)]) + key + b"\xff"


def _posix(pid: int, fd: int, address: int, length: int, flags: int = (1 << 63) | (1 << 62)) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in (flags | fd << 30 | pid, address, length))


def _sysv(shmid: int, address: int) -> bytes:
    return shmid.to_bytes(4, "little") + address.to_bytes(8, "little")


def test_shared_memory_keys_must_name_the_peers_own_segments_within_their_size(pair, own_sysv_segment):
    """A posix key names /proc/<pid>/fd/<fd>, a sysv key a segment id: each is accepted only for the
    proven peer's own, no larger than the segment, covering the key's region."""
    from gpushare._ucx import _rkey
    from gpushare._ucx._address import PeerAddress

    agent, mh, child, conn = pair
    peer = ucx.LocalPeer.from_socket(conn)
    pid, mine, base = child.hello["pid"], os.getpid(), 0x7F0000000000
    fd = child.call("memfd", 1 << 20)
    theirs = child.call("sysv", 1 << 20)
    at = PeerAddress({3: frozenset({"posix"}), 2: frozenset({"sysv"})}, peer)
    region = (base + 4096, 8192)
    _rkey.check_packed_key(_key(3, _posix(pid, fd, base, 1 << 20)), 0, at, region)  # the peer's own: accepted
    _rkey.check_packed_key(_key(2, _sysv(theirs, base)), 0, at, region)
    refused = [
        (_key(3, _posix(mine, fd, base, 1 << 20)), f"process {mine}, not of the peer"),
        (_key(3, _posix(pid, fd, base, 1 << 21)), "holds 1048576"),
        (_key(3, _posix(pid, 999, base, 1 << 20)), "cannot open"),
        (_key(3, _posix(pid, fd, base + 8192, 1 << 20)), "not the key's region"),
        (_key(3, _posix(pid, fd, base, 1 << 20, flags=1 << 62)), "by file name"),
        (_key(3, _posix(pid, fd, base, 1 << 20, flags=(1 << 63) | (1 << 60))), "another pid namespace"),
        (_key(3, _posix(pid, fd, base, 1 << 20)[:23]), "24"),
        (_key(2, _sysv(own_sysv_segment, base)), f"of process {mine}"),
        (_key(2, _sysv(theirs, base + (1 << 20))), "not the key's region"),
        (_key(2, _sysv(0x7FFFFFF0, base)), "does not exist"),
        (_key(5, _posix(pid, fd, base, 1 << 20)), "does not name"),  # a domain the address lacks
    ]
    for packed, why in refused:
        with pytest.raises(gs.InvalidInputError, match=why):
            _rkey.check_packed_key(packed, 0, at, region)
    # Without proof, or from a tcp-only address, the same genuine key is refused.
    with pytest.raises(gs.InvalidInputError, match="names memory of this host"):
        _rkey.check_packed_key(_key(3, _posix(pid, fd, base, 1 << 20)), 0, PeerAddress(at.md_transports, None),
                               region)
    with pytest.raises(gs.InvalidInputError, match="pack none"):
        _rkey.check_packed_key(_key(3, _posix(pid, fd, base, 1 << 20)), 0,
                               PeerAddress({3: frozenset({"tcp"})}, peer), region)


def _packed(blob: bytes) -> bytes:
    _, serialized = _common.unpack(blob, _common.KEY_MAGIC, "remote key", _common.MAX_KEY)
    return serialized[16:16 + int.from_bytes(serialized[8:16], "little")]


def test_a_peer_that_exited_is_refused(pair):
    agent, mh, child, conn = pair
    peer = ucx.LocalPeer.from_socket(conn)
    address = child.hello["address"]
    child.close()
    assert not peer.alive()
    with pytest.raises(gs.InvalidInputError, match="has exited"):
        agent.connect(address, local_peer=peer)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_peer_of_another_user_is_refused_and_its_key_too(listener, pair):
    """A process of another user connects; it cannot be proven, and without proof the one-node
    address and key it would send (here a genuine pair of the same shape) are refused."""
    sock, name = listener
    agent, mh, child, conn = pair
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: another user, which only connects and waits
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(name)
            s.recv(1)
        finally:
            os._exit(0)
    try:
        sock.settimeout(60)
        other, _ = sock.accept()
        with other:
            with pytest.raises(gs.InvalidInputError, match="runs as user 65534, not as this process's user"):
                ucx.LocalPeer.from_socket(other)
            with pytest.raises(gs.InvalidInputError, match="accepted only from a peer on this node"):
                agent.connect(child.hello["address"])
            other.sendall(b"x")
    finally:
        os.waitpid(pid, 0)


def test_a_local_peer_needs_a_connected_unix_socket():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as inet, pytest.raises(gs.InvalidInputError,
                                                                                 match="AF_UNIX"):
        ucx.LocalPeer.from_socket(inet)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(gs.InvalidInputError, match="no peer process"):
        ucx.LocalPeer.from_socket(s)
    s.close()
    with ucx.Agent() as agent, pytest.raises(gs.InvalidInputError, match="local_peer must be"):
        agent.connect(agent.address, local_peer=os.getpid())
    with pytest.raises(TypeError, match="proves nothing elsewhere"):
        pickle.dumps(ucx.LocalPeer(os.getpid(), os.geteuid(), os.pidfd_open(os.getpid())))


@pytest.mark.parametrize("host_id", [0x66057A25C584BAA5, 0xE6057A25C584BAA5])
def test_device_addresses_carry_the_host_id_as_each_transport_packs_it(host_id):
    """cuda_ipc packs ucs_get_system_id() whole; shared memory and cma clear bit 63 (UCX's
    namespace flag).  A host whose id has bit 63 set (the H200 machine's does) must accept both."""
    me = ucx.LocalPeer(os.getpid(), os.geteuid(), os.pidfd_open(os.getpid()))
    pid = os.getpid().to_bytes(4, "little")

    def check(name: str, dev: int, peer: ucx.LocalPeer = me) -> str:
        t = _address._Transport(_address.TL_CSUMS[name], dev.to_bytes(8, "little"), 4, (), 0, 0, pid, ())
        return _address._check_transport(t, peer, host_id)

    masked = host_id & ~(1 << 63)
    assert check("cuda_ipc", host_id) == "cuda_ipc" and check("cma", masked) == "cma"
    for name, wrong in (("cuda_ipc", host_id ^ (1 << 63)), ("cma", masked | (1 << 63)), ("cma", masked ^ 1)):
        with pytest.raises(gs.InvalidInputError, match=f"names a {name} device of another host"):
            check(name, wrong)
    del me
    gc.collect()
