"""A channel's handle: what a producer hands its consumers (validated
plain data, its wire form and its pickle)."""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from .._arrays import check_shape, nbytes_of, portable_typestr
from .._errors import InvalidInputError
from .._share import Share
from .._types import strict_json
from .._types import in_range

__all__ = ["HANDLE_FORMAT", "MAX_CONSUMERS", "MAX_SLOTS", "ChannelHandle"]


HANDLE_FORMAT = 1
_WIRE_TAG = "gpushare.channel"
_MAX_HANDLE_BYTES = 1 << 20
MAX_CONSUMERS = 1024
MAX_SLOTS = 64
_ID = re.compile(r"^[0-9a-f]{32}\Z")


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    return in_range(value, what, lo, hi, owner="channel")


class ChannelHandle:
    """What a consumer needs to join a channel, as plain data: pass it to the
    consumer processes (pickle, :mod:`multiprocessing` arguments in every
    start method, or :meth:`to_bytes` over any transport).

    Made by :attr:`Producer.handle`.  Like a share, it is a capability:
    whoever holds it can join the channel and read its slots.  A handle
    received from another process is validated field by field, on
    unpickling and in :meth:`from_bytes`.

    Attributes
    ----------
    channel_id : str
        32 hex digits naming the channel.
    shape : tuple of int
        Shape of the array in every slot.
    typestr : str
        Its ``__array_interface__`` type string.
    consumers : int
        How many consumers the producer waits for.
    slots : int
        Size of the ring.
    device : "host" or int
        Where the slots live in the producer.
    producer_pid : int
        The producing process.
    """

    __slots__ = ("_fields_",)
    _NAMES = ("version", "channel_id", "token", "producer_pid", "node", "unix", "tcp", "shape", "typestr",
              "consumers", "slots", "device", "shares")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("ChannelHandle objects are made by gpushare.channel (Producer.handle)")

    @classmethod
    def _make(cls, *fields: Any) -> ChannelHandle:
        """The validating constructor; every field is untrusted."""
        if len(fields) != len(cls._NAMES):
            raise InvalidInputError(f"channel handle has {len(fields)} fields; expected {len(cls._NAMES)}")
        (version, channel_id, token, pid, node, unix, tcp, shape, typestr, consumers, slots, device,
         shares) = fields
        if isinstance(version, bool) or version != HANDLE_FORMAT:
            raise InvalidInputError(f"channel handle format {version!r:.20}; this gpushare reads {HANDLE_FORMAT}")
        if not isinstance(channel_id, str) or not _ID.match(channel_id):
            raise InvalidInputError("channel id must be 32 lowercase hex digits")
        if not isinstance(token, bytes) or len(token) != 32:
            got = len(token) if isinstance(token, bytes) else type(token).__name__
            raise InvalidInputError(f"channel token is {got} bytes; expected 32")
        _int(pid, "producer_pid", 1, (1 << 31) - 1)
        if not isinstance(node, str) or not 0 < len(node) <= 512:
            raise InvalidInputError("channel node must be a non-empty str of at most 512 characters")
        if unix != f"gpushare-channel-{channel_id}":
            raise InvalidInputError(f"channel socket name {unix!r:.60} does not match the channel id")
        if not isinstance(tcp, tuple) or not 1 <= len(tcp) <= 16:
            raise InvalidInputError("channel tcp must be a tuple of 1 to 16 (host, port) pairs")
        for entry in tcp:
            if not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str):
                raise InvalidInputError("channel tcp entries must be (host, port) pairs")
            try:
                ipaddress.IPv4Address(entry[0])
            except ValueError:
                raise InvalidInputError(f"channel tcp host {entry[0]!r:.60} is not an IPv4 address") from None
            _int(entry[1], "tcp port", 1, 65535)
        if not isinstance(shape, tuple):
            raise InvalidInputError("channel shape must be a tuple of ints")
        check_shape(shape, "channel shape")
        if any(not isinstance(d, int) or isinstance(d, bool) for d in shape):
            raise InvalidInputError("channel shape must be a tuple of ints")
        if not isinstance(typestr, str):
            raise InvalidInputError("channel typestr must be a str")
        portable_typestr(typestr)
        nbytes = nbytes_of(shape, typestr)
        if nbytes < 1:
            raise InvalidInputError(f"channel shape {shape} of {typestr} holds no bytes")
        _int(consumers, "consumers", 1, MAX_CONSUMERS)
        _int(slots, "slots", 1, MAX_SLOTS)
        if device != "host":
            _int(device, "device", 0, 1 << 16)
        if not isinstance(shares, tuple) or len(shares) != slots:
            raise InvalidInputError(f"channel has {slots} slots but its handle names "
                                    f"{len(shares) if isinstance(shares, tuple) else 'no tuple of'} shares")
        for i, share in enumerate(shares):
            if not isinstance(share, Share):
                raise InvalidInputError(f"channel slot {i} is a {type(share).__name__}, not a gpushare.Share")
            if share.nbytes < nbytes:
                raise InvalidInputError(f"channel slot {i} is {share.nbytes} bytes; a step needs {nbytes}")
            if (share.device == "host") != (device == "host"):
                raise InvalidInputError(f"channel slot {i} is on {share.device}; the channel says {device}")
        self = object.__new__(cls)
        object.__setattr__(self, "_fields_", tuple(fields))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ChannelHandle is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_handle, self._fields_)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChannelHandle) and other._fields_ == self._fields_

    def __hash__(self) -> int:
        return hash(self._fields_)

    def _field(self, name: str) -> Any:
        return self._fields_[self._NAMES.index(name)]

    channel_id = property(lambda self: self._field("channel_id"))
    shape = property(lambda self: self._field("shape"))
    typestr = property(lambda self: self._field("typestr"))
    consumers = property(lambda self: self._field("consumers"))
    slots = property(lambda self: self._field("slots"))
    device = property(lambda self: self._field("device"))
    producer_pid = property(lambda self: self._field("producer_pid"))

    @property
    def nbytes(self) -> int:
        """Bytes in one step."""
        return nbytes_of(self.shape, self.typestr)

    def to_bytes(self) -> bytes:
        """The handle as bytes (compact ASCII JSON, slots as :meth:`Share.to_bytes`).

        Returns
        -------
        bytes
            At most 1 MiB; read back with :meth:`from_bytes`.
        """
        f = dict(zip(self._NAMES, self._fields_, strict=True))
        f["token"] = f["token"].hex()
        f["tcp"] = [list(a) for a in f["tcp"]]
        f["shape"] = list(f["shape"])
        f["shares"] = [s.to_bytes().decode("ascii") for s in f["shares"]]
        f["format"] = _WIRE_TAG
        return json.dumps(f, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ChannelHandle:
        """Rebuild a handle from :meth:`to_bytes`; safe on bytes from an untrusted peer.

        Parameters
        ----------
        data : bytes-like
            At most 1 MiB.

        Returns
        -------
        ChannelHandle

        Raises
        ------
        InvalidInputError
            Anything but a well-formed handle of a format this gpushare reads.
        """
        obj = strict_json(data, _MAX_HANDLE_BYTES, "ChannelHandle.from_bytes", "channel handle")
        if not isinstance(obj, dict) or obj.get("format") != _WIRE_TAG or set(obj) - {"format"} != set(cls._NAMES):
            raise InvalidInputError("channel handle bytes do not hold the fields of a channel handle")
        token, shares = obj["token"], obj["shares"]
        if not isinstance(token, str) or not re.match(r"^[0-9a-f]{64}\Z", token):
            raise InvalidInputError("channel token must be 64 lowercase hex digits")
        if not isinstance(shares, list) or not all(isinstance(s, str) for s in shares):
            raise InvalidInputError("channel shares must be a list of Share.to_bytes strings")
        obj["token"] = bytes.fromhex(token)
        obj["shares"] = tuple(Share.from_bytes(s.encode("ascii")) for s in shares)
        for name in ("shape",):
            if isinstance(obj[name], list):
                obj[name] = tuple(obj[name])
        if isinstance(obj["tcp"], list):
            obj["tcp"] = tuple(tuple(a) if isinstance(a, list) else a for a in obj["tcp"])
        return cls._make(*(obj[name] for name in cls._NAMES))

    def __repr__(self) -> str:
        return (f"<gpushare.ChannelHandle {self.channel_id[:8]} {self.slots} slots of {self.shape} "
                f"{self.typestr} on {self.device}, {self.consumers} consumers, producer pid {self.producer_pid}>")


def _rebuild_handle(*fields: Any) -> ChannelHandle:
    return ChannelHandle._make(*fields)


# Pickles name it where it was first defined (``gpushare._channel``, which
# imports it), so that they read the same in this and in older versions.
_rebuild_handle.__module__ = "gpushare._channel"
