"""InfiniBand and RoCE entries of a packed UCX 1.21 worker address, and the
keys UCX 1.21's InfiniBand memory domains pack into a remote key, checked
in full before UCX reads them.

UCX reads these with no length: a transport takes its device, interface and
endpoint address at the size its own flags and structs give, so a short or
forged one makes it read past the buffer, and some values abort the process
(``ucs_fatal``, ``ucs_assert_always``).  What is accepted here is exactly
what UCX 1.21 can pack (tag v1.21.0; files below ``src/``), nothing more.

Device address: ``uct_ib_address_t`` (uct/ib/base/ib_device.h:110-154), as
``uct_ib_address_pack`` (uct/ib/base/ib_iface.c:426-489) writes it for the
flags ``uct_ib_iface_address_pack_flags`` (ib_iface.c:491-516) chooses, every
IB transport's device address (``uct_ib_iface_get_device_address``):

- InfiniBand: u8 flags | u16 lid | [u64 interface id: flag 0x40] |
  [u16 site-local subnet: 0x10 | u64 global subnet prefix: 0x20] |
  [u8 path MTU: 0x02] | [u16 pkey: 0x04], 3 to 22 bytes
  (``uct_ib_address_size``, ib_iface.c:367-412).  A global prefix comes only
  with the interface id (such a GID forces global addressing,
  ib_iface.c:1810-1822); a 64-bit prefix is never the link-local or a
  site-local one (those pack in 0 or 2 bytes); the interface id is never 0
  (an invalid GID, ib_device.c:1432-1435; UCX aborts on it,
  ib_iface.c:1049); the path MTU is packed only when it is not 4096, so it
  is ``enum ibv_mtu`` 1 to 4 (ib_iface.c:511, 1599-1622; an unknown one
  aborts in ``uct_ib_mtu_value``, ib_device.c:1251-1266); the pkey is packed
  only when it is not the default 0xffff and is never the invalid 0
  (ib_iface.c:485, 497, 1166-1170).
- RoCE: u8 flags (0x08 Ethernet, 0x10 IPv6, RoCE version in bits 5-7) |
  16-byte GID | [u8 path MTU: 0x02], 17 or 18 bytes.  The version is v1 (0)
  or v2 (2), the only ones ``uct_ib_device_query_gid_info`` and
  ``uct_ib_device_select_gid`` give (ib_device.c:932-970, 1220-1222); the
  IPv6 flag is the GID's family (``uct_ib_device_get_addr_family``,
  ib_device.c:915-930), except that the fallback GID (index 0) is declared
  v1 over IPv4 whatever it is; RoCE interfaces use the default pkey
  (ib_iface.c:1140-1144), so none carries one.
- Neither ever carries a GID index (flag 0x01: only RDMA-CM packs one,
  uct/ib/rdmacm/rdmacm_cm.c:509).

Interface and endpoint addresses (``iface_attr.iface_addr_len`` and
``ep_addr_len``; ``uct_ib_uint24_t`` is 3 bytes, uct/ib/base/ib_verbs.h:125):

- ``rc_mlx5``: interface 1 byte, the tag-matching type 0 or 1
  (uct/ib/mlx5/rc/rc_mlx5_iface.c:182, 628-654; rc_mlx5.h:28-36);
  endpoint ``uct_rc_mlx5_ep_address_t`` (qp, tm qp, atomic mr id), 7 bytes,
  or ``uct_rc_mlx5_ep_ext_address_t`` + u16 flush rkey, 10 bytes, whose flags
  are "flush rkey" (always) and "no atomic offset"
  (rc_mlx5.h:39-44, 78-95; rc_mlx5_iface.c:171-175; rc_mlx5_ep.c:655-687).
- ``rc_verbs``: no interface address (uct/ib/rc/base/rc_iface.c:181);
  endpoint ``uct_rc_verbs_ep_addr_t`` (flags 0, qp), 4 bytes, or
  ``uct_rc_verbs_ep_flush_addr_t``, 7 bytes, flags "has atomic mr" (always)
  and "no atomic offset" (uct/ib/rc/verbs/rc_verbs.h:25-49;
  rc_verbs_iface.c:221-223; rc_verbs_ep.c:584-603).  UCX reads the flush
  fields on the flag alone (rc_verbs_ep.c:661-673).
- ``dc_mlx5``: interface ``uct_dc_mlx5_iface_addr_t`` (dct, atomic mr id,
  flags), 5 bytes, or ``uct_dc_mlx5_iface_flush_addr_t`` (+ u16 flush rkey),
  7 bytes exactly when the flush-rkey flag is set (UCX reads it on the flag
  alone, uct/ib/mlx5/dc/dc_mlx5_ep.c:1262-1267); flags: tag matching, DC
  version (none for a device UCX does not list, v1 or v2, never both), flush
  rkey, max_rd_atomic 16, no atomic offset (dc_mlx5.h:75-118;
  dc_mlx5.c:236-242, 975-993, 1031-1062); no endpoint address.
- ``ud_mlx5``, ``ud_verbs``: interface ``uct_ud_iface_addr_t`` (qp), 3 bytes;
  endpoint ``uct_ud_ep_addr_t`` (qp, ep id), 6 bytes, whose ep id is never
  ``UCT_UD_EP_NULL_ID`` (uct/ib/ud/base/ud_def.h:223-231; ud_iface.c:748-749,
  762-770; ud_ep.c:504-513, 702; ud_ep.h:20; ud_inl.h:105).
- ``rc_gda`` (GPU-initiated RC, same device address): interface 1 byte, 0
  (basic); endpoint one 3-byte qp per channel, 1 to 256 channels, a power
  of 2 (uct/ib/mlx5/gdaki/gdaki.c:63-67, 683-700, 800-804).

Endpoint addresses: ``ucp_worker_get_address`` packs none
(ucp/wireup/address.c:1551-1552, ``ep == NULL``); only wireup messages carry
them, for the lanes a transport connects endpoint to endpoint
(address.c:1379-1438; wireup.c:320-328).  :func:`check_ib_entry` refuses any
in a worker address, and checks them at the sizes above with
``wireup=True``.

Keys: the verbs, mlx5 (dv) and DevX memory domains all pack 8 bytes into a
remote key, ``rkey_packed_size`` (uct/ib/base/ib_md.c:267, ib_md.h:18): the
direct rkey and the atomic rkey, u32 each (``uct_ib_md_pack_rkey``,
ib_md.h:279-285; ib_md.c:742-762; uct/ib/mlx5/dv/ib_mlx5dv_md.c:2914-3007,
3132-3150, 3411-3425).  UCP unpacks a key with its memory domain's
component whatever length the packed key gives it (ucp/core/ucp_rkey.c:
985-1019), and ``uct_ib_rkey_unpack`` reads 8 bytes.

Multi-byte fields are as UCX writes them on a little-endian host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from .._errors import InvalidInputError

__all__ = [
    "IB_TRANSPORTS",
    "IB_KEY_SIZE",
    "check_ib_entry",
    "check_ib_md_key",
    "pack_ib_address",
    "pack_roce_address",
    "pack_rc_mlx5_iface",
    "pack_rc_mlx5_ep",
    "pack_rc_verbs_ep",
    "pack_dc_mlx5_iface",
    "pack_ud_iface",
    "pack_ud_ep",
    "pack_rc_gda_iface",
    "pack_rc_gda_ep",
    "pack_ib_md_key",
]

#: The InfiniBand/RoCE transports whose entries :func:`check_ib_entry` checks.
IB_TRANSPORTS = ("rc_mlx5", "dc_mlx5", "ud_mlx5", "rc_verbs", "ud_verbs", "rc_gda")
#: The size of an IB memory domain's key in a packed remote key.
IB_KEY_SIZE = 8

# uct_ib_address_t flags (ib_device.h:110-133).
_GID_INDEX, _PATH_MTU, _PKEY, _ETH = 0x01, 0x02, 0x04, 0x08
_ROCE_IPV6, _ROCE_VER_SHIFT = 0x10, 5
_SUBNET16, _SUBNET64, _IF_ID = 0x10, 0x20, 0x40
_IB_PACKED_FLAGS = _IF_ID | _SUBNET16 | _SUBNET64 | _PATH_MTU | _PKEY
_ROCE_V1, _ROCE_V2 = 0, 2  # uct_ib_roce_version_t (ib_device.h:85-90)
_IBV_MTU_4096 = 5
_MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048}  # enum ibv_mtu values packed (4096 is not)
_DEFAULT_PKEY, _INVALID_PKEY = 0xFFFF, 0
_LINK_LOCAL = bytes.fromhex("fe80000000000000")  # UCT_IB_LINK_LOCAL_PREFIX (ib_device.h:53)
_SITE_LOCAL = bytes.fromhex("fec000000000")  # UCT_IB_SITE_LOCAL_PREFIX under its mask (ib_device.h:54-55)
_GID = 16
# rc_mlx5 (rc_mlx5.h:28-44)
_RC_MLX5_TYPES = {0: "basic", 1: "hardware tag matching"}
_RC_MLX5_EP, _RC_MLX5_EP_EXT = 7, 10
_RC_MLX5_FLUSH_RKEY, _RC_MLX5_NO_ATOMIC_OFFSET = 0x01, 0x02
# rc_verbs (rc_verbs.h:25-49)
_RC_VERBS_EP, _RC_VERBS_EP_FLUSH = 4, 7
_RC_VERBS_HAS_ATOMIC_MR, _RC_VERBS_NO_ATOMIC_OFFSET = 0x01, 0x02
# dc_mlx5 (dc_mlx5.h:75-118)
_DC_IFACE, _DC_IFACE_FLUSH = 5, 7
_DC_HW_TM, _DC_V1, _DC_V2, _DC_FLUSH_RKEY, _DC_RD_ATOMIC_16, _DC_NO_ATOMIC_OFFSET = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_DC_VERSIONS = {0: 0, 1: _DC_V1, 2: _DC_V2}
_DC_KNOWN = 0x3F
# ud (ud_def.h:223-231, ud_ep.h:20)
_UD_IFACE, _UD_EP, _UD_EP_NULL_ID = 3, 6, 0xFFFFFF
# rc_gda (gdaki.c:63-67, 803-804)
_GDA_EP_LENGTHS = frozenset(3 << k for k in range(9))


def _a(name: str) -> str:
    return f"an {name}" if name.startswith("rc") else f"a {name}"


def _u24(value: int) -> bytes:
    """``uct_ib_pack_uint24`` (ib_verbs.h:127-132)."""
    return (value & 0xFFFFFF).to_bytes(3, "little")


def _gid_is_ipv4(gid: bytes) -> bool:
    """``uct_ib_device_get_addr_family`` (ib_device.c:915-930): an IPv4-mapped
    GID, or an IPv4-encoded multicast one."""
    return gid[8:12] == b"\x00\x00\xff\xff" and not any(gid[4:8]) and (
        not any(gid[:4]) or gid[:4] == b"\xff\x0e\x00\x00")


class _Fail:
    __slots__ = ("prefix",)

    def __init__(self, what: str, name: str) -> None:
        self.prefix = f"{what} names {_a(name)}"

    def __call__(self, text: str) -> InvalidInputError:
        return InvalidInputError(f"{self.prefix} {text}")


# ------------------------------------------------------------------ the device address


def _mtu(fail: _Fail, kind: str, mtu: int) -> None:
    if mtu not in _MTUS:
        raise fail(f"{kind} device address with path MTU {mtu}; UCX 1.21 packs 1 to 4 (256 to 2048 bytes; "
                   "4096 is not packed) and aborts on an unknown one")


def _ib_device(fail: _Fail, dev: bytes) -> None:
    flags = dev[0]
    unknown = flags & ~_IB_PACKED_FLAGS
    if unknown:
        raise fail(f"InfiniBand device address with unknown flags {unknown:#04x} (of {flags:#04x}); UCX 1.21 packs "
                   "only interface id 0x40, subnet 0x10 or 0x20, path MTU 0x02 and pkey 0x04 (a GID index 0x01 only "
                   "for RDMA-CM)")
    if flags & _SUBNET16 and flags & _SUBNET64:
        raise fail(f"InfiniBand device address with both a 16- and a 64-bit subnet prefix (flags {flags:#04x}); "
                   "UCX 1.21 packs at most one")
    if flags & _SUBNET64 and not flags & _IF_ID:
        raise fail(f"InfiniBand device address with a 64-bit subnet prefix and no interface id (flags {flags:#04x}); "
                   "UCX 1.21 packs a global prefix only with the interface id")
    expected = (3 + 8 * bool(flags & _IF_ID) + 2 * bool(flags & _SUBNET16) + 8 * bool(flags & _SUBNET64)
                + bool(flags & _PATH_MTU) + 2 * bool(flags & _PKEY))
    if len(dev) != expected:
        raise fail(f"InfiniBand device address of {len(dev)} bytes; UCX 1.21 packs {expected} for its flags "
                   f"{flags:#04x}")
    pos = 3
    if flags & _IF_ID:
        if not any(dev[pos:pos + 8]):
            raise fail("InfiniBand device address with interface id 0; UCX 1.21 packs only a valid GID's, "
                       "and aborts on a zero one")
        pos += 8
    if flags & _SUBNET16:
        pos += 2
    if flags & _SUBNET64:
        prefix = dev[pos:pos + 8]
        if prefix == _LINK_LOCAL or prefix[:6] == _SITE_LOCAL:
            raise fail(f"InfiniBand device address with the 64-bit subnet prefix {prefix.hex()}; UCX 1.21 packs a "
                       "link-local prefix in 0 bytes and a site-local one in 2")
        pos += 8
    if flags & _PATH_MTU:
        _mtu(fail, "InfiniBand", dev[pos])
        pos += 1
    if flags & _PKEY:
        pkey = int.from_bytes(dev[pos:pos + 2], "little")
        if pkey in (_DEFAULT_PKEY, _INVALID_PKEY):
            raise fail(f"InfiniBand device address with pkey {pkey:#06x}; UCX 1.21 packs a pkey other than the "
                       "default 0xffff (not packed) and the invalid 0")


def _roce_device(fail: _Fail, dev: bytes) -> None:
    flags = dev[0]
    if flags & (_GID_INDEX | _PKEY):
        field = "a GID index" if flags & _GID_INDEX else "a pkey"
        raise fail(f"RoCE device address with {field} (flags {flags:#04x}); UCX 1.21 packs neither for RoCE "
                   "(its RoCE interfaces use the default pkey; a GID index only RDMA-CM packs)")
    version = flags >> _ROCE_VER_SHIFT
    if version not in (_ROCE_V1, _ROCE_V2):
        raise fail(f"RoCE device address of RoCE version {version} (flags {flags:#04x}); UCX 1.21 packs "
                   f"{_ROCE_V1} (v1) or {_ROCE_V2} (v2)")
    expected = 1 + _GID + bool(flags & _PATH_MTU)
    if len(dev) != expected:
        raise fail(f"RoCE device address of {len(dev)} bytes; UCX 1.21 packs {expected} for its flags {flags:#04x}")
    gid = dev[1:1 + _GID]
    if not any(gid[8:]):
        raise fail(f"RoCE device address with the GID {gid.hex()}, whose interface id is 0; UCX 1.21 packs only "
                   "valid GIDs, and aborts on such one")
    ipv4 = _gid_is_ipv4(gid)
    if flags & _ROCE_IPV6 and ipv4:
        raise fail(f"RoCE device address marked IPv6 with the IPv4 GID {gid.hex()}; UCX 1.21 marks a GID "
                   "with its own family")
    if not flags & _ROCE_IPV6 and version == _ROCE_V2 and not ipv4:
        raise fail(f"RoCE v2 device address marked IPv4 with the IPv6 GID {gid.hex()}; UCX 1.21 marks a GID "
                   "with its own family")
    if flags & _PATH_MTU:
        _mtu(fail, "RoCE", dev[1 + _GID])


def _device(fail: _Fail, dev: bytes) -> None:
    if not dev:
        raise fail("device address of 0 bytes; UCX 1.21 packs an InfiniBand address of 3 to 22 bytes or a RoCE one "
                   "of 17 or 18")
    if dev[0] & _ETH:
        _roce_device(fail, dev)
    else:
        _ib_device(fail, dev)


# ------------------------------------------------------------------ interface and endpoint addresses


def _length(fail: _Fail, kind: str, data: bytes, lengths: tuple[int, ...], why: str) -> None:
    if len(data) not in lengths:
        raise fail(f"{kind} address of {len(data)} bytes; UCX 1.21 packs "
                   f"{' or '.join(map(str, lengths))} ({why})")


def _rc_mlx5_iface(fail: _Fail, iface: bytes) -> None:
    _length(fail, "interface", iface, (1,), "the tag-matching type")
    if iface[0] not in _RC_MLX5_TYPES:
        raise fail(f"interface address of type {iface[0]}; UCX 1.21 packs 0 (basic) or 1 (hardware tag matching)")


def _rc_gda_iface(fail: _Fail, iface: bytes) -> None:
    _length(fail, "interface", iface, (1,), "the tag-matching type")
    if iface[0] != 0:
        raise fail(f"interface address of type {iface[0]}; UCX 1.21 packs 0 (basic)")


def _rc_verbs_iface(fail: _Fail, iface: bytes) -> None:
    _length(fail, "interface", iface, (0,), "none")


def _dc_mlx5_iface(fail: _Fail, iface: bytes) -> None:
    _length(fail, "interface", iface, (_DC_IFACE, _DC_IFACE_FLUSH), "dct, atomic mr id, flags and with the flush "
            "flag the flush rkey")
    flags = iface[4]
    if flags & ~_DC_KNOWN:
        raise fail(f"interface address with unknown flags {flags & ~_DC_KNOWN:#04x} (of {flags:#04x}); UCX 1.21 "
                   f"packs only flags from {_DC_KNOWN:#04x}")
    if flags & (_DC_V1 | _DC_V2) == _DC_V1 | _DC_V2:
        raise fail(f"interface address of both DC versions 1 and 2 (flags {flags:#04x}); UCX 1.21 packs one or none")
    flush = bool(flags & _DC_FLUSH_RKEY)
    if flush != (len(iface) == _DC_IFACE_FLUSH):
        raise fail(f"interface address of {len(iface)} bytes {'with' if flush else 'without'} the flush-rkey flag "
                   f"(flags {flags:#04x}); UCX 1.21 packs {_DC_IFACE} bytes without it and {_DC_IFACE_FLUSH} with it")


def _ud_iface(fail: _Fail, iface: bytes) -> None:
    _length(fail, "interface", iface, (_UD_IFACE,), "the qp")


def _flags(fail: _Fail, ep: bytes, pos: int, allowed: tuple[int, ...], what: str) -> None:
    if ep[pos] not in allowed:
        raise fail(f"{len(ep)}-byte endpoint address with flags {ep[pos]:#04x}; UCX 1.21 packs "
                   f"{' or '.join(f'{f:#04x}' for f in allowed)} there ({what})")


def _rc_mlx5_ep(fail: _Fail, ep: bytes) -> None:
    _length(fail, "endpoint", ep, (_RC_MLX5_EP, _RC_MLX5_EP_EXT), "qp, tm qp, atomic mr id; with the flush rkey, "
            "flags and the flush rkey")
    if len(ep) == _RC_MLX5_EP_EXT:
        _flags(fail, ep, 7, (_RC_MLX5_FLUSH_RKEY, _RC_MLX5_FLUSH_RKEY | _RC_MLX5_NO_ATOMIC_OFFSET),
               "flush rkey, and no atomic offset")


def _rc_verbs_ep(fail: _Fail, ep: bytes) -> None:
    _length(fail, "endpoint", ep, (_RC_VERBS_EP, _RC_VERBS_EP_FLUSH), "flags and qp; with the flush rkey, atomic "
            "mr id and the flush rkey")
    if len(ep) == _RC_VERBS_EP:
        _flags(fail, ep, 0, (0,), "none without the flush rkey")
    else:
        _flags(fail, ep, 0, (_RC_VERBS_HAS_ATOMIC_MR, _RC_VERBS_HAS_ATOMIC_MR | _RC_VERBS_NO_ATOMIC_OFFSET),
               "has atomic mr, and no atomic offset")


def _ud_ep(fail: _Fail, ep: bytes) -> None:
    _length(fail, "endpoint", ep, (_UD_EP,), "qp and endpoint id")
    if int.from_bytes(ep[3:6], "little") == _UD_EP_NULL_ID:
        raise fail(f"endpoint address with the null endpoint id {_UD_EP_NULL_ID:#x}; UCX 1.21 packs a live "
                   "endpoint's id, and asserts on this one")


def _rc_gda_ep(fail: _Fail, ep: bytes) -> None:
    if len(ep) not in _GDA_EP_LENGTHS:
        raise fail(f"endpoint address of {len(ep)} bytes; UCX 1.21 packs a 3-byte qp per channel, 1 to 256 channels, "
                   "a power of 2")


class _Rules(NamedTuple):
    iface: Callable[[_Fail, bytes], None]
    ep: Callable[[_Fail, bytes], None] | None  # None: UCX never packs one (the transport connects to interfaces)


_RULES = {
    "rc_mlx5": _Rules(_rc_mlx5_iface, _rc_mlx5_ep),
    "dc_mlx5": _Rules(_dc_mlx5_iface, None),
    "ud_mlx5": _Rules(_ud_iface, _ud_ep),
    "rc_verbs": _Rules(_rc_verbs_iface, _rc_verbs_ep),
    "ud_verbs": _Rules(_ud_iface, _ud_ep),
    "rc_gda": _Rules(_rc_gda_iface, _rc_gda_ep),
}


def check_ib_entry(name: str, dev_addr: bytes, iface_addr: bytes, ep_addrs: tuple[bytes, ...], *,
                   wireup: bool = False) -> None:
    """Raise :class:`InvalidInputError` unless the device address, interface
    address and endpoint addresses of transport ``name`` (one of
    :data:`IB_TRANSPORTS`) are exactly what UCX 1.21 packs for it (see the
    module notes).  A worker address carries no endpoint address;
    ``wireup=True`` checks those a wireup message carries instead."""
    what = "UCX wireup address" if wireup else "UCX worker address"
    rules = _RULES.get(name)
    if rules is None:
        raise InvalidInputError(f"{what} names the transport {name!r} where an InfiniBand one was expected "
                                f"({', '.join(IB_TRANSPORTS)})")
    fail = _Fail(what, name)
    _device(fail, bytes(dev_addr))
    rules.iface(fail, bytes(iface_addr))
    eps = [bytes(ep) for ep in ep_addrs]
    if not eps:
        return
    if not wireup:
        raise fail(f"interface with {len(eps)} endpoint addresses; UCX 1.21 packs none into a worker address")
    if rules.ep is None:
        raise fail(f"interface with {len(eps)} endpoint addresses; UCX 1.21 connects {name} to interfaces and "
                   "packs none")
    lengths = sorted({len(ep) for ep in eps})
    if len(lengths) > 1:
        raise fail(f"interface with endpoint addresses of {' and '.join(map(str, lengths))} bytes; UCX 1.21 packs "
                   "all of one interface at one length")
    for ep in eps:
        rules.ep(fail, ep)


def check_ib_md_key(key: bytes) -> None:
    """Raise :class:`InvalidInputError` unless ``key`` (what follows the
    tl_size byte of an InfiniBand memory domain in a packed remote key) is
    the 8 bytes UCX 1.21's IB memory domains pack: direct rkey, atomic rkey."""
    if len(key) != IB_KEY_SIZE:
        raise InvalidInputError(f"packed remote key's InfiniBand key is {len(key)} bytes; UCX 1.21's IB memory "
                                f"domains (verbs, mlx5, DevX) pack {IB_KEY_SIZE}: a direct and an atomic rkey")


