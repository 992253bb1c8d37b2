"""Check a packed UCX worker address from another process before UCX reads it.

UCX reads a peer's worker address (``ucp_ep_create``) with no length and no
bounds, and its transports then read their own parts of it (device and
interface addresses) at the sizes of their own structs, again with no
length: a forged address makes UCX read past the end of the buffer or
dereference a missing field (SIGSEGV), or trips an assertion on an unknown
format version (SIGABRT).  gpushare takes worker addresses from other
processes (an exporter's offer, an agent's peer), so it validates them
first, as UCX 1.21 packs them (formats v1 and v2,
``src/ucp/wireup/address.c``; the native module is built against UCX 1.21
and no other).  The address is validated, not rebuilt: once it passes,
the bytes UCX reads are the peer's.

Checked, in full:

- the structure: header (version 0 or 1, known flags, the worker uuid),
  client id and name; for each device its memory-domain index (< 64),
  flags, path count (>= 1), system device (unknown, or < 64) and address;
  for each transport on it the name checksum, its attributes, its interface
  address and each endpoint address with its lane; the address ends
  exactly where its last device does;
- the transports: ``tcp``, ``self`` and ``cuda_copy`` entries at their
  exact sizes (tcp: a 6-byte IPv4 or 18-byte IPv6 or loopback device
  address whose flags and family agree with its size, a 2-byte port, no
  endpoint address; self and cuda_copy: no device address, an 8-byte
  interface address); InfiniBand and RoCE entries (``rc_mlx5``,
  ``dc_mlx5``, ``ud_mlx5``, ``rc_verbs``, ``ud_verbs``, ``rc_gda``) at the
  exact sizes their flags and UCX 1.21's structs give, with no endpoint
  addresses (a worker address carries none; ``_ib``); shared memory (posix,
  sysv), CMA and cuda_ipc, whose addresses name files, segments and process
  ids that the importer would open or write with its own rights, only from
  a peer that the kernel proved to run on this node as this user
  (``local_peer``, see ``_local``), and only naming that peer's own
  processes and segments, on this host (their device address is this
  host's system id); any other transport is refused;
- against this process's own address (``local``, the same UCX build): the
  format version, the header flags, and for every transport this process
  also runs, the shape (device and interface address lengths, endpoint
  addresses) and capability flags of one of its own entries;
- v1 attributes: finite, non-negative overheads and a positive bandwidth;
  v2 attributes: a message transport's segment holds a remote key.

UCX's unified mode (``UCX_UNIFIED_MODE=y``) packs a different format that
cannot be validated: with it every peer address is refused.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from typing import NamedTuple

from .._errors import InvalidInputError
from . import _ib
from ._loader import system_id_of_host
from ._local import ONE_NODE, LocalPeer, check_local_iface

__all__ = ["check_worker_address", "PeerAddress", "TL_CSUMS"]

_V1, _V2 = 0, 1
# Header flags (UCP_ADDRESS_HEADER_FLAG_*): debug info, worker uuid, client id, AM only.
_DEBUG_INFO, _WORKER_UUID, _CLIENT_ID = 0x1, 0x2, 0x4
_KNOWN_FLAGS = 0xF
# Device byte: address length in the low 5 bits, then system device, path count, last.
_DEV_LEN_MASK, _DEV_SYS_DEVICE, _DEV_NUM_PATHS, _LAST = 0x1F, 0x20, 0x40, 0x80
# Memory-domain byte: index in the low 7 bits, "device without transports" in the top one.
_MD_MASK, _MD_EMPTY_DEV = 0x7F, 0x80
# Interface length byte: length in the low 6 bits, "has endpoint addresses", last.
_IFACE_LEN_MASK, _HAS_EP_ADDR = 0x3F, 0x40
_NULL_RESOURCE = 0xFF
# Packed interface attributes without the resource index (not in worker addresses).
_ATTR_LEN = {_V1: 16, _V2: 8}
_MAX_MDS, _MAX_RESOURCES, _MAX_LANES, _MAX_SYS_DEVICES = 64, 128, 64, 64
_UNKNOWN_SYS_DEVICE = 0xFF


def _crc16(name: str) -> int:
    """``ucs_crc16_string``: CRC-16-CCITT (reflected), the transport name checksum."""
    crc = 0xFFFF
    for byte in name.encode():
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


#: Transport name checksums (``tl_name_csum``) of the transports gpushare knows.
TL_CSUMS = {name: _crc16(name) for name in ("tcp", "self", "cuda_copy", *ONE_NODE, *_ib.IB_TRANSPORTS)}
_NAMES = {csum: name for name, csum in TL_CSUMS.items()}
# One-node transports' device addresses: the host's system id (uct_iface_local_addr_base_t,
# sm_iface.c; cuda_ipc: uct_cuda_ipc_device_addr_t without its MNNVL flags byte, or with it 0).
_ONE_NODE_DEVICE = {"posix": {8}, "sysv": {8}, "cma": {8}, "cuda_ipc": {8, 9}}
# uct_iface_get_local_address clears bit 63 of the id (UCT_IFACE_LOCAL_ADDR_FLAG_NS, set only with
# a namespace id after it, which UCX packs in 16 bytes, refused above); cuda_ipc packs the id whole.
_NS_FLAG = 1 << 63
_ID_MASK = {"posix": ~_NS_FLAG, "sysv": ~_NS_FLAG, "cma": ~_NS_FLAG, "cuda_ipc": ~0}
# Accepted transports: (device address lengths, interface address length), none with endpoint addresses.
# tcp: uct_tcp_device_addr_t {u8 flags, u8 sa_family} + in_addr / in6_addr / uct_iface_local_addr_ns_t
# (tcp.h:305-312), port (tcp.h:318-320); self, cuda_copy: an 8-byte id (self.h:14, cuda_copy_iface.h:20).
_SHAPES = {"tcp": ({6, 18}, 2), "self": ({0}, 8), "cuda_copy": ({0}, 8)}
_AF_INET, _AF_INET6, _TCP_LOOPBACK = 2, 10, 1
_TCP_DEVICES = {(6, 0, _AF_INET), (18, 0, _AF_INET6), (18, _TCP_LOOPBACK, _AF_INET)}
_V1_ATTRS = struct.Struct("<fffI")  # overhead, bandwidth, latency overhead, priority | capability flags


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def peek(self) -> int:
        self.need(1)
        return self.data[self.pos]

    def u8(self) -> int:
        value = self.peek()
        self.pos += 1
        return value

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def need(self, n: int, what: str = "the next field") -> None:
        if self.pos + n > len(self.data):
            raise InvalidInputError(f"UCX worker address ends at byte {len(self.data)}, inside {what} "
                                    f"({n} bytes at {self.pos})")

    def extended(self, mask: int, value: int, version: int) -> int:
        """A length or index that v2 continues in the next byte when it is ``mask``."""
        return self.u8() if version == _V2 and value == mask else value


class _Transport(NamedTuple):
    csum: int
    dev_addr: bytes
    iface_len: int
    endpoints: tuple[int, ...]  # the length of each endpoint address
    caps: int  # capability flags from the attributes
    md_index: int
    iface: bytes
    ep_addrs: tuple[bytes, ...]

    @property
    def name(self) -> str | None:
        return _NAMES.get(self.csum)

    @property
    def shape(self) -> tuple[int, int, int, tuple[int, ...]]:
        return (self.csum, len(self.dev_addr), self.iface_len, self.endpoints)


class _Address(NamedTuple):
    version: int
    flags: int
    release: int | None  # v2: UCX's release version (mod 16) from the header
    transports: tuple[_Transport, ...]
    empty_devices: tuple[int, ...]  # v1: their memory-domain bytes; the last one carries UCX's release version


# v2 attributes: overhead, bandwidth, latency (fp8), priority, segment size
# (units of 64 bytes, little-endian u16), flags (u16: bit 1 "active messages",
# bit 2 "callbacks from any thread").
_SEG_SIZE_FACTOR, _AM_FLAGS, _MIN_AM_SEGMENT = 64, 0x6, 1024


def _attributes(attr: bytes, version: int) -> int:
    """Check a transport's packed attributes; its capability flags."""
    if version == _V2:
        seg_size = int.from_bytes(attr[4:6], "little") * _SEG_SIZE_FACTOR
        flags = int.from_bytes(attr[6:8], "little")
        if flags & _AM_FLAGS and seg_size < _MIN_AM_SEGMENT:
            # UCX asserts (and aborts) when a message transport's segment cannot hold a remote key.
            raise InvalidInputError(f"UCX worker address names a message transport with {seg_size}-byte segments")
        return flags
    overhead, bandwidth, latency, prio_cap = _V1_ATTRS.unpack(attr)
    if not (math.isfinite(overhead) and math.isfinite(latency) and math.isfinite(bandwidth)) \
            or overhead < 0 or latency < 0 or bandwidth <= 0:
        raise InvalidInputError(f"UCX worker address names a transport with overhead {overhead}, "
                                f"latency {latency} and bandwidth {bandwidth}")
    return prio_cap >> 8  # the low byte is the priority, which differs between devices


