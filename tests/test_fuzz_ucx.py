"""Bytes from another process that reach UCX: packed worker addresses and
packed remote keys.  UCX reads both with no length; gpushare validates them
in full first (``gpushare._ucx._address``, ``gpushare._ucx._rkey``).  The
fuzz tests feed forged blobs to the real UCX calls behind the validators,
in child processes with a network namespace of their own (only loopback),
and fail if any child dies by a signal, naming the case that killed it.
A peer without the key reaches the region server's port, and is served
nothing."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpushare as gs
import gpushare.ucx as gu
from gpushare._ucx import _address, _common, _peer, _rkey, _server

import _share_peer
import _ucx_fuzz_child as fuzz
from _procs import Child


def _raw(address: bytes) -> bytes:
    return _common.unpack(address, _common.ADDRESS_MAGIC, "address", _common.MAX_ADDRESS)[1]


def _node_raw() -> bytes:
    return _raw(_server.server().address)


def _p3(raw: bytes) -> bytes:
    """The first tcp device's address length set to 0 and its bytes removed: this
    passed the structure-only check and crashed UCX (SIGSEGV in
    ``uct_tcp_iface_is_reachable_v2``)."""
    dev_pos, length = fuzz.tcp_devices(raw)[0]
    return raw[:dev_pos] + bytes([raw[dev_pos] & 0xE0]) + raw[dev_pos + 1 + length:]


def _needs_netns() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip for a network namespace of its own")


# ------------------------------------------------------------------ the validators, in this process


def test_real_addresses_pass_and_the_p3_address_is_refused():
    raw = _node_raw()
    _address.check_worker_address(raw, raw)
    agent_raw = _raw(gu.Agent().address)
    _address.check_worker_address(agent_raw, raw)
    _address.check_worker_address(raw, agent_raw)
    with pytest.raises(gs.InvalidInputError, match="tcp transport with a 0-byte device address"):
        _address.check_worker_address(_p3(raw), raw)


def test_shared_memory_and_cma_addresses_are_refused_even_by_a_worker_that_runs_them():
    """Unless the peer is proven to be on this node (tests/test_ucx_local.py)."""
    with gu.Agent(error_handling=False, transports="all") as agent:
        everything = _raw(agent.address)
    with pytest.raises(gs.InvalidInputError, match="(sysv|posix|cma) transport, whose addresses name files, segments "
                                                   "or processes of this host: it is accepted only from a peer on "
                                                   "this node that the kernel proves"):
        _address.check_worker_address(everything, everything)
    _address.check_worker_address(_raw(gu.Agent(transports="tcp,self").address), everything)


@pytest.mark.parametrize("change, why", [
    (lambda r: r[:-1], "ends at byte"),
    (lambda r: r + b"\0", "after its last device"),
    (lambda r: bytes([r[0] | 0x0F]) + r[1:], "format version 15"),
    (lambda r: bytes([r[0] & 0x0F]) + r[1:], "without a worker uuid"),
    (lambda r: bytes([r[0] | 0x10]) + r[1:9] + b"\x03abc" + r[9:], "debug information"),
    (lambda r: r[:9] + b"\xff" + r[10:], "names no transport"),
    (lambda r: r[:9] + b"\x00" + r[9:], "names"),  # one byte inserted after the uuid
    (lambda r: r[:-2] + bytes([r[-2] ^ 1]) + r[-1:], "another UCX release"),
])
def test_broken_addresses_are_refused_with_what_is_wrong(change, why):
    raw = _node_raw()
    with pytest.raises(gs.InvalidInputError, match=why):
        _address.check_worker_address(change(raw), raw)


def _first_transport(raw: bytes) -> int:
    """Position of the first transport's name checksum in a v1 address."""
    dev_pos, length = fuzz.tcp_devices(raw)[0]
    dev = raw[dev_pos]
    return dev_pos + 1 + bool(dev & 0x40) + bool(dev & 0x20) + length