# ------------------------------------------------------------------ packers, as UCX 1.21 packs


def pack_ib_address(lid: int, *, interface_id: bytes | None = None, subnet_prefix: bytes = _LINK_LOCAL,
                    path_mtu: int = _IBV_MTU_4096, pkey: int = _DEFAULT_PKEY) -> bytes:
    """An InfiniBand device address as ``uct_ib_iface_address_pack`` packs it:
    ``interface_id`` (8 bytes of the GID) given when the interface forces
    global addressing; ``subnet_prefix`` the GID's first 8 bytes;
    ``path_mtu`` an ``enum ibv_mtu`` value; ``pkey`` the interface's."""
    flags, fields = 0, [lid.to_bytes(2, "little")]
    if interface_id is not None:
        flags |= _IF_ID
        fields.append(bytes(interface_id))
    if subnet_prefix[:6] == _SITE_LOCAL:
        flags |= _SUBNET16
        fields.append(bytes(subnet_prefix[6:8]))
    elif bytes(subnet_prefix) != _LINK_LOCAL:
        flags |= _SUBNET64
        fields.append(bytes(subnet_prefix))
    if path_mtu != _IBV_MTU_4096:
        flags |= _PATH_MTU
        fields.append(bytes([path_mtu]))
    if pkey != _DEFAULT_PKEY:
        flags |= _PKEY
        fields.append(pkey.to_bytes(2, "little"))
    return bytes([flags]) + b"".join(fields)