def _parse(raw: bytes) -> _Address:
    """Walk an address as UCX 1.21 unpacks it (``ucp_address_unpack``) and
    check every field UCX reads or trusts whatever the transport."""
    r = _Reader(raw)
    header = r.u8()
    version = header & 0x0F
    if version == _V1:
        flags = header >> 4
    elif version == _V2:
        flags = r.u8()
    else:
        raise InvalidInputError(f"UCX worker address of format version {version}; UCX 1.21 reads 0 and 1")
    if flags & ~_KNOWN_FLAGS:
        raise InvalidInputError(f"UCX worker address with unknown header flags {flags:#x}")
    if not flags & _WORKER_UUID:
        raise InvalidInputError("UCX worker address without a worker uuid")
    r.take(8, "the worker uuid")
    if flags & _CLIENT_ID:
        r.take(8, "the client id")
    if flags & _DEBUG_INFO:
        r.take(r.u8(), "the worker name")
    if r.peek() == _NULL_RESOURCE:
        raise InvalidInputError("UCX worker address names no transport")
    transports: list[_Transport] = []
    empty_devices: list[int] = []
    while True:
        md = r.u8()
        empty = md & _MD_EMPTY_DEV
        md_index = r.extended(_MD_MASK, md & _MD_MASK, version)
        if md_index >= _MAX_MDS and not empty:
            raise InvalidInputError(f"UCX worker address names memory domain {md_index}; at most {_MAX_MDS - 1}")
        dev = r.u8()
        dev_len = r.extended(_DEV_LEN_MASK, dev & _DEV_LEN_MASK, version)
        if dev & _DEV_NUM_PATHS and r.u8() == 0:
            raise InvalidInputError("UCX worker address names a device with no path")
        if dev & _DEV_SYS_DEVICE:
            sys_dev = r.u8()
            if sys_dev != _UNKNOWN_SYS_DEVICE and sys_dev >= _MAX_SYS_DEVICES:
                raise InvalidInputError(f"UCX worker address names system device {sys_dev}")
        dev_addr = r.take(dev_len, "a device address")
        if empty:
            # A device without transports: UCX packs one, the last, to carry its release version.
            if not dev & _LAST or dev_len or dev & (_DEV_NUM_PATHS | _DEV_SYS_DEVICE):
                raise InvalidInputError("UCX worker address has a device without transports that UCX does not pack")
            empty_devices.append(md)
        last_tl = bool(empty)
        while not last_tl:
            if len(transports) >= _MAX_RESOURCES:
                raise InvalidInputError(f"UCX worker address names more than {_MAX_RESOURCES} transports")
            csum = int.from_bytes(r.take(2, "a transport's name checksum"), "little")
            caps = _attributes(r.take(_ATTR_LEN[version], "a transport's attributes"), version)
            length_byte = r.u8()
            last_tl = bool(length_byte & _LAST)
            has_ep = bool(length_byte & _HAS_EP_ADDR)
            iface_len = r.extended(_IFACE_LEN_MASK, length_byte & _IFACE_LEN_MASK, version)
            iface = r.take(iface_len, "an interface address")
            ep_addrs: list[bytes] = []
            while has_ep:
                if len(ep_addrs) >= _MAX_LANES:
                    raise InvalidInputError(f"UCX worker address names more than {_MAX_LANES} endpoint addresses")
                ep_addrs.append(r.take(r.u8(), "an endpoint address"))
                has_ep = not r.u8() & _LAST
            transports.append(_Transport(csum, dev_addr, iface_len, tuple(len(e) for e in ep_addrs), caps, md_index,
                                         iface, tuple(ep_addrs)))
        if dev & _LAST:
            break
    if r.pos != len(r.data):
        raise InvalidInputError(f"UCX worker address has {len(r.data) - r.pos} bytes after its last device")
    return _Address(version, flags, header >> 4 if version == _V2 else None, tuple(transports), tuple(empty_devices))