@pytest.mark.parametrize("field, value, why", [
    (4, b"\x00\x00\x00\x00", "bandwidth 0.0"),         # UCX refuses it itself, after parsing
    (4, b"\x00\x00\xc0\x7f", "bandwidth nan"),         # UCX takes a NaN
    (0, b"\x00\x00\x80\xff", "overhead -inf"),
    (0, b"\x00\x00\x80\xbf", "overhead -1.0"),
])
def test_transport_attributes_must_be_finite_and_positive(field, value, why):
    raw = _node_raw()
    pos = _first_transport(raw) + 2 + field
    with pytest.raises(gs.InvalidInputError, match=why):
        _address.check_worker_address(raw[:pos] + value + raw[pos + 4:], raw)


def test_tcp_device_flags_and_family_must_agree_with_its_length():
    raw = _node_raw()
    dev_pos, length = fuzz.tcp_devices(raw)[0]
    start = dev_pos + 1
    for flags, family in ((0, 10), (1, 2), (2, 2), (0, 0)):
        forged = raw[:start] + bytes([flags, family]) + raw[start + 2:]
        if (length, flags, family) in _address._TCP_DEVICES:
            continue
        with pytest.raises(gs.InvalidInputError, match="tcp device of flags"):
            _address.check_worker_address(forged, raw)


def test_unified_mode_refuses_every_peer_address(monkeypatch):
    raw = _node_raw()
    monkeypatch.setenv("UCX_UNIFIED_MODE", "y")
    with pytest.raises(gs.InvalidInputError, match="UCX_UNIFIED_MODE"):
        _address.check_worker_address(raw, raw)


def test_an_address_of_another_format_version_is_refused():
    r = subprocess.run([sys.executable, "-c", "from gpushare._ucx import _server; print(_server.server().address.hex())"],
                       capture_output=True, text=True, timeout=120, check=True,
                       env=dict(os.environ, UCX_ADDRESS_VERSION="v2", PYTHONPATH=os.pathsep.join(sys.path)))
    v2 = _raw(bytes.fromhex(r.stdout.split()[-1]))
    with pytest.raises(gs.InvalidInputError, match="UCX_ADDRESS_VERSION"):
        _address.check_worker_address(v2, _node_raw())


def _real_key() -> tuple[int, bytes, gu.Agent]:
    agent = gu.Agent()
    handle = agent.create_memory_handle(4096)
    mtype, serialized = _common.unpack(handle.create_remote_key().serialize(), _common.KEY_MAGIC, "k", 1 << 16)
    return mtype, serialized, agent


def test_real_keys_pass_and_keys_with_transport_bytes_are_refused():
    mtype, serialized, _agent = _real_key()
    packed = _rkey.packed_key(serialized)
    _rkey.check_packed_key(packed, mtype)
    assert fuzz.serialized_key(packed, 1, 2)[8:16] == serialized[8:16]
    sysv = (1 << 2).to_bytes(8, "little") + b"\x00" + b"\x0c" + bytes(12) + b"\xff"  # a sysv-shaped key
    for forged, why in [
        (sysv, "carries 12 key bytes for memory domain 2"),
        ((1).to_bytes(8, "little") + b"\x00\x00\x05", "ends before the end of its system distances"),
        ((1).to_bytes(8, "little") + b"\x00\x00\x05\x00\x0f", "distance to system device 0 in 2 bytes"),
        ((1).to_bytes(8, "little") + b"\x00\x00\x05\x40\x0f\x01\xff", "distance to system device 64"),
        ((1).to_bytes(8, "little") + b"\x00\x00\x45\xff", "names system device 69"),
        ((1).to_bytes(8, "little") + b"\x00\x00", "ends before its system device"),
        (bytes(8) + b"\x01", "UCX memory type 1; the key says host"),
        (bytes(8) + b"\x0a", "UCX memory type 10"),
        (bytes(8) + b"\x00\xff", "1 bytes after its end"),
        (bytes(8), "at least 9"),
        ((1 << 63).to_bytes(8, "little") + b"\x00", "ends before memory domain 63"),
    ]:
        with pytest.raises(gs.InvalidInputError, match=why):
            _rkey.check_packed_key(forged, 0)
    _rkey.check_packed_key((0b1011).to_bytes(8, "little") + b"\x00" + bytes(3) + b"\xff", 0)
    _rkey.check_packed_key(bytes(8) + b"\x01", 1)
    # A CUDA key as UCX 1.21 packs it over cuda_copy: GPU 0 (flush bit set), distances to two devices.
    _rkey.check_packed_key((2).to_bytes(8, "little") + b"\x01\x00\x80\x00\x00\x0f\x01\x00\x0f\xff", 1)