def pack_roce_address(gid: bytes, *, version: int = _ROCE_V2, ipv6: bool | None = None,
                      path_mtu: int = _IBV_MTU_4096) -> bytes:
    """A RoCE device address as ``uct_ib_iface_address_pack`` packs it;
    ``ipv6`` defaults to the GID's family."""
    if ipv6 is None:
        ipv6 = not _gid_is_ipv4(bytes(gid))
    flags = _ETH | version << _ROCE_VER_SHIFT | (_ROCE_IPV6 if ipv6 else 0)
    tail = b""
    if path_mtu != _IBV_MTU_4096:
        flags |= _PATH_MTU
        tail = bytes([path_mtu])
    return bytes([flags]) + bytes(gid) + tail


def pack_rc_mlx5_iface(tm: bool = False) -> bytes:
    """``uct_rc_mlx5_iface_get_address``."""
    return bytes([1 if tm else 0])


def pack_rc_mlx5_ep(qp_num: int, *, tm_qp_num: int = 0, atomic_mr_id: int = 0, flush_rkey_hi: int | None = None,
                    no_atomic_offset: bool = False) -> bytes:
    """``uct_rc_mlx5_ep_get_address``: 10 bytes with the flush rkey's upper 16 bits, else 7."""
    ep = _u24(qp_num) + _u24(tm_qp_num) + bytes([atomic_mr_id])
    if flush_rkey_hi is None:
        return ep
    flags = _RC_MLX5_FLUSH_RKEY | (_RC_MLX5_NO_ATOMIC_OFFSET if no_atomic_offset else 0)
    return ep + bytes([flags]) + flush_rkey_hi.to_bytes(2, "little")


