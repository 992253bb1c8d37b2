"""The :class:`Share`: plain data naming an exported buffer and the paths it is offered on.

A share is a capability: whoever holds it may ask the exporter for the
buffer.  It carries no file descriptor, no UCX key and no driver handle: the
exporter hands those out at open time, over its control channel, after it
checked the share's token and its lifetime policy.  A share received from
another process is untrusted and validated field by field on construction
and on unpickling.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import os
import re
from collections.abc import Callable
from typing import Any, Literal

from . import _manifest
from ._errors import ClosedError, InvalidInputError, InvalidTypeError
from ._types import PathName, in_range, path_names, strict_json, text

__all__ = ["Share", "BundleShare", "expect_share", "LIFETIMES", "MAX_SHARE_BYTES", "MAX_BUNDLE_SHARE_BYTES"]

#: Lifetime policy names (an int N means "until N imports have closed").
LIFETIMES = ("auto", "closed", "revoked", "none")

#: Revokes a share of this process: installed by :mod:`gpushare._exporter`
#: (which sits above this module) through :func:`set_revoke_hook`.
_revoke: Callable[[Share], None] | None = None


def set_revoke_hook(revoke: Callable[[Share], None]) -> None:
    """Let :meth:`Share.revoke` reach this process's exporter."""
    global _revoke
    _revoke = revoke


SHARE_FORMAT = 1
#: The most bytes :meth:`Share.from_bytes` reads for a share of one buffer.
MAX_SHARE_BYTES = 1 << 16
#: The most bytes it reads for a bundle's share (its manifest in base64, and the rest).
MAX_BUNDLE_SHARE_BYTES = MAX_SHARE_BYTES + _manifest.MAX_MANIFEST_BYTES * 4 // 3 + 4
_WIRE_TAG = "gpushare.share"
_ID = re.compile(r"[0-9a-f]{32}", re.ASCII)
_MAX_DIMS = 32
_MAX_ADDRESSES = 16
_MAX_NBYTES = 1 << 56
_DTYPE_NAME = re.compile(r"^[A-Za-z0-9_\[\]<>|=,. ]{1,64}\Z")


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    return in_range(value, what, lo, hi, owner="share")


def _text(value: Any, what: str) -> str:
    return text(value, f"share {what}", optional=False)  # type: ignore[return-value]