def test_a_forged_key_is_refused_by_unpack_remote_key_before_ucx_reads_it():
    mtype, serialized, exporter = _real_key()
    importer = gu.Agent()
    ep = importer.connect(exporter.address)
    sysv = (1 << 2).to_bytes(8, "little") + b"\x00" + b"\x0c" + bytes(12) + b"\xff"
    forged = fuzz.serialized_key(sysv, int.from_bytes(serialized[-16:-8], "little"), 4096)
    with pytest.raises(gs.InvalidInputError, match="12 key bytes"):
        ep.unpack_remote_key(_common.pack(_common.KEY_MAGIC, mtype, forged))
    ep.unpack_remote_key(_common.pack(_common.KEY_MAGIC, mtype, serialized)).close()


class _AgentOfSharedMemoryKeys:
    """Stands in for an agent whose keys carry bytes for a memory domain its own (tcp-only)
    address does not name with a transport that packs any."""

    def __init__(self):
        self._real = gu.Agent(transports="tcp,self")
        self._native = self._real._native

    class _Handle:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def create_remote_key(self):
            packed = (1 << 2).to_bytes(8, "little") + b"\x00\x0c" + bytes(12) + b"\xff"
            return type("K", (), {"serialize": lambda _: _common.pack(
                _common.KEY_MAGIC, 0, fuzz.serialized_key(packed, 4096, 4096))})()

    def create_memory_handle(self, size):
        return self._Handle()


def test_an_agent_whose_own_keys_would_be_refused_refuses_peer_keys_naming_ucx_tls():
    mtype, serialized, agent = _real_key()
    _rkey.check_remote_key(serialized, mtype, agent)  # this agent's own keys pass its self-test
    with pytest.raises(gs.UnsupportedError, match="UCX_TLS"):
        _rkey.check_remote_key(serialized, mtype, _AgentOfSharedMemoryKeys())


# ------------------------------------------------------------------ the public calls refuse forged addresses


def test_agent_and_client_connect_refuse_the_p3_address():
    raw = _node_raw()
    with pytest.raises(gs.InvalidInputError):
        _peer.client().connect(_common.pack(_common.ADDRESS_MAGIC, 0, _p3(raw)), timeout=5)
    with gu.Agent() as agent, pytest.raises(gs.InvalidInputError):
        agent.connect(_common.pack(_common.ADDRESS_MAGIC, 0, _p3(_raw(agent.address))), timeout=5)


def test_opening_an_offer_with_a_forged_ucx_address_is_an_error_for_the_importer():
    """In a child, so that a crash fails the test: broken envelopes, then valid
    envelopes around the P3 address, a shared-memory one and one with a byte
    after the uuid."""
    real = _server.server().address
    raw = _raw(real)
    everything = _raw(gu.Agent(error_handling=False, transports="all").address)
    blobs = [b"", b"\0" * 64, os.urandom(300), real[:-1], real + b"x", real[:8] + os.urandom(len(real) - 8),
             bytes([real[0] ^ 1]) + real[1:]]
    blobs += [_common.pack(_common.ADDRESS_MAGIC, 0, b) for b in (_p3(raw), everything, raw[:9] + b"\x00" + raw[9:])]
    child = Child(_share_peer.setup)
    try:
        share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
        got = child.call("forged_offers", share, blobs, timeout=120)
    finally:
        child.close()
    assert got == ["InvalidInputError"] * len(blobs), got


# ------------------------------------------------------------------ fuzz: forged blobs fed to UCX


def _assert_no_crash(result: dict) -> None:
    assert result["crashes"] == [], f"cases that killed the process: {result['crashes']}"
    assert result["total"] == result["refused"] + result["ucx_error"] + result["accepted"], result
    assert result["refused"] > 0 and result["accepted"] > 0, result