def pack_rc_verbs_ep(qp_num: int, *, atomic_mr_id: int = 0, flush_rkey_hi: int | None = None,
                     no_atomic_offset: bool = False) -> bytes:
    """``uct_rc_verbs_ep_get_address``: 7 bytes with the flush rkey, else 4."""
    if flush_rkey_hi is None:
        return b"\x00" + _u24(qp_num)
    flags = _RC_VERBS_HAS_ATOMIC_MR | (_RC_VERBS_NO_ATOMIC_OFFSET if no_atomic_offset else 0)
    return bytes([flags]) + _u24(qp_num) + bytes([atomic_mr_id]) + flush_rkey_hi.to_bytes(2, "little")


def pack_dc_mlx5_iface(dct_num: int, *, atomic_mr_id: int = 0, dc_version: int = 2, tm: bool = False,
                       flush_rkey_hi: int | None = None, max_rd_atomic_16: bool = False,
                       no_atomic_offset: bool = False) -> bytes:
    """``uct_dc_mlx5_iface_get_address``; ``dc_version`` 0 (a device UCX does not list), 1 or 2."""
    flags = _DC_VERSIONS[dc_version]
    flags |= (_DC_HW_TM if tm else 0) | (_DC_RD_ATOMIC_16 if max_rd_atomic_16 else 0)
    flags |= _DC_NO_ATOMIC_OFFSET if no_atomic_offset else 0
    tail = b""
    if flush_rkey_hi is not None:
        flags |= _DC_FLUSH_RKEY
        tail = flush_rkey_hi.to_bytes(2, "little")
    return _u24(dct_num) + bytes([atomic_mr_id, flags]) + tail


def pack_ud_iface(qp_num: int) -> bytes:
    """``uct_ud_iface_get_address``."""
    return _u24(qp_num)


def pack_ud_ep(qp_num: int, ep_id: int) -> bytes:
    """``uct_ud_ep_get_address``."""
    return _u24(qp_num) + _u24(ep_id)


def pack_rc_gda_iface() -> bytes:
    """``uct_rc_gdaki_iface_get_address``."""
    return b"\x00"


def pack_rc_gda_ep(qp_nums: Sequence[int]) -> bytes:
    """``uct_rc_gdaki_ep_get_address``: one qp per channel."""
    return b"".join(_u24(qp) for qp in qp_nums)


def pack_ib_md_key(rkey: int, atomic_rkey: int = 0xFFFFFFFF) -> bytes:
    """``uct_ib_md_pack_rkey``: an IB memory domain's key in a packed remote
    key (atomic rkey 0xffffffff: none)."""
    return (atomic_rkey << 32 | rkey).to_bytes(8, "little")
