"""The :class:`Share`: plain data naming an exported buffer and the paths it is offered on.

A share is a capability: whoever holds it may ask the exporter for the
buffer.  It carries no file descriptor, no UCX key and no driver handle: the
exporter hands those out at open time, over its control channel, after it
checked the share's token and its lifetime policy.  A share received from
another process is untrusted and validated field by field on construction
and on unpickling.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from typing import Any

from . import _descriptors
from ._errors import InvalidInputError

__all__ = ["Share", "PATHS", "node_key", "LIFETIMES"]

#: Every path, fastest first.
PATHS = ("same-process", "fabric", "posix-fd", "cuda-ipc", "host-fd", "ucx-rma")
#: Lifetime policy names (an int N means "until N imports have closed").
LIFETIMES = ("closed", "revoked", "none")

SHARE_FORMAT = 1
_ID = re.compile(r"^[0-9a-f]{32}$")
_MAX_DIMS = 32
_MAX_ADDRESSES = 16
_MAX_NBYTES = 1 << 56


@functools.cache
def node_key() -> str:
    """What "same node" means for the mapped paths: the same kernel boot, host
    name and network namespace (the fd broker's socket lives in the latter)."""
    from ._paths.broker import node_identity

    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{node_identity()}:netns={netns}"


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"share {what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidInputError(f"share {what} is {value}; expected {lo} <= {what} <= {hi}")
    return value


def _text(value: Any, what: str) -> str:
    return _descriptors._text(value, f"share {what}", optional=False)


class Share:
    """A shared buffer, as plain data: pickle it and send it anywhere.

    Made by :func:`gpushare.export`; open it with :func:`gpushare.open`.

    Attributes
    ----------
    share_id : str
        32 hex digits naming the export in the exporter.
    nbytes : int
        Size of the buffer.
    device : "host" or int
        Where the memory lives in the exporter.
    shape, typestr :
        Array shape and ``__array_interface__`` type string of the exported
        object (``(nbytes,)`` and ``"|u1"`` for untyped buffers).
    offers : tuple of str
        Paths the exporter can serve, fastest first.
    lifetime : str
        The exporter's policy: ``"closed"``, ``"revoked"``, ``"none"`` or
        ``"imports=N"``.
    exporter_pid, node :
        The exporting process and its node key.
    control : tuple of (host, port)
        Where the exporter's control channel listens.
    fabric : str or None
        The exporter's fabric clique, for the fabric path.
    readonly : bool
        Importers may only read.
    """

    __slots__ = ("_fields_",)
    _NAMES = ("version", "share_id", "token", "exporter_pid", "node", "control", "nbytes", "device",
              "shape", "typestr", "offers", "lifetime", "fabric", "readonly")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Share objects are made by gpushare.export (and by unpickling)")

    @classmethod
    def _make(cls, *fields: Any) -> Share:
        """The validating constructor; every field is untrusted."""
        if len(fields) != len(cls._NAMES):
            raise InvalidInputError(f"share has {len(fields)} fields; expected {len(cls._NAMES)}")
        (version, share_id, token, pid, node, control, nbytes, device, shape, typestr, offers,
         lifetime, fabric, readonly) = fields
        if version != SHARE_FORMAT or isinstance(version, bool):
            raise InvalidInputError(f"share format version {version!r:.20}; this gpushare reads {SHARE_FORMAT}")
        if not isinstance(share_id, str) or not _ID.match(share_id):
            raise InvalidInputError("share id must be 32 lowercase hex digits")
        if not isinstance(token, bytes) or len(token) != 32:
            got = len(token) if isinstance(token, bytes) else type(token).__name__
            raise InvalidInputError(f"share token is {got} bytes; expected 32")
        _int(pid, "exporter_pid", 1, (1 << 31) - 1)
        _text(node, "node")
        if not isinstance(control, tuple) or not 1 <= len(control) <= _MAX_ADDRESSES:
            raise InvalidInputError(f"share control must be a tuple of 1 to {_MAX_ADDRESSES} (host, port) pairs")
        for entry in control:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise InvalidInputError("share control entries must be (host, port) pairs")
            host, port = entry
            try:
                ipaddress.ip_address(_text(host, "control host"))
            except ValueError:
                raise InvalidInputError(f"share control host {host!r:.60} is not an IP address") from None
            _int(port, "control port", 1, 65535)
        _int(nbytes, "nbytes", 1, _MAX_NBYTES)
        if device != "host":
            _int(device, "device", 0, 1 << 16)
        if not isinstance(shape, tuple) or len(shape) > _MAX_DIMS:
            raise InvalidInputError(f"share shape must be a tuple of at most {_MAX_DIMS} ints")
        count = 1
        for d in shape:
            count *= _int(d, "shape entry", 0, _MAX_NBYTES)
        if not isinstance(typestr, str) or not re.match(r"^[<>|=][biufcV]\d{1,4}$", typestr):
            raise InvalidInputError(f"share typestr {typestr!r:.20} is not an array-interface type string")
        if count * int(typestr[2:]) != nbytes:
            raise InvalidInputError(
                f"share shape {shape} of {typestr} is {count * int(typestr[2:])} bytes; nbytes says {nbytes}"
            )
        if not isinstance(offers, tuple) or not offers or len(set(offers)) != len(offers):
            raise InvalidInputError("share offers must be a non-empty tuple of distinct path names")
        for p in offers:
            if p not in PATHS:
                raise InvalidInputError(f"share offers unknown path {p!r:.40}")
        if not isinstance(lifetime, str) or not (lifetime in LIFETIMES or re.match(r"^imports=[1-9]\d{0,8}$", lifetime)):
            raise InvalidInputError(f"share lifetime {lifetime!r:.40} is not a known policy")
        if fabric is not None:
            _text(fabric, "fabric")
        if not isinstance(readonly, bool):
            raise InvalidInputError("share readonly must be a bool")
        self = object.__new__(cls)
        object.__setattr__(self, "_fields_", tuple(fields))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Share is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_share, self._fields_)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Share) and other._fields_ == self._fields_

    def __hash__(self) -> int:
        return hash(self._fields_)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields_[Share._NAMES.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    def revoke(self) -> None:
        """Exporter side: refuse new opens and stop remote access now.

        Mappings already made on the same node stay valid (the exporter cannot
        unmap another process's memory); ucx-rma views lose access at once.
        Only the exporting process can revoke.
        """
        from ._exporter import revoke

        revoke(self)

    def __repr__(self) -> str:
        return (f"<gpushare.Share {self.share_id[:8]} {self.nbytes} bytes on {self.device} "
                f"from pid {self.exporter_pid}, offers {', '.join(self.offers)}>")


def _rebuild_share(*fields: Any) -> Share:
    return Share._make(*fields)