@pytest.mark.netns
@pytest.mark.parametrize("seed, version", [(1, "v1"), (2, "v2")])
def test_forged_worker_addresses_are_refused_or_connect_never_crash(seed, version):
    """Every one-byte change of this process's own worker address (region
    server and Agent), deletions, insertions, truncations, tcp device lengths
    changed with their bytes (P3) and random changes, through
    ``Client.connect`` and ``Agent.connect``."""
    _needs_netns()
    result = fuzz.fuzz("address", seed, 1500, timeout=300, UCX_ADDRESS_VERSION=version)
    print(json.dumps(result))
    _assert_no_crash(result)
    assert result["total"] > 3000


@pytest.mark.netns
def test_forged_remote_keys_are_refused_or_unpacked_and_used_never_crash():
    """Every one-byte change of a real packed key with its libucxx checksum
    recomputed, insertions, truncations, forged memory-domain maps and
    shared-memory shaped keys, envelope changes, through
    ``Endpoint.unpack_remote_key``; an accepted key of the real range reads
    the real bytes."""
    _needs_netns()
    result = fuzz.fuzz("key", 3, 2000, timeout=300)
    print(json.dumps(result))
    _assert_no_crash(result)
    assert result["total"] > 2500


@pytest.mark.netns
@pytest.mark.parametrize("kind, count, least", [("local-address", 400, 2000), ("local-key", 900, 2500)])
def test_forged_one_node_addresses_and_keys_of_a_proven_peer_never_crash(kind, count, least):
    """The same edits of an agent's address on UCX's one-node transports (shared memory, cma), and
    of its keys (cma's, and posix and sysv keys of its own segments), through ``Agent.connect`` and
    ``Endpoint.unpack_remote_key`` with the peer proven as this very process: what names another
    process, another segment or more than a segment holds is refused, the rest connects or reads
    the real bytes (a sample; tools/fuzz_ucx.py --local N runs the long one)."""
    _needs_netns()
    result = fuzz.fuzz(kind, 5, count, timeout=300)
    print(json.dumps(result))
    _assert_no_crash(result)
    assert result["total"] > least and result["refused"] and result["accepted"]


# ------------------------------------------------------------------ a peer without the key


_KEYLESS = r"""
import json, os, sys
import numpy as np
import gpushare as gs
from gpushare._ucx import _peer

share = gs.Share.from_bytes(bytes.fromhex(sys.argv[1]))
address = bytes.fromhex(sys.argv[2])  # learnt without gpushare: the port is in /proc/net/tcp
out = {}
try:
    gs.open(share, prefer=["ucx-rma"], exclude=["same-process", "cma", "host-fd", "posix-fd"]).close()
    out["open"] = "opened"
except gs.GpuShareError as exc:
    out["open"] = type(exc).__name__
peer = _peer.client().connect(address, timeout=30)
errors, served = {}, 0
buf = bytearray(b"\xab" * 4096)
for region in list(range(1, 65)) + [1000, (1 << 32) - 1]:
    for key in (bytes(16), os.urandom(16)):
        for op in ("get", "put"):
            try:
                if op == "get":
                    peer.get(region, key, 0, buf, timeout=30)
                else:
                    peer.put(region, key, 0, b"\x55" * 4096, timeout=30)
                served += 1
            except gs.GpuShareError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
out.update(served=served, errors=errors, untouched=bytes(buf) == b"\xab" * 4096)
print(json.dumps(out))
"""