class Share:
    """A shared buffer, as plain data: send it to the processes that may open it.

    Made by :func:`gpushare.export`; open it with :func:`gpushare.open`.
    It holds no file descriptor, key or pointer, only what an importer needs
    to ask the exporter for the buffer (see the security page: a share is a
    capability).  Two wire forms: :meth:`to_bytes` / :meth:`from_bytes`
    (versioned, bounded, validated, no code execution: the one to use over
    untrusted transports) and pickle (for channels whose other end is
    trusted to send pickles, such as :mod:`multiprocessing`).  Either way the
    fields are validated one by one.

    In the exporting process a share is a context manager: ``with
    gs.export(x, lifetime="revoked") as share:`` revokes it when the block
    ends (see :meth:`__enter__`).
    """

    # _sent: in the exporting process, told when the share leaves it (lifetime "auto").
    __slots__ = ("_fields_", "_sent", "_bundle", "__weakref__")
    _BASE = ("version", "share_id", "token", "exporter_pid", "node", "control", "nbytes", "device",
             "shape", "typestr", "offers", "lifetime", "fabric", "readonly")
    #: Fields a share may leave out (on the wire and in pickles), with their defaults.
    _OPTIONAL = (("offset", 0), ("dtype_name", None), ("dlpack_dtype", None), ("strides", None), ("manifest", None))
    _NAMES = _BASE + tuple(name for name, _ in _OPTIONAL)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Share objects are made by gpushare.export (and by Share.from_bytes or unpickling)")

    @classmethod
    def _make(cls, *fields: Any) -> Share:
        """The validating constructor; every field is untrusted."""
        if len(cls._BASE) <= len(fields) < len(cls._NAMES):  # older forms leave out the newer optional fields
            fields = tuple(fields) + tuple(default for _, default in cls._OPTIONAL[len(fields) - len(cls._BASE):])
        if len(fields) != len(cls._NAMES):
            raise InvalidInputError(f"share has {len(fields)} fields; expected {len(cls._BASE)} or {len(cls._NAMES)}")
        (version, share_id, token, pid, node, control, nbytes, device, shape, typestr, offers,
         lifetime, fabric, readonly, offset, dtype_name, dlpack_dtype, strides, manifest) = fields
        if type(version) is not int or version != SHARE_FORMAT:
            raise InvalidInputError(f"share format version {version!r:.20}; this gpushare reads {SHARE_FORMAT}")
        if not isinstance(share_id, str) or not _ID.fullmatch(share_id):
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
        if not isinstance(typestr, str) or not re.fullmatch(r"[<>|=][biufcV][0-9]{1,4}", typestr):
            raise InvalidInputError(f"share typestr {typestr!r:.20} is not an array-interface type string")
        itemsize = int(typestr[2:])
        if strides is not None:
            if not isinstance(strides, tuple) or len(strides) != len(shape) or not count:
                raise InvalidInputError(f"share strides must be a tuple of {len(shape)} ints for shape {shape}")
            for st in strides:
                if _int(st, "stride", 0, _MAX_NBYTES) % itemsize:
                    raise InvalidInputError(f"share stride {st} is not a whole number of {itemsize}-byte items")
            span = itemsize + sum((d - 1) * st for d, st in zip(shape, strides, strict=True))
            if span != nbytes:
                raise InvalidInputError(f"share shape {shape} with strides {strides} spans {span} bytes; "
                                        f"nbytes says {nbytes}")
        elif count * itemsize != nbytes:
            raise InvalidInputError(
                f"share shape {shape} of {typestr} is {count * itemsize} bytes; nbytes says {nbytes}"
            )
        if not isinstance(offers, tuple) or not offers:
            raise InvalidInputError("share offers must be a non-empty tuple of distinct path names")
        known = path_names()
        for p in offers:
            if not isinstance(p, str) or p not in known:
                raise InvalidInputError(f"share offers unknown path {p!r:.40}")
        if len(set(offers)) != len(offers):
            raise InvalidInputError("share offers must be a non-empty tuple of distinct path names")
        if not isinstance(lifetime, str) or not (lifetime in LIFETIMES
                                                 or re.fullmatch(r"imports=[1-9][0-9]{0,8}", lifetime)):
            raise InvalidInputError(f"share lifetime {lifetime!r:.40} is not a known policy")
        if fabric is not None:
            _text(fabric, "fabric")
        if not isinstance(readonly, bool):
            raise InvalidInputError("share readonly must be a bool")
        _int(offset, "offset", 0, _MAX_NBYTES - nbytes)
        if dtype_name is not None and (not isinstance(dtype_name, str) or not _DTYPE_NAME.match(dtype_name)):
            raise InvalidInputError(f"share dtype_name {dtype_name!r:.40} is not a dtype name")
        if dlpack_dtype is not None:
            if not isinstance(dlpack_dtype, tuple) or len(dlpack_dtype) != 3:
                raise InvalidInputError("share dlpack_dtype must be a (code, bits, lanes) tuple")
            code, bits, lanes = (_int(v, f"dlpack_dtype {w}", lo, hi) for v, w, lo, hi in
                                 zip(dlpack_dtype, ("code", "bits", "lanes"), (0, 1, 1), (255, 255, 65535),
                                     strict=True))
            if bits * lanes != 8 * int(typestr[2:]) or typestr[1] != "V":
                raise InvalidInputError(f"share dlpack_dtype {dlpack_dtype} does not fit typestr {typestr}")
        bundle = None if manifest is None else _bundle_of(manifest, fields, cls._made.pop(id(manifest), None))
        self = object.__new__(Share if bundle is None else BundleShare)
        object.__setattr__(self, "_fields_", tuple(fields))
        object.__setattr__(self, "_sent", None)
        object.__setattr__(self, "_bundle", bundle)
        return self

    #: Manifests this process just encoded, by id of their bytes, for the
    #: share being made of them (not decoded again).  Filled and emptied by
    #: :meth:`_make_bundle`.
    _made: dict[int, _manifest.Manifest] = {}

    @classmethod
    def _make_bundle(cls, fields: tuple, made: _manifest.Manifest) -> Share:
        """The share of a bundle this process exported: its manifest (the last
        field) is ``made``, checked against the fields but not decoded again."""
        cls._made[id(fields[-1])] = made
        try:
            return cls._make(*fields)
        finally:
            cls._made.pop(id(fields[-1]), None)

    @classmethod
    def _trusted(cls, fields: tuple) -> Share:
        """A share made here from fields already validated (a bundle's part or
        tensor, from its validated manifest): not checked again."""
        self = object.__new__(cls)
        object.__setattr__(self, "_fields_", fields)
        object.__setattr__(self, "_sent", None)
        object.__setattr__(self, "_bundle", None)
        return self

    @classmethod
    def _fields_of(cls, **named: Any) -> tuple:
        """A share's fields in their wire order from named ones (``version``
        defaults to :data:`SHARE_FORMAT`, the optional fields to theirs), for
        :meth:`_make` and :meth:`_make_bundle`."""
        named.setdefault("version", SHARE_FORMAT)
        unknown = set(named) - set(cls._NAMES)
        missing = [name for name in cls._BASE if name not in named]
        if unknown or missing:
            raise TypeError(f"share fields: unknown {sorted(unknown)}, missing {missing}")
        return tuple(named[name] for name in cls._BASE) + tuple(named.get(name, default)
                                                               for name, default in cls._OPTIONAL)

    def _replace(self, **fields: Any) -> Share:
        """A share like this one with the named ``fields`` replaced (a bundle's
        part or tensor), as :meth:`_trusted`: the values are not checked again."""
        values = list(self._fields_)
        for name, value in fields.items():
            at = _FIELD_AT.get(name)
            if at is None:
                raise TypeError(f"a share has no field {name!r}")
            values[at] = value
        return Share._trusted(tuple(values))

    def _on_send(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when this share is pickled, copied or turned into bytes."""
        object.__setattr__(self, "_sent", hook)

    def _leaving(self) -> None:
        hook = self._sent
        if hook is not None:
            hook()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Share is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        self._leaving()
        return (_rebuild_share, self._fields_[:len(self._BASE)] if self._plain() else self._fields_)

    def _plain(self) -> bool:
        """Whether every optional field has its default (the share reads as format 1 did)."""
        return all(self._fields_[len(self._BASE) + i] == d for i, (_, d) in enumerate(self._OPTIONAL))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Share) and other._fields_ == self._fields_

    def __hash__(self) -> int:
        return hash(self._fields_)

    # -- fields ----------------------------------------------------------------
    @property
    def version(self) -> int:
        """Format version of the share (1)."""
        return self._fields_[0]

    @property
    def share_id(self) -> str:
        """32 hex digits naming the export in the exporter."""
        return self._fields_[1]

    @property
    def token(self) -> bytes:
        """The 32-byte secret that lets its holder open the share."""
        return self._fields_[2]

    @property
    def exporter_pid(self) -> int:
        """The exporting process."""
        return self._fields_[3]

    @property
    def node(self) -> str:
        """The exporter's node key: boot id, host name and network namespace."""
        return self._fields_[4]

    @property
    def control(self) -> tuple[tuple[str, int], ...]:
        """Where the exporter's control channel listens: (IP address, port) pairs."""
        return self._fields_[5]

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self._fields_[6]

    @property
    def device(self) -> int | Literal["host"]:
        """Where the memory lives in the exporter: ``"host"`` or a CUDA device ordinal."""
        return self._fields_[7]

    @property
    def shape(self) -> tuple[int, ...]:
        """Array shape of the exported object (``(nbytes,)`` for untyped buffers)."""
        return self._fields_[8]

    @property
    def typestr(self) -> str:
        """``__array_interface__`` type string of the exported object (``"|u1"`` for untyped buffers)."""
        return self._fields_[9]

    @property
    def offers(self) -> tuple[PathName, ...]:
        """Paths the exporter can serve, fastest first."""
        return self._fields_[10]

    @property
    def lifetime(self) -> str:
        """The exporter's policy: ``"auto"``, ``"closed"``, ``"revoked"``, ``"none"`` or ``"imports=N"``."""
        return self._fields_[11]

    @property
    def fabric(self) -> str | None:
        """The exporter's NVLink fabric clique, for the fabric path."""
        return self._fields_[12]

    @property
    def readonly(self) -> bool:
        """Importers may only read."""
        return self._fields_[13]

    @property
    def offset(self) -> int:
        """Where the exported array starts in the buffer the mapped paths map
        (part of a ``gpushare.allocate`` buffer: a slice, a typed view); 0 for most shares."""
        return self._fields_[14]

    @property
    def dtype_name(self) -> str | None:
        """The exporter's dtype where the typestr cannot say it (``"bfloat16"``,
        ``"datetime64[s]"``), else ``None``."""
        return self._fields_[15]

    @property
    def dlpack_dtype(self) -> tuple[int, int, int] | None:
        """DLPack (code, bits, lanes) of a dtype only DLPack can name (bfloat16, float8, complex32), else ``None``."""
        return self._fields_[16]

    @property
    def strides(self) -> tuple[int, ...] | None:
        """Byte strides of a strided array (``nbytes`` is then the span it
        covers), else ``None`` (C-contiguous)."""
        return self._fields_[17]

    @property
    def is_bundle(self) -> bool:
        """Whether this share is a bundle of many tensors (:func:`gpushare.export`
        of a dict, list or tuple): :func:`gpushare.open` gives a :class:`gpushare.Bundle`."""
        return self._bundle is not None

    @property
    def count(self) -> int:
        """Tensors in the share: 1, or a bundle's count."""
        return 1 if self._bundle is None else self._bundle.count

    # -- wire form ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The share as bytes to send over any transport, trusted or not.

        Compact JSON (ASCII) with a format tag and version; at most
        :data:`MAX_SHARE_BYTES` bytes.  Read it back with :meth:`from_bytes`.
        Like the share itself, the bytes are a capability: whoever holds them
        can open the buffer.

        Returns
        -------
        bytes
        """
        self._leaving()
        f = dict(zip(Share._NAMES, self._fields_, strict=True))
        for name, default in Share._OPTIONAL:
            if f[name] == default:
                del f[name]  # readable by peers that predate the field
        f["token"] = self.token.hex()
        f["control"] = [list(a) for a in self.control]
        f["shape"] = list(self.shape)
        f["offers"] = list(self.offers)
        if "manifest" in f:
            f["manifest"] = base64.b64encode(f["manifest"]).decode("ascii")
        f["format"] = _WIRE_TAG
        return json.dumps(f, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Share:
        """Rebuild a share from :meth:`to_bytes`; safe on bytes from an untrusted peer.

        Nothing is executed: the bytes are parsed as bounded JSON with an
        exact set of keys, and every field is validated as for unpickling.

        Parameters
        ----------
        data : bytes-like
            At most :data:`MAX_SHARE_BYTES` bytes.

        Returns
        -------
        Share

        Raises
        ------
        InvalidInputError
            Anything but a well-formed share of a format this gpushare reads.
        """
        obj = strict_json(data, MAX_BUNDLE_SHARE_BYTES, "Share.from_bytes", "share")
        if len(data) > MAX_SHARE_BYTES and not (isinstance(obj, dict) and "manifest" in obj):
            raise InvalidInputError(f"share is {len(data)} bytes; at most {MAX_SHARE_BYTES} for a share of one "
                                    "buffer")
        if not isinstance(obj, dict) or obj.get("format") != _WIRE_TAG:
            raise InvalidInputError(f"share bytes do not start a {_WIRE_TAG!r} object")
        if "manifest" in obj:
            text = obj["manifest"]
            try:
                if not isinstance(text, str):
                    raise ValueError
                obj["manifest"] = base64.b64decode(text.encode("ascii"), validate=True)
            except (ValueError, binascii.Error):
                raise InvalidInputError("share manifest must be base64 text") from None
        keys = set(obj) - {"format"}
        for name, default in Share._OPTIONAL:
            if name not in keys:
                obj[name] = default
        if not set(Share._BASE) <= keys <= set(Share._NAMES):
            missing, extra = set(Share._BASE) - keys, keys - set(Share._NAMES)
            raise InvalidInputError(
                f"share bytes have the wrong fields (missing {sorted(missing)}, unexpected {sorted(extra)[:5]})"
            )
        token = obj["token"]
        if not isinstance(token, str) or not re.match(r"^[0-9a-f]{64}\Z", token):
            raise InvalidInputError("share token must be 64 lowercase hex digits")
        obj["token"] = bytes.fromhex(token)
        for name in ("shape", "offers", "dlpack_dtype", "strides"):
            if isinstance(obj[name], list):
                obj[name] = tuple(obj[name])
        if isinstance(obj["control"], list):
            obj["control"] = tuple(tuple(a) if isinstance(a, list) else a for a in obj["control"])
        return cls._make(*(obj[name] for name in Share._NAMES))

    def revoke(self) -> None:
        """Exporter side: refuse new opens and stop remote access now.

        Mappings already made on the same node stay valid (the exporter cannot
        unmap another process's memory); ucx-rma views lose access at once.
        Only the exporting process can revoke.
        """
        if _revoke is None:  # no exporter in this process: it exported nothing
            raise ClosedError(f"only the exporting process (pid {self.exporter_pid}) can revoke this share")
        _revoke(self)

    # -- scope -------------------------------------------------------------------
    def __enter__(self) -> Share:
        """``with gs.export(x) as share:``: the share lives for the block.

        Leaving the block (at its end, or by an exception, which goes on)
        revokes the share as :meth:`revoke` does, whatever its lifetime:
        opens are refused from then on, cma and ucx-rma views lose access,
        views mapped on this node stay valid, and the exporter drops its
        reference to the object (docs/lifetimes.md, "Scoped shares").  A
        share already ended or revoked in the block is left as it is.

        Raises
        ------
        ClosedError
            This process did not export the share (only the exporter can
            revoke it; an importer opens it with :func:`gpushare.open`).
        """
        if _revoke is None or self.exporter_pid != os.getpid():
            raise ClosedError(f"only the exporting process (pid {self.exporter_pid}) can scope this share with "
                              "'with' (its exit revokes the share); open it with gpushare.open")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.revoke()
        except ClosedError:
            pass  # ended so long ago that the exporter forgot it: nothing is left to revoke

    def __repr__(self) -> str:
        if self._bundle is not None:
            return (f"<gpushare.Share {self.share_id[:8]} bundle of {self.count} tensors in "
                    f"{len(self._bundle.parts)} allocations, {self.nbytes} bytes, from pid {self.exporter_pid}>")
        return (f"<gpushare.Share {self.share_id[:8]} {self.nbytes} bytes on {self.device} "
                f"from pid {self.exporter_pid}, offers {', '.join(self.offers)}>")


def expect_share(value: Any, caller: str) -> Share:
    """``value``, a :class:`Share`; anything else is an :class:`InvalidTypeError`
    saying what ``caller`` takes (and, for bytes, how to read them back)."""
    if isinstance(value, Share):
        return value
    fix = ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        fix = ("; read bytes from Share.to_bytes() back with gpushare.Share.from_bytes(data) "
               "(a bundle's too: it gives a BundleShare, as BundleShare.from_bytes does)")
    raise InvalidTypeError(f"{caller} expects a gpushare.Share, not {type(value).__name__}{fix}")


#: Each field's place in a share's fields, by name (for :meth:`Share._replace`).
_FIELD_AT = {name: i for i, name in enumerate(Share._NAMES)}


def _rebuild_share(*fields: Any) -> Share:
    return Share._make(*fields)


def altered(device: Any, nbytes: int, offset: int, readonly: bool, real_device: Any, real_nbytes: int,
            real_offset: int, real_readonly: bool) -> str | None:
    """Why a share that says ``device`` (``"host"`` or a CUDA ordinal),
    ``nbytes``, ``offset`` and ``readonly`` cannot name memory its exporter
    made as ``real_*``, or None: a share whose fields were changed (forged,
    corrupt) opens no view."""
    said = "host memory" if device == "host" else f"CUDA memory (device {device})"
    if (real_device == "host") != (device == "host"):
        found = "host memory" if real_device == "host" else "CUDA memory"
        return f"the share says {said}, but its exporter serves {found}: the share was altered (forged or corrupt)"
    if (device, nbytes, offset, readonly) != (real_device, real_nbytes, real_offset, real_readonly):
        def what(d: Any, n: int, o: int, r: bool) -> str:
            at = f" at offset {o}" if o != real_offset or offset != real_offset else ""
            on = f" on device {d}" if d != real_device or device != real_device else ""
            return f"{n} bytes{at}{on}{', read-only' if r else ''}"
        return (f"the share says {what(device, nbytes, offset, readonly)}, but its exporter made it of "
                f"{what(real_device, real_nbytes, real_offset, real_readonly)}: the share was altered "
                "(forged or corrupt)")
    return None


class BundleShare(Share):
    """The share of a bundle: many tensors (:func:`gpushare.export` of a dict,
    list or tuple), opened by :func:`gpushare.open` as a :class:`gpushare.Bundle`.

    A :class:`Share` in every other way: plain data, pickled or sent as
    :meth:`~Share.to_bytes` and validated the same way, its manifest (each
    allocation, and each tensor's offset, dtype, shape and strides in it)
    included.  ``nbytes`` is the bytes of all its allocations.
    """

    __slots__ = ()

    @property
    def allocations(self) -> int:
        """How many allocations its tensors lie in: each one offer (an fd, a
        mapping, an IPC handle or a region) when opened."""
        return len(self._bundle.parts)


def _bundle_of(manifest: Any, fields: tuple, made: _manifest.Manifest | None = None) -> _manifest.Manifest:
    """A bundle's manifest, validated (or ``made`` here from the same bytes),
    and checked against the share's own fields (which describe the bundle
    as a whole)."""
    decoded = _manifest.decode(manifest) if made is None or made.digest != _manifest.digest(manifest) else made
    parts = decoded.parts
    f = dict(zip(Share._NAMES, fields, strict=True))
    nbytes = f["nbytes"]
    union = tuple(p for p in path_names() if any(p in part.offers for part in parts))
    total = sum(part.nbytes for part in parts)
    whole = (f["offset"], f["dtype_name"], f["dlpack_dtype"], f["strides"]) == (0, None, None, None)
    if (nbytes != total or f["device"] != parts[0].device or f["shape"] != (nbytes,) or f["typestr"] != "|u1"
            or f["offers"] != union or not whole or f["readonly"] != all(p.readonly for p in parts)
            or f["fabric"] != parts[0].fabric):
        raise InvalidInputError("a bundle's share fields do not describe its manifest (altered or corrupt)")
    return decoded
