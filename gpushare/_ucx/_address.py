"""Check the structure of a packed UCX worker address before UCX reads it.

UCX reads a peer's worker address (``ucp_ep_create``) with no length and no
bounds: a forged one makes it read past the end of the buffer (SIGSEGV), or
trips an assertion on an unknown format version (SIGABRT).  gpushare takes
worker addresses from other processes (an exporter's offer, an agent's
peer), so it walks the address first, as UCX 1.21 packs it (formats v1 and
v2, ``src/ucp/wireup/address.c``; the native module is built against UCX
1.21 and no other), and refuses anything that does not end exactly where
the address ends or that names a count or index out of UCX's ranges.

What is checked: the header (version, flags), the worker uuid, client id
and name; for each device its memory-domain index, flags, path count,
system device and address length; for each transport on it the name
checksum, its attributes, its interface address and each endpoint address
with its lane.  The bytes inside those addresses (IP addresses, ports,
names) are the transports' own and are not interpreted here.
"""

from __future__ import annotations

from .._errors import InvalidInputError

__all__ = ["check_worker_address"]

_V1, _V2 = 0, 1
# Header flags (UCP_ADDRESS_HEADER_FLAG_*): debug info, worker uuid, client id, AM only.
_DEBUG_INFO, _CLIENT_ID = 0x1, 0x4
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
_MAX_MDS, _MAX_RESOURCES, _MAX_LANES = 64, 128, 64


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

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def need(self, n: int, what: str = "the next field") -> None:
        if self.pos + n > len(self.data):
            raise InvalidInputError(f"UCX worker address ends at byte {len(self.data)}, inside {what} "
                                    f"({n} bytes at {self.pos})")

    def extended(self, mask: int, value: int, version: int) -> int:
        """A length or index that v2 continues in the next byte when it is ``mask``."""
        return self.u8() if version == _V2 and value == mask else value


# v2 attributes: overhead, bandwidth, latency (fp8), priority, segment size
# (units of 64 bytes, little-endian u16), flags (u16: bit 1 "active messages",
# bit 2 "callbacks from any thread").
_SEG_SIZE_FACTOR, _AM_FLAGS, _MIN_AM_SEGMENT = 64, 0x6, 1024


def _check_v2_attributes(attr: bytes) -> None:
    seg_size = int.from_bytes(attr[4:6], "little") * _SEG_SIZE_FACTOR
    flags = int.from_bytes(attr[6:8], "little")
    if flags & _AM_FLAGS and seg_size < _MIN_AM_SEGMENT:
        # UCX asserts (and aborts) when a message transport's segment cannot hold a remote key.
        raise InvalidInputError(f"UCX worker address names a message transport with {seg_size}-byte segments")


def check_worker_address(raw: bytes) -> None:
    """Raise :class:`InvalidInputError` unless ``raw`` is a well-formed UCX
    1.21 worker address (v1 or v2) that UCX can read without running past
    its end."""
    r = _Reader(bytes(raw))
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
    r.skip(8, "the worker uuid")  # always packed in a worker address
    if flags & _CLIENT_ID:
        r.skip(8, "the client id")
    if flags & _DEBUG_INFO:
        r.skip(r.u8(), "the worker name")
    if r.peek() == _NULL_RESOURCE:
        raise InvalidInputError("UCX worker address names no transport")
    entries = 0
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
            r.u8()
        r.skip(dev_len, "a device address")
        last_tl = bool(empty)
        while not last_tl:
            entries += 1
            if entries > _MAX_RESOURCES:
                raise InvalidInputError(f"UCX worker address names more than {_MAX_RESOURCES} transports")
            r.skip(2, "a transport's name checksum")
            r.need(_ATTR_LEN[version], "a transport's attributes")
            if version == _V2:
                _check_v2_attributes(r.data[r.pos:r.pos + _ATTR_LEN[_V2]])
            r.skip(_ATTR_LEN[version], "a transport's attributes")
            length_byte = r.peek()
            last_tl = bool(length_byte & _LAST)
            has_ep = bool(length_byte & _HAS_EP_ADDR)
            r.u8()
            r.skip(r.extended(_IFACE_LEN_MASK, length_byte & _IFACE_LEN_MASK, version), "an interface address")
            endpoints = 0
            while has_ep:
                endpoints += 1
                if endpoints > _MAX_LANES:
                    raise InvalidInputError(f"UCX worker address names more than {_MAX_LANES} endpoint addresses")
                r.skip(r.u8(), "an endpoint address")
                has_ep = not r.u8() & _LAST
        if dev & _LAST:
            break
    if r.pos != len(r.data):
        raise InvalidInputError(f"UCX worker address has {len(r.data) - r.pos} bytes after its last device")