def _check_transport(t: _Transport, peer: LocalPeer | None = None, system_id: int | None = None) -> str:
    """Refuse a transport gpushare does not accept from this peer, or one whose
    addresses do not have its exact size or name what they may; its name."""
    name = _NAMES.get(t.csum)
    if name is None:
        raise InvalidInputError(f"UCX worker address names an unknown transport (name checksum {t.csum:#06x})")
    if name in _ib.IB_TRANSPORTS:
        _ib.check_ib_entry(name, t.dev_addr, t.iface, t.ep_addrs)
        return name
    if name in _ONE_NODE_DEVICE:
        check_local_iface(name, t.iface, peer)  # first: without a proven peer, the refusal says so
        if len(t.dev_addr) not in _ONE_NODE_DEVICE[name] or t.endpoints:
            raise InvalidInputError(f"UCX worker address names a {name} transport with a {len(t.dev_addr)}-byte device "
                                    f"address and {len(t.endpoints)} endpoint addresses; UCX 1.21 packs "
                                    f"{' or '.join(map(str, sorted(_ONE_NODE_DEVICE[name])))} and none")
        if len(t.dev_addr) == 9 and t.dev_addr[8]:
            raise InvalidInputError(f"UCX worker address names a {name} device reached over multi-node NVLink "
                                    f"(flags {t.dev_addr[8]:#x}), not one on this node")
        if system_id is not None and int.from_bytes(t.dev_addr[:8], "little") != system_id & _ID_MASK[name]:
            raise InvalidInputError(f"UCX worker address names a {name} device of another host (system id "
                                    f"{int.from_bytes(t.dev_addr[:8], 'little'):#x}, this host's is "
                                    f"{system_id & _ID_MASK[name]:#x})")
        return name
    dev_lens, iface_len = _SHAPES[name]
    if len(t.dev_addr) not in dev_lens or t.iface_len != iface_len or t.endpoints:
        raise InvalidInputError(f"UCX worker address names a {name} transport with a {len(t.dev_addr)}-byte device "
                                f"address, a {t.iface_len}-byte interface address and {len(t.endpoints)} endpoint "
                                "addresses; UCX 1.21 packs "
                                f"{' or '.join(map(str, sorted(dev_lens)))}, {iface_len} and none")
    if name == "tcp" and (len(t.dev_addr), t.dev_addr[0], t.dev_addr[1]) not in _TCP_DEVICES:
        raise InvalidInputError(f"UCX worker address names a tcp device of flags {t.dev_addr[0]} and address "
                                f"family {t.dev_addr[1]} in {len(t.dev_addr)} bytes")
    return name


