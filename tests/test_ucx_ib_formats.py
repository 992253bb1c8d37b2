"""InfiniBand and RoCE entries of UCX 1.21 worker addresses, and IB memory
keys, as ``gpushare._ucx._ib`` checks them: every variant UCX 1.21 packs
passes; each field wrong, short, long or with unknown flags is refused with
an error that leads with the reason; and a seeded fuzz run mutates valid
entries and keys and requires the validators to return or raise
:class:`InvalidInputError`, nothing else, accepting only what re-packs to
the same bytes.  No network and no InfiniBand hardware: the bytes are built
the way UCX 1.21 packs them (``_ib.pack_*``).

``GPUSHARE_FUZZ_CASES`` sets the fuzz run's case count (default 3000).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpushare._errors import InvalidInputError
from gpushare._ucx import _ib

LID = 0x1234
GUID = bytes.fromhex("0002c90300a1b2c3")
LINK_LOCAL = bytes.fromhex("fe80000000000000")
SITE_LOCAL = bytes.fromhex("fec000000000beef")
SITE_LOCAL_FLID = bytes.fromhex("fec0000000070001")  # site-local with a FLID: packed in 8 bytes
GLOBAL = bytes.fromhex("2001db8000010002")
IPV4_GID = bytes(10) + b"\xff\xff" + bytes([192, 168, 1, 7])
IPV4_MCAST_GID = b"\xff\x0e\x00\x00" + bytes(4) + b"\x00\x00\xff\xff" + bytes([224, 0, 0, 9])
IPV6_GID = bytes.fromhex("20010db8000000000202c9fffe0a0b0c")
IPV6_LL_GID = bytes.fromhex("fe800000000000000202c9fffe0a0b0c")
MTU_4096 = 5  # IBV_MTU_4096: not packed
MTUS = (MTU_4096, 1, 2, 3, 4)
PKEYS = (0xFFFF, 0x8001, 0x7FFF, 0x0001)  # default (not packed), full, limited members
QP = 0x0A0B0C


def ib_devices() -> list[bytes]:
    out = []
    for iid in (None, GUID):
        prefixes = [LINK_LOCAL, SITE_LOCAL] + ([GLOBAL, SITE_LOCAL_FLID] if iid else [])
        for prefix in prefixes:
            for mtu in MTUS:
                for pkey in PKEYS:
                    out.append(_ib.pack_ib_address(LID, interface_id=iid, subnet_prefix=prefix, path_mtu=mtu,
                                                   pkey=pkey))
    return out


def roce_devices() -> list[bytes]:
    gids = [(IPV4_GID, 2, None), (IPV4_MCAST_GID, 2, None), (IPV6_GID, 2, None), (IPV6_LL_GID, 2, None),
            (IPV4_GID, 0, None), (IPV6_GID, 0, None),
            (IPV6_LL_GID, 0, False)]  # the fallback: gid index 0 declared RoCE v1 over IPv4
    return [_ib.pack_roce_address(gid, version=v, ipv6=ipv6, path_mtu=mtu) for gid, v, ipv6 in gids for mtu in MTUS]


IB_DEVICES, ROCE_DEVICES = ib_devices(), roce_devices()
DEVICES = IB_DEVICES + ROCE_DEVICES


def dc_ifaces() -> list[bytes]:
    return [_ib.pack_dc_mlx5_iface(0x00ABCD, atomic_mr_id=mr, dc_version=v, tm=tm, flush_rkey_hi=flush,
                                   max_rd_atomic_16=rd16, no_atomic_offset=noao)
            for v in (0, 1, 2) for tm in (False, True) for flush in (None, 0xBEEF) for rd16 in (False, True)
            for noao in (False, True) for mr in (0, 0x12)]


IFACES: dict[str, list[bytes]] = {
    "rc_mlx5": [_ib.pack_rc_mlx5_iface(False), _ib.pack_rc_mlx5_iface(True)],
    "dc_mlx5": dc_ifaces(),
    "ud_mlx5": [_ib.pack_ud_iface(QP), _ib.pack_ud_iface(0)],
    "rc_verbs": [b""],
    "ud_verbs": [_ib.pack_ud_iface(QP)],
    "rc_gda": [_ib.pack_rc_gda_iface()],
}
EPS: dict[str, list[bytes]] = {
    "rc_mlx5": [_ib.pack_rc_mlx5_ep(QP, tm_qp_num=0x0D0E0F, atomic_mr_id=0x12),
                _ib.pack_rc_mlx5_ep(QP, atomic_mr_id=0x12, flush_rkey_hi=0xBEEF),
                _ib.pack_rc_mlx5_ep(QP, flush_rkey_hi=0, no_atomic_offset=True)],
    "dc_mlx5": [],
    "ud_mlx5": [_ib.pack_ud_ep(QP, 0), _ib.pack_ud_ep(QP, 0xFFFFFE)],
    "rc_verbs": [_ib.pack_rc_verbs_ep(QP), _ib.pack_rc_verbs_ep(QP, atomic_mr_id=0x12, flush_rkey_hi=0xBEEF),
                 _ib.pack_rc_verbs_ep(QP, flush_rkey_hi=1, no_atomic_offset=True)],
    "ud_verbs": [_ib.pack_ud_ep(QP, 7)],
    "rc_gda": [_ib.pack_rc_gda_ep(range(QP, QP + (1 << k))) for k in range(9)],
}


def refused(pattern: str, fn: Callable[..., None], *args: object, **kwargs: object) -> str:
    """Call ``fn``; it must raise InvalidInputError whose message matches ``pattern`` from its start."""
    with pytest.raises(InvalidInputError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert re.match(pattern, message), f"{message!r} does not lead with {pattern!r}"
    return message


def article(name: str) -> str:
    return "an" if name.startswith("rc") else "a"


# ------------------------------------------------------------------ what UCX 1.21 packs passes


def test_the_transports_covered():
    assert _ib.IB_TRANSPORTS == ("rc_mlx5", "dc_mlx5", "ud_mlx5", "rc_verbs", "ud_verbs", "rc_gda")
    assert set(IFACES) == set(EPS) == set(_ib.IB_TRANSPORTS)


def test_device_address_lengths_are_those_uct_ib_address_size_gives():
    assert {len(d) for d in IB_DEVICES} == {3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 19, 20, 21, 22}
    assert {len(d) for d in ROCE_DEVICES} == {17, 18}
    # flags as uct_ib_address_pack sets them
    assert _ib.pack_ib_address(LID) == b"\x00\x34\x12"
    assert _ib.pack_ib_address(LID, subnet_prefix=SITE_LOCAL)[0] == 0x10
    assert _ib.pack_ib_address(LID, interface_id=GUID, subnet_prefix=GLOBAL, path_mtu=3, pkey=0x8001)[0] == 0x66
    assert _ib.pack_roce_address(IPV4_GID)[0] == 0x48  # Ethernet | v2 << 5
    assert _ib.pack_roce_address(IPV6_GID, version=0, path_mtu=3)[0] == 0x1A


@pytest.mark.parametrize("name", _ib.IB_TRANSPORTS)
def test_every_device_address_variant_passes(name):
    for dev in DEVICES:
        assert _ib.check_ib_entry(name, dev, IFACES[name][0], ()) is None


@pytest.mark.parametrize("name", _ib.IB_TRANSPORTS)
def test_every_interface_address_variant_passes(name):
    assert {len(i) for i in IFACES[name]} == {"rc_mlx5": {1}, "dc_mlx5": {5, 7}, "ud_mlx5": {3}, "rc_verbs": {0},
                                              "ud_verbs": {3}, "rc_gda": {1}}[name]
    for iface in IFACES[name]:
        for dev in (IB_DEVICES[0], ROCE_DEVICES[-1]):
            _ib.check_ib_entry(name, dev, iface, ())


@pytest.mark.parametrize("name", _ib.IB_TRANSPORTS)
def test_every_endpoint_address_variant_passes_in_a_wireup_address(name):
    assert {len(e) for e in EPS[name]} == {"rc_mlx5": {7, 10}, "dc_mlx5": set(), "ud_mlx5": {6}, "rc_verbs": {4, 7},
                                           "ud_verbs": {6}, "rc_gda": {3 << k for k in range(9)}}[name]
    for ep in EPS[name]:
        for count in (1, 2, 5):
            _ib.check_ib_entry(name, IB_DEVICES[5], IFACES[name][-1], (ep,) * count, wireup=True)
    _ib.check_ib_entry(name, IB_DEVICES[5], IFACES[name][-1], (), wireup=True)  # a transport with no lane


def test_ib_md_keys_of_8_bytes_pass():
    assert _ib.pack_ib_md_key(0x11223344) == bytes.fromhex("44332211ffffffff")
    assert _ib.pack_ib_md_key(0x11223344, 0x55667788) == bytes.fromhex("4433221188776655")
    for key in (_ib.pack_ib_md_key(0x1F00), _ib.pack_ib_md_key(0, 0), bytes(8), b"\xff" * 8, bytearray(8)):
        assert _ib.check_ib_md_key(key) is None


# ------------------------------------------------------------------ the device address, refused


def one_off(dev: bytes) -> list[bytes]:
    return [dev[:-1], dev + b"\x01", dev + bytes(8)]


@pytest.mark.parametrize("name", _ib.IB_TRANSPORTS)
def test_device_address_of_the_wrong_length_is_refused(name):
    iface = IFACES[name][0]
    refused(rf"^UCX worker address names {article(name)} {name} device address of 0 bytes; UCX 1\.21 packs an "
            "InfiniBand address of 3 to 22 bytes or a RoCE one of 17 or 18", _ib.check_ib_entry, name, b"", iface, ())
    for dev in DEVICES:
        kind = "RoCE" if dev[0] & 0x08 else "InfiniBand"
        for bad in one_off(dev):
            if not bad:
                continue
            refused(rf"^UCX worker address names {article(name)} {name} {kind} device address of {len(bad)} bytes; "
                    rf"UCX 1\.21 packs {len(dev)} for its flags {dev[0]:#04x}$", _ib.check_ib_entry, name, bad, iface,
                    ())


def ib_dev(**fields: Any) -> bytes:
    return _ib.pack_ib_address(LID, **fields)


def replace(data: bytes, pos: int, new: bytes) -> bytes:
    return data[:pos] + new + data[pos + len(new):]


IB_REFUSED = [
    # unknown flag bits, and the GID index UCX packs only for RDMA-CM
    (bytes([0x80]) + ib_dev()[1:], r"InfiniBand device address with unknown flags 0x80 \(of 0x80\); UCX 1\.21 packs "
     "only interface id 0x40, subnet 0x10 or 0x20, path MTU 0x02 and pkey 0x04"),
    (bytes([0x01]) + ib_dev()[1:] + b"\x00", r"InfiniBand device address with unknown flags 0x01 \(of 0x01\); "
     r"UCX 1\.21 packs only .*\(a GID index 0x01 only for RDMA-CM\)$"),
    (bytes([0xC6]) + ib_dev(interface_id=GUID, path_mtu=3, pkey=0x8001)[1:], r"InfiniBand device address with unknown "
     r"flags 0x80 \(of 0xc6\); UCX 1\.21 packs only"),
    # subnet prefixes
    (bytes([0x70]) + ib_dev(interface_id=GUID, subnet_prefix=GLOBAL)[1:] + b"\x00\x00", r"InfiniBand device address "
     r"with both a 16- and a 64-bit subnet prefix \(flags 0x70\); UCX 1\.21 packs at most one"),
    (b"\x20" + LID.to_bytes(2, "little") + GLOBAL, r"InfiniBand device address with a 64-bit subnet prefix and no "
     r"interface id \(flags 0x20\); UCX 1\.21 packs a global prefix only with the interface id"),
    (b"\x60" + LID.to_bytes(2, "little") + GUID + LINK_LOCAL, r"InfiniBand device address with the 64-bit subnet "
     r"prefix fe80000000000000; UCX 1\.21 packs a link-local prefix in 0 bytes and a site-local one in 2"),
    (b"\x60" + LID.to_bytes(2, "little") + GUID + SITE_LOCAL, r"InfiniBand device address with the 64-bit subnet "
     r"prefix fec000000000beef; UCX 1\.21 packs"),
    # the interface id
    (replace(ib_dev(interface_id=GUID), 3, bytes(8)), r"InfiniBand device address with interface id 0; UCX 1\.21 "
     "packs only a valid GID's, and aborts on a zero one"),
    (replace(ib_dev(interface_id=GUID, subnet_prefix=GLOBAL), 3, bytes(8)), r"InfiniBand device address with "
     "interface id 0"),
    # path MTU: 4096 is not packed, 0 and above are no ibv_mtu
    *[(ib_dev(path_mtu=mtu), rf"InfiniBand device address with path MTU {mtu}; UCX 1\.21 packs 1 to 4 \(256 to 2048 "
       r"bytes; 4096 is not packed\) and aborts on an unknown one") for mtu in (0, 6, 7, 0x80, 0xFF)],
    (replace(ib_dev(path_mtu=3), 3, b"\x05"), r"InfiniBand device address with path MTU 5; "),
    # pkey: the default is not packed, 0 is invalid
    (replace(ib_dev(pkey=0x8001), 3, b"\xff\xff"), r"InfiniBand device address with pkey 0xffff; UCX 1\.21 packs a "
     r"pkey other than the default 0xffff \(not packed\) and the invalid 0"),
    (replace(ib_dev(subnet_prefix=SITE_LOCAL, path_mtu=2, pkey=0x8001), 6, b"\x00\x00"), r"InfiniBand device address "
     "with pkey 0x0000"),
]

ROCE_REFUSED = [
    (bytes([0x49]) + IPV4_GID + b"\x03", r"RoCE device address with a GID index \(flags 0x49\); UCX 1\.21 packs "
     r"neither for RoCE \(its RoCE interfaces use the default pkey"),
    (bytes([0x4C]) + IPV4_GID + b"\x01\x80", r"RoCE device address with a pkey \(flags 0x4c\); UCX 1\.21 packs "
     "neither for RoCE"),
    *[(bytes([0x08 | v << 5]) + IPV6_GID, rf"RoCE device address of RoCE version {v} \(flags {0x08 | v << 5:#04x}\); "
       r"UCX 1\.21 packs 0 \(v1\) or 2 \(v2\)") for v in (1, 3, 4, 5, 6, 7)],
    (_ib.pack_roce_address(IPV6_GID[:8] + bytes(8)), r"RoCE device address with the GID 20010db8000000000{16}, "
     r"whose interface id is 0; UCX 1\.21 packs only valid GIDs, and aborts on such one"),
    (_ib.pack_roce_address(IPV4_GID, ipv6=True), r"RoCE device address marked IPv6 with the IPv4 GID "
     r"00000000000000000000ffffc0a80107; UCX 1\.21 marks a GID with its own family"),
    (_ib.pack_roce_address(IPV4_MCAST_GID, ipv6=True, path_mtu=3), r"RoCE device address marked IPv6 with the IPv4 "
     "GID ff0e"),
    (_ib.pack_roce_address(IPV6_GID, ipv6=False), r"RoCE v2 device address marked IPv4 with the IPv6 GID "
     r"20010db8000000000202c9fffe0a0b0c; UCX 1\.21 marks a GID with its own family"),
    *[(_ib.pack_roce_address(IPV4_GID, path_mtu=mtu), rf"RoCE device address with path MTU {mtu}; UCX 1\.21 packs "
       r"1 to 4") for mtu in (0, 6, 0xFF)],
]


@pytest.mark.parametrize("dev,reason", IB_REFUSED + ROCE_REFUSED,
                         ids=lambda v: v.hex() if isinstance(v, bytes) else None)
@pytest.mark.parametrize("name", _ib.IB_TRANSPORTS)
def test_device_address_with_a_wrong_field_is_refused(name, dev, reason):
    refused(rf"^UCX worker address names {article(name)} {name} (?:{reason})", _ib.check_ib_entry, name, dev,
            IFACES[name][0], ())


def test_each_refused_device_address_is_one_field_from_a_valid_one():
    """Some refusals above, with their bad field set right, pass: they are
    refused for that field, not for their length or their other fields."""
    fixed = [
        bytes([0x00]) + ib_dev()[1:],  # flags 0x80 -> 0
        replace(replace(ib_dev(interface_id=GUID), 3, bytes(8)), 3, GUID),  # interface id 0 -> a GUID
        replace(ib_dev(path_mtu=3), 3, b"\x04"),  # path MTU 5 -> 4
        replace(replace(ib_dev(pkey=0x8001), 3, b"\xff\xff"), 3, b"\xff\x7f"),  # pkey 0xffff -> 0x7fff
        _ib.pack_roce_address(IPV6_GID, ipv6=True),  # IPv4 flag on an IPv6 GID -> IPv6
        _ib.pack_roce_address(IPV6_GID, version=0, ipv6=False),  # ... allowed for v1 (the fallback GID)
    ]
    for dev in fixed:
        assert _ib.check_ib_entry("rc_mlx5", dev, b"\x00", ()) is None


def test_unknown_transport_is_refused():
    for name in ("tcp", "RC_MLX5", "rc", "", "gga_mlx5", "srd"):
        refused(rf"^UCX worker address names the transport {re.escape(repr(name))} where an InfiniBand one was "
                r"expected \(rc_mlx5, dc_mlx5, ud_mlx5, rc_verbs, ud_verbs, rc_gda\)$",
                _ib.check_ib_entry, name, IB_DEVICES[0], b"\x00", ())


# ------------------------------------------------------------------ interface addresses, refused


VALID_IFACE_LENGTHS = {"rc_mlx5": (1,), "dc_mlx5": (5, 7), "ud_mlx5": (3,), "rc_verbs": (0,), "ud_verbs": (3,),
                       "rc_gda": (1,)}


@pytest.mark.parametrize("name", _ib.IB_TRANSPORTS)
def test_interface_address_of_the_wrong_length_is_refused(name):
    valid = VALID_IFACE_LENGTHS[name]
    expected = " or ".join(map(str, valid))
    for length in range(0, 64):
        if length in valid:
            continue
        refused(rf"^UCX worker address names {article(name)} {name} interface address of {length} bytes; UCX 1\.21 "
                rf"packs {expected} \(", _ib.check_ib_entry, name, IB_DEVICES[0], bytes(length), ())


def test_rc_mlx5_interface_of_an_unknown_type_is_refused():
    for kind in (2, 3, 0x80, 0xFF):
        refused(rf"^UCX worker address names an rc_mlx5 interface address of type {kind}; UCX 1\.21 packs 0 \(basic\) "
                r"or 1 \(hardware tag matching\)$", _ib.check_ib_entry, "rc_mlx5", IB_DEVICES[0], bytes([kind]), ())


def test_rc_gda_interface_is_basic():
    for kind in (1, 2, 0xFF):
        refused(rf"^UCX worker address names an rc_gda interface address of type {kind}; UCX 1\.21 packs 0 \(basic\)$",
                _ib.check_ib_entry, "rc_gda", IB_DEVICES[0], bytes([kind]), ())


def dc(flags: int, length: int = 5) -> bytes:
    return _ib.pack_ud_iface(0x1234) + b"\x07" + bytes([flags]) + b"\xef\xbe"[:length - 5]


def test_dc_interface_flags_are_checked():
    for flags in (0x40, 0x80, 0xC4, 0x44):
        refused(rf"^UCX worker address names a dc_mlx5 interface address with unknown flags {flags & 0xC0:#04x} "
                rf"\(of {flags:#04x}\); UCX 1\.21 packs only flags from 0x3f$",
                _ib.check_ib_entry, "dc_mlx5", IB_DEVICES[0], dc(flags), ())
    for flags in (0x06, 0x07, 0x36):
        refused(rf"^UCX worker address names a dc_mlx5 interface address of both DC versions 1 and 2 \(flags "
                rf"{flags:#04x}\); UCX 1\.21 packs one or none$", _ib.check_ib_entry, "dc_mlx5", IB_DEVICES[0],
                dc(flags), ())
    refused(r"^UCX worker address names a dc_mlx5 interface address of 5 bytes with the flush-rkey flag "
            r"\(flags 0x0c\); UCX 1\.21 packs 5 bytes without it and 7 with it$", _ib.check_ib_entry, "dc_mlx5",
            IB_DEVICES[0], dc(0x0C), ())
    refused(r"^UCX worker address names a dc_mlx5 interface address of 7 bytes without the flush-rkey flag \(flags "
            r"0x04\); UCX 1\.21 packs 5 bytes without it and 7 with it$", _ib.check_ib_entry, "dc_mlx5",
            IB_DEVICES[0], dc(0x04, 7), ())
    # the same bytes with the flags UCX packs pass
    _ib.check_ib_entry("dc_mlx5", IB_DEVICES[0], dc(0x04), ())
    _ib.check_ib_entry("dc_mlx5", IB_DEVICES[0], dc(0x0C, 7), ())
    _ib.check_ib_entry("dc_mlx5", IB_DEVICES[0], dc(0x3D, 7), ())


# ------------------------------------------------------------------ endpoint addresses, refused


@pytest.mark.parametrize("name", _ib.IB_TRANSPORTS)
def test_a_worker_address_carries_no_endpoint_address(name):
    for ep in EPS[name] or [b"\x00" * 6]:
        refused(rf"^UCX worker address names {article(name)} {name} interface with 1 endpoint addresses; UCX 1\.21 "
                "packs none into a worker address$", _ib.check_ib_entry, name, IB_DEVICES[0], IFACES[name][0], (ep,))


def test_dc_has_no_endpoint_address_even_in_wireup():
    for ep in (b"", b"\x00" * 3, _ib.pack_ud_ep(1, 2)):
        refused(r"^UCX wireup address names a dc_mlx5 interface with 2 endpoint addresses; UCX 1\.21 connects dc_mlx5 "
                "to interfaces and packs none$", _ib.check_ib_entry, "dc_mlx5", IB_DEVICES[0], IFACES["dc_mlx5"][0],
                (ep, ep), wireup=True)


@pytest.mark.parametrize("name", ["rc_mlx5", "rc_verbs", "ud_mlx5", "rc_gda"])
def test_endpoint_addresses_of_two_lengths_are_refused(name):
    a, b = EPS[name][0], EPS[name][-1] if len(EPS[name][-1]) != len(EPS[name][0]) else EPS[name][0] + b"\x00"
    lengths = " and ".join(map(str, sorted({len(a), len(b)})))
    refused(rf"^UCX wireup address names {article(name)} {name} interface with endpoint addresses of {lengths} bytes; "
            r"UCX 1\.21 packs all of one interface at one length$", _ib.check_ib_entry, name, IB_DEVICES[0],
            IFACES[name][0], (a, b), wireup=True)


VALID_EP_LENGTHS = {"rc_mlx5": (7, 10), "rc_verbs": (4, 7), "ud_mlx5": (6,), "ud_verbs": (6,)}


@pytest.mark.parametrize("name", list(VALID_EP_LENGTHS))
def test_endpoint_address_of_the_wrong_length_is_refused(name):
    valid = VALID_EP_LENGTHS[name]
    for length in range(0, 40):
        if length in valid:
            continue
        refused(rf"^UCX wireup address names {article(name)} {name} endpoint address of {length} bytes; UCX 1\.21 "
                rf"packs {' or '.join(map(str, valid))} \(", _ib.check_ib_entry, name, IB_DEVICES[0], IFACES[name][0],
                (bytes([1]) * length,), wireup=True)


def test_rc_gda_endpoint_is_a_power_of_2_channels():
    for length in (0, 1, 2, 4, 5, 9, 15, 18, 21, 24 + 3, 771):
        refused(rf"^UCX wireup address names an rc_gda endpoint address of {length} bytes; UCX 1\.21 packs a 3-byte qp "
                "per channel, 1 to 256 channels, a power of 2$", _ib.check_ib_entry, "rc_gda", IB_DEVICES[0], b"\x00",
                (bytes(length),), wireup=True)


def test_endpoint_flags_are_checked():
    ext = _ib.pack_rc_mlx5_ep(QP, flush_rkey_hi=0xBEEF)
    for flags in (0x00, 0x02, 0x04, 0x05, 0x80, 0xFF):
        refused(rf"^UCX wireup address names an rc_mlx5 10-byte endpoint address with flags {flags:#04x}; UCX 1\.21 "
                r"packs 0x01 or 0x03 there \(flush rkey, and no atomic offset\)$", _ib.check_ib_entry, "rc_mlx5",
                IB_DEVICES[0], b"\x00", (replace(ext, 7, bytes([flags])),), wireup=True)
    for flags in (0x01, 0x02, 0x03, 0x80):
        refused(rf"^UCX wireup address names an rc_verbs 4-byte endpoint address with flags {flags:#04x}; UCX 1\.21 "
                r"packs 0x00 there", _ib.check_ib_entry, "rc_verbs", IB_DEVICES[0], b"",
                (replace(_ib.pack_rc_verbs_ep(QP), 0, bytes([flags])),), wireup=True)
    flush = _ib.pack_rc_verbs_ep(QP, flush_rkey_hi=3)
    for flags in (0x00, 0x02, 0x04, 0x81):
        refused(rf"^UCX wireup address names an rc_verbs 7-byte endpoint address with flags {flags:#04x}; UCX 1\.21 "
                r"packs 0x01 or 0x03 there \(has atomic mr, and no atomic offset\)$", _ib.check_ib_entry, "rc_verbs",
                IB_DEVICES[0], b"", (replace(flush, 0, bytes([flags])),), wireup=True)


@pytest.mark.parametrize("name", ["ud_mlx5", "ud_verbs"])
def test_ud_endpoint_with_the_null_id_is_refused(name):
    refused(rf"^UCX wireup address names a {name} endpoint address with the null endpoint id 0xffffff; UCX 1\.21 packs "
            "a live endpoint's id, and asserts on this one$", _ib.check_ib_entry, name, IB_DEVICES[0],
            _ib.pack_ud_iface(QP), (_ib.pack_ud_ep(QP, 0xFFFFFF),), wireup=True)
    _ib.check_ib_entry(name, IB_DEVICES[0], _ib.pack_ud_iface(QP), (_ib.pack_ud_ep(QP, 0xFFFFFE),), wireup=True)


# ------------------------------------------------------------------ keys, refused


def test_ib_md_key_of_another_size_is_refused():
    for size in [*range(0, 8), *range(9, 40), 14, 255]:  # 14: an exported mkey, never in a remote key
        refused(rf"^packed remote key's InfiniBand key is {size} bytes; UCX 1\.21's IB memory domains \(verbs, mlx5, "
                r"DevX\) pack 8: a direct and an atomic rkey$", _ib.check_ib_md_key, b"\x5a" * size)


# ------------------------------------------------------------------ an oracle: accepted bytes re-pack to themselves


def repack_device(dev: bytes) -> bytes:
    """The device address re-packed from its decoded fields with the packers (as
    ``uct_ib_address_pack``); also asserts the fields are ones UCX gives."""
    flags = dev[0]
    if flags & 0x08:
        version, ipv6, gid = flags >> 5, bool(flags & 0x10), dev[1:17]
        mtu = dev[17] if flags & 0x02 else MTU_4096
        assert version in (0, 2) and any(gid[8:]) and mtu in MTUS
        is_ipv4 = (gid[8:12] == b"\x00\x00\xff\xff" and not any(gid[4:8])
                   and (not any(gid[:4]) or gid[:4] == b"\xff\x0e\x00\x00"))
        assert is_ipv4 != ipv6 or (version == 0 and not ipv6)
        return _ib.pack_roce_address(gid, version=version, ipv6=ipv6, path_mtu=mtu)
    lid, pos = int.from_bytes(dev[1:3], "little"), 3
    iid = None
    if flags & 0x40:
        iid, pos = dev[pos:pos + 8], pos + 8
        assert any(iid)
    prefix = LINK_LOCAL
    if flags & 0x10:
        prefix, pos = bytes.fromhex("fec000000000") + dev[pos:pos + 2], pos + 2
    elif flags & 0x20:
        prefix, pos = dev[pos:pos + 8], pos + 8
        assert iid is not None
    mtu = MTU_4096
    if flags & 0x02:
        mtu, pos = dev[pos], pos + 1
        assert mtu in MTUS
    pkey = 0xFFFF
    if flags & 0x04:
        pkey, pos = int.from_bytes(dev[pos:pos + 2], "little"), pos + 2
        assert pkey != 0
    return _ib.pack_ib_address(lid, interface_id=iid, subnet_prefix=prefix, path_mtu=mtu, pkey=pkey)


def repack_iface(name: str, iface: bytes) -> bytes:
    if name == "rc_mlx5":
        return _ib.pack_rc_mlx5_iface({b"\x00": False, b"\x01": True}[iface])
    if name == "rc_gda":
        return _ib.pack_rc_gda_iface()
    if name == "rc_verbs":
        return b""
    if name == "dc_mlx5":
        flags = iface[4]
        return _ib.pack_dc_mlx5_iface(int.from_bytes(iface[:3], "little"), atomic_mr_id=iface[3],
                                      dc_version={0: 0, 2: 1, 4: 2}[flags & 0x06], tm=bool(flags & 0x01),
                                      flush_rkey_hi=int.from_bytes(iface[5:7], "little") if flags & 0x08 else None,
                                      max_rd_atomic_16=bool(flags & 0x10), no_atomic_offset=bool(flags & 0x20))
    return _ib.pack_ud_iface(int.from_bytes(iface, "little"))


def repack_ep(name: str, ep: bytes) -> bytes:
    qp = int.from_bytes(ep[:3], "little")
    if name == "rc_mlx5":
        flush = int.from_bytes(ep[8:10], "little") if len(ep) > 7 else None
        return _ib.pack_rc_mlx5_ep(qp, tm_qp_num=int.from_bytes(ep[3:6], "little"), atomic_mr_id=ep[6],
                                   flush_rkey_hi=flush, no_atomic_offset=len(ep) > 7 and bool(ep[7] & 0x02))
    if name == "rc_verbs":
        flush = int.from_bytes(ep[5:7], "little") if len(ep) > 4 else None
        return _ib.pack_rc_verbs_ep(int.from_bytes(ep[1:4], "little"), atomic_mr_id=ep[4] if flush is not None else 0,
                                    flush_rkey_hi=flush, no_atomic_offset=bool(ep[0] & 0x02))
    if name == "rc_gda":
        assert len(ep) in {3 << k for k in range(9)}
        return _ib.pack_rc_gda_ep([int.from_bytes(ep[i:i + 3], "little") for i in range(0, len(ep), 3)])
    assert name in ("ud_mlx5", "ud_verbs") and ep[3:6] != b"\xff\xff\xff"
    return _ib.pack_ud_ep(qp, int.from_bytes(ep[3:6], "little"))


def assert_packable(name: str, dev: bytes, iface: bytes, eps: tuple[bytes, ...], wireup: bool) -> None:
    assert repack_device(dev) == dev
    assert repack_iface(name, iface) == iface
    assert not eps or (wireup and name != "dc_mlx5" and len({len(e) for e in eps}) == 1)
    for ep in eps:
        assert repack_ep(name, ep) == ep


def test_only_flag_bytes_uct_ib_address_pack_sets_are_accepted():
    """Every flag byte over every packed device address: the accepted ones
    re-pack to themselves, and no flag byte the packers never set is accepted."""
    packable = {dev[0] for dev in DEVICES}
    accepted: set[int] = set()
    for dev in DEVICES:
        for flags in range(256):
            candidate = bytes([flags]) + dev[1:]
            try:
                _ib.check_ib_entry("ud_verbs", candidate, _ib.pack_ud_iface(QP), ())
            except InvalidInputError:
                continue
            accepted.add(flags)
            assert repack_device(candidate) == candidate
    assert accepted == packable


# ------------------------------------------------------------------ fuzz


FUZZ_CASES = int(os.environ.get("GPUSHARE_FUZZ_CASES", "3000"))
REASON = re.compile(r"^(UCX (worker|wireup) address names an? (rc_mlx5|dc_mlx5|ud_mlx5|rc_verbs|ud_verbs|rc_gda) "
                    r"\S[^;]*; UCX 1\.21 |packed remote key's InfiniBand key is \d+ bytes; UCX 1\.21)")


def position(rng: random.Random, data: bytes) -> int:
    """A byte of ``data``, the first (a device address's flags) more often."""
    return 0 if rng.random() < 0.3 else rng.randrange(len(data))


def mutate(rng: random.Random, data: bytes) -> bytes:
    op = rng.randrange(9)
    if op == 0 and data:  # flip bits of a byte
        i = position(rng, data)
        return replace(data, i, bytes([data[i] ^ rng.randrange(1, 256)]))
    if op == 1 and data:  # an edge value into a byte
        i = position(rng, data)
        return replace(data, i, bytes([rng.choice((0, 1, 2, 3, 4, 5, 6, 0x7F, 0x80, 0xFE, 0xFF))]))
    if op == 8 and data:  # flip one bit
        i = position(rng, data)
        return replace(data, i, bytes([data[i] ^ 1 << rng.randrange(8)]))
    if op == 2:  # truncate
        return data[:rng.randrange(len(data) + 1)]
    if op == 3:  # extend
        return data + rng.randbytes(rng.randrange(1, 9))
    if op == 4:  # random bytes of a nearby length
        return rng.randbytes(max(0, len(data) + rng.randrange(-3, 4)))
    if op == 5 and data:  # delete a byte
        i = rng.randrange(len(data))
        return data[:i] + data[i + 1:]
    if op == 6:  # insert a byte
        i = rng.randrange(len(data) + 1)
        return data[:i] + bytes([rng.randrange(256)]) + data[i:]
    # the first byte (flags of a device address, qp low byte elsewhere) set at random
    return bytes([rng.randrange(256)]) + data[1:] if data else data


def base_entry(rng: random.Random) -> tuple[str, bytes, bytes, tuple[bytes, ...], bool]:
    name = rng.choice(_ib.IB_TRANSPORTS)
    wireup = rng.random() < 0.5
    eps: tuple[bytes, ...] = ()
    if wireup and EPS[name] and rng.random() < 0.7:
        eps = (rng.choice(EPS[name]),) * rng.randrange(1, 4)
    return name, rng.choice(DEVICES), rng.choice(IFACES[name]), eps, wireup


def fuzz_entry(rng: random.Random) -> tuple[str, bytes, bytes, tuple[bytes, ...], bool]:
    name, dev, iface, eps, wireup = base_entry(rng)
    for _ in range(rng.randrange(1, 4)):
        what = rng.randrange(7)
        if what <= 2:
            dev = mutate(rng, dev)
        elif what == 3:
            iface = mutate(rng, iface)
        elif what == 4 and eps:
            i = rng.randrange(len(eps))
            eps = eps[:i] + (mutate(rng, eps[i]),) + eps[i + 1:]
        elif what == 4:
            eps = (rng.randbytes(rng.randrange(12)),)
        elif what == 5:
            wireup = not wireup
        else:
            name = rng.choice(_ib.IB_TRANSPORTS)  # another transport's addresses
    return name, dev, iface, eps, wireup


def test_fuzz_validators_only_return_or_refuse():
    """Mutated valid entries and keys (``GPUSHARE_FUZZ_CASES`` of each, seeded):
    the validators return None or raise InvalidInputError leading with its
    reason, never another exception; what they accept re-packs to itself."""
    rng = random.Random(0x1B_F0_2A)
    counts = {"entry accepted": 0, "entry refused": 0, "key accepted": 0, "key refused": 0}
    start = time.perf_counter()
    for case in range(FUZZ_CASES):
        name, dev, iface, eps, wireup = fuzz_entry(rng)
        try:
            result = _ib.check_ib_entry(name, dev, iface, eps, wireup=wireup)
        except InvalidInputError as exc:
            assert REASON.match(str(exc)), f"case {case}: {exc}"
            counts["entry refused"] += 1
        except Exception as exc:  # noqa: BLE001 - the failure this test looks for
            pytest.fail(f"case {case}: {name} {dev.hex()} {iface.hex()} {[e.hex() for e in eps]} wireup={wireup} "
                        f"raised {exc!r}")
        else:
            assert result is None
            assert_packable(name, dev, iface, eps, wireup)
            counts["entry accepted"] += 1
        key = _ib.pack_ib_md_key(rng.getrandbits(32), rng.choice((0xFFFFFFFF, rng.getrandbits(32))))
        for _ in range(rng.randrange(0, 3)):
            key = mutate(rng, key)
        try:
            assert _ib.check_ib_md_key(key) is None
        except InvalidInputError as exc:
            assert REASON.match(str(exc)), f"case {case}: {exc}"
            assert len(key) != 8
            counts["key refused"] += 1
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"case {case}: key {key.hex()} raised {exc!r}")
        else:
            assert len(key) == 8
            counts["key accepted"] += 1
    elapsed = time.perf_counter() - start
    print(f"\nIB formats fuzz: {FUZZ_CASES} cases in {elapsed:.2f} s: {counts}")
    # The mutations reach both outcomes, so the run is not vacuous either way.
    assert all(counts[k] > FUZZ_CASES // 50 for k in counts), counts


def test_every_transport_named_has_its_rules():
    assert tuple(_ib._RULES) == _ib.IB_TRANSPORTS