def test_a_peer_without_the_key_that_reaches_the_ucx_port_is_served_nothing():
    """The control channel refuses the keyless peer; it connects to the
    region server's UCX port anyway (UCX lets anyone who reaches it) and asks
    for regions with guessed capabilities: every request is refused, no byte
    of the exporter reaches it and none of its bytes lands in the exporter."""
    arr = np.arange(4096, dtype=np.uint8)
    before = hashlib.sha256(arr).hexdigest()
    share = gs.export(arr, lifetime="revoked")
    honest = Child(_share_peer.setup)
    try:
        # A real importer holds a lease over ucx-rma: a region and its key exist in the server.
        info = honest.call("open", "v", share, {"prefer": "ucx-rma", "exclude": ["same-process", "cma", "host-fd"]})
        assert info["path"] == "ucx-rma", info
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), GPUSHARE_AUTHKEY=secrets.token_hex(16))
        r = subprocess.run([sys.executable, "-c", _KEYLESS, share.to_bytes().hex(), _server.server().address.hex()],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert honest.call("get", "v", 0, 16) == arr[:16].tobytes()  # the honest importer is still served
    finally:
        honest.close()
        share.revoke()
    assert got["open"] == "AccessDeniedError", got
    assert got["served"] == 0 and set(got["errors"]) == {"AccessDeniedError"}, got
    assert got["untouched"] is True  # no byte of the exporter reached the keyless peer
    assert hashlib.sha256(arr).hexdigest() == before  # and none of its bytes reached the exporter


# ------------------------------------------------------------------ InfiniBand and RoCE entries in a real address


def _with_ib_device(raw: bytes, dev_addr: bytes, name: str, iface: bytes) -> bytes:
    """``raw`` (a v1 address) with its first tcp device turned into a device of IB transport ``name``:
    the device address, the name checksum and the interface address replaced, the rest as packed."""
    dev_pos, length = fuzz.tcp_devices(raw)[0]
    dev = raw[dev_pos]
    start = dev_pos + 1 + bool(dev & 0x40) + bool(dev & 0x20)
    p = start + length  # the transport: checksum (2), attributes (16), interface length byte, interface
    ifl = raw[p + 18]
    head = raw[:dev_pos] + bytes([(dev & ~0x1F & 0xFF) | len(dev_addr)]) + raw[dev_pos + 1:start] + dev_addr
    entry = _address.TL_CSUMS[name].to_bytes(2, "little") + raw[p + 2:p + 18] + bytes([(ifl & 0xC0) | len(iface)])
    return head + entry + iface + raw[p + 19 + (ifl & 0x3F):]


def test_an_roce_or_infiniband_entry_is_accepted_at_its_exact_sizes_and_its_keys_with_it():
    from gpushare._ucx import _ib

    raw = _node_raw()
    if raw[0] & 0x0F != 0 or not fuzz.tcp_devices(raw):
        pytest.skip("this machine's own address is not a v1 address with a tcp device")
    gid = bytes(10) + b"\xff\xff" + bytes([198, 18, 0, 1])  # an IPv4-mapped RoCE GID
    roce = _ib.pack_roce_address(gid)
    ib = _ib.pack_ib_address(7)
    ok = [(roce, "ud_verbs", _ib.pack_ud_iface(0x1234)), (ib, "rc_mlx5", _ib.pack_rc_mlx5_iface()),
          (ib, "dc_mlx5", _ib.pack_dc_mlx5_iface(0x42)), (roce, "rc_verbs", b"")]
    for dev_addr, name, iface in ok:
        peer = _address.check_worker_address(_with_ib_device(raw, dev_addr, name, iface), raw)
        md = next(md for md, names in peer.md_transports.items() if name in names)
        key = (1 << md).to_bytes(8, "little") + b"\0" + b"\x08" + _ib.pack_ib_md_key(0x1234) + b"\xff"
        _rkey.check_packed_key(key, 0, peer)
        for bad, why in [(key[:9] + b"\x00" + key[18:], "8"), (key[:9] + b"\x09" + key[10:18] + b"\0\xff", "8")]:
            with pytest.raises(gs.InvalidInputError, match=why):
                _rkey.check_packed_key(bad, 0, peer)
    refused = [(roce[:-1], "ud_verbs", _ib.pack_ud_iface(1)),               # a cut device address
               (bytes([roce[0] | 0x01]) + roce[1:], "ud_verbs", _ib.pack_ud_iface(1)),  # a flag RoCE never sets
               (ib, "rc_mlx5", b"\x00\x00"),                                  # a 2-byte rc_mlx5 interface
               (ib, "ud_mlx5", _ib.pack_ud_iface(1)[:2])]
    for dev_addr, name, iface in refused:
        with pytest.raises(gs.InvalidInputError, match=name.split("_")[0] + "|device address|InfiniBand|RoCE"):
            _address.check_worker_address(_with_ib_device(raw, dev_addr, name, iface), raw)