def _unified_mode() -> bool:
    return os.environ.get("UCX_UNIFIED_MODE", "n").strip().lower() in ("y", "yes", "on", "1", "true")


@functools.lru_cache(maxsize=8)
def _own(local: bytes) -> _Address:
    """This process's own worker address, parsed; it must read as UCX 1.21
    packs it, or no peer address can be validated against it."""
    try:
        own = _parse(local)
        for t in own.transports:
            if t.name in _SHAPES or t.name in _ib.IB_TRANSPORTS:
                _check_transport(t)
    except InvalidInputError as exc:
        raise InvalidInputError(
            f"this process's own UCX worker address is not in the format gpushare validates ({exc}); a setting "
            "such as UCX_UNIFIED_MODE or UCX_ADDRESS_DEBUG_INFO changes it, so peer addresses are refused"
        ) from None
    return own


class PeerAddress(NamedTuple):
    """What a checked peer address says that its remote keys are read against: the transports
    of each memory domain, and the proven local peer it came from (or None)."""

    md_transports: dict[int, frozenset[str]]
    local_peer: LocalPeer | None


def check_worker_address(raw: bytes, local: bytes, local_peer: LocalPeer | None = None) -> PeerAddress:
    """Raise :class:`InvalidInputError` unless ``raw``, a peer's packed worker
    address, is one UCX 1.21 reads safely and that fits this process's own
    worker address ``local`` (see the module notes for what is checked).
    ``local_peer``: the peer as the kernel proved it, which admits its
    one-node transports.  Returns what its keys are checked against."""
    if _unified_mode():
        raise InvalidInputError("UCX_UNIFIED_MODE=y packs worker addresses that gpushare cannot validate: "
                                "peer addresses are refused; unset UCX_UNIFIED_MODE")
    own = _own(bytes(local))
    peer = _parse(bytes(raw))
    if peer.version != own.version:
        raise InvalidInputError(f"UCX worker address of format version {peer.version}; this process packs "
                                f"version {own.version} (UCX_ADDRESS_VERSION must agree)")
    if peer.flags & _DEBUG_INFO and not own.flags & _DEBUG_INFO:
        raise InvalidInputError("UCX worker address carries debug information, which this process does not pack")
    if peer.release != own.release or peer.empty_devices != own.empty_devices:
        raise InvalidInputError("UCX worker address is from another UCX release")
    own_shapes: dict[int, set[tuple]] = {}
    for t in own.transports:
        own_shapes.setdefault(t.csum, set()).add((t.shape, t.caps))
    own_loopback = any(t.csum == TL_CSUMS["tcp"] and t.dev_addr[0] == _TCP_LOOPBACK for t in own.transports)
    system_id = system_id_of_host() if local_peer is not None and any(t.name in _ONE_NODE_DEVICE for t in peer.transports) \
        else None
    md_transports: dict[int, set[str]] = {}
    for t in peer.transports:
        name = _check_transport(t, local_peer, system_id)
        if t.csum in own_shapes and (t.shape, t.caps) not in own_shapes[t.csum]:
            raise InvalidInputError(f"UCX worker address names a {name} transport unlike any of this process's "
                                    "(address lengths or capabilities differ: the peer runs other UCX settings)")
        if name == "tcp" and t.dev_addr[0] == _TCP_LOOPBACK and not own_loopback:
            raise InvalidInputError("UCX worker address names a tcp loopback device, and this process has none")
        md_transports.setdefault(t.md_index, set()).add(name)
    return PeerAddress({md: frozenset(names) for md, names in md_transports.items()}, local_peer)
