"""The control channel: framing and plain-data encoding.

Frames are a 4-byte big-endian length then UTF-8 JSON (never pickle: the
peer is untrusted), at most 64 KiB, nested at most 16 deep.  Bytes are
encoded as ``{"b": "<hex>"}`` and tuples as lists; descriptors travel as
their handle type and fields and are rebuilt through their validating
constructor.  Every frame from a peer is parsed by :func:`parse` (the one
place that bounds size and depth), whether it was read by the service
thread (:func:`take_frames`) or by a blocking caller (:func:`recv`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from ._errors import ExporterUnreachableError, InvalidInputError

__all__ = ["send", "recv", "encode", "decode", "pack", "pack_split", "Assembly", "parse", "take_frame",
           "take_frames", "bind_host", "keepalive", "MAX_FRAME", "PROTOCOL", "TIMEOUT"]

MAX_FRAME = 64 * 1024
#: The control protocol both ends speak; a ``hello`` names it.
PROTOCOL = 4
#: Seconds one exchange on the control channel may take.
TIMEOUT = 10.0
_LEN = struct.Struct("!I")


def encode(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot encode {type(value).__name__} on the control channel")


#: What JSON decodes to that :func:`decode` returns as it is.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def decode(value: Any, depth: int = 0) -> Any:
    if depth > 16:
        raise InvalidInputError("control message nested too deeply")
    # Below the deepest level a scalar item is itself (what decode() would return).
    if isinstance(value, list):
        if depth < 16:
            return tuple([v if type(v) in _SCALARS else decode(v, depth + 1) for v in value])
        return tuple(decode(v, depth + 1) for v in value)
    if isinstance(value, dict):
        if len(value) == 1 and "b" in value and isinstance(value["b"], str):
            try:
                return bytes.fromhex(value["b"])
            except ValueError:
                raise InvalidInputError("control message holds malformed hex bytes") from None
        if depth < 16:
            return {k: v if type(v) in _SCALARS else decode(v, depth + 1) for k, v in value.items()}
        return {k: decode(v, depth + 1) for k, v in value.items()}
    return value


def _hex_bytes(value: Any) -> Any:
    """For the JSON encoder: bytes as :func:`encode` writes them; nothing else."""
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    raise TypeError(f"cannot encode {type(value).__name__} on the control channel")


#: :func:`encode` then ``json.dumps``, in one pass of the C encoder (the
#: same text for keys that are str or int, as every message's are).
_encode_fast = json.JSONEncoder(separators=(",", ":"), default=_hex_bytes).encode


def pack(message: dict) -> bytes:
    """One frame: the length, then the message as JSON."""
    try:
        data = _encode_fast(message).encode()
    except TypeError:  # a key of another type (str() of it, as encode() writes it), or a value none can encode
        data = json.dumps(encode(message), separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise InvalidInputError(f"control message is {len(data)} bytes; at most {MAX_FRAME}")
    return _LEN.pack(len(data)) + data


#: Room left in each frame of a split message for its other fields.
_SPLIT_ROOM = 1024


def pack_split(message: dict, holder: dict, keys: tuple[str, ...]) -> bytes:
    """``message`` as one frame, or, where it does not fit in one, as a first
    frame with ``more: K`` and K continuation frames ``{"id": ..., "cont":
    {key: [...], ...}}`` that carry the rest of the lists ``holder[key]``
    (parallel lists of one length, cut at the same places; ``holder`` is
    ``message`` or a dict inside it), each item whole, in order.  The
    receiver (:class:`Assembly`) joins them, bounded by what it expects."""
    try:
        return pack(message)
    except InvalidInputError:
        lists = [holder.get(key) for key in keys]
        if not all(isinstance(items, list) and items and len(items) == len(lists[0]) for items in lists):
            raise
    sizes = [sum(len(_encode_fast(items[i])) + 1 for items in lists) for i in range(len(lists[0]))]
    cuts, used = [0], 0
    for i, size in enumerate(sizes):
        if size > MAX_FRAME - _SPLIT_ROOM:
            raise InvalidInputError(f"one item of a control message is {size} bytes; at most "
                                    f"{MAX_FRAME - _SPLIT_ROOM}")
        if used + size > MAX_FRAME - _SPLIT_ROOM and i > cuts[-1]:
            cuts.append(i)
            used = 0
        used += size
    cuts.append(len(sizes))
    chunks = [{key: items[a:b] for key, items in zip(keys, lists, strict=True)} for a, b in zip(cuts, cuts[1:])]
    holder.update(chunks[0])
    try:
        first = pack({**message, "more": len(chunks) - 1})
    finally:
        holder.update(zip(keys, lists))
    return first + b"".join(pack({"id": message.get("id"), "cont": chunk}) for chunk in chunks[1:])


class Assembly:
    """A split message (:func:`pack_split`) being received: the first frame
    (whose lists ``holder[key]`` begin the items), then ``more`` continuation
    frames of the same id, each with at least one item of every list; at most
    ``bound`` items in all."""

    __slots__ = ("message", "holder", "lists", "left", "bound")

    def __init__(self, message: dict, holder: Any, keys: tuple[str, ...], bound: int) -> None:
        more = message.get("more")
        if type(more) is not int or not 0 < more <= bound:
            raise InvalidInputError(f"a split control message announces {more!r:.20} more frames; at most {bound}")
        firsts = [holder.get(key) if isinstance(holder, dict) else None for key in keys]
        if not all(isinstance(items, (list, tuple)) for items in firsts):
            raise InvalidInputError("a split control message's first frame lacks its lists")
        self.message, self.holder, self.left, self.bound = message, holder, more, bound
        self.lists = {key: list(items) for key, items in zip(keys, firsts, strict=True)}  # type: ignore[arg-type]
        self._check()

    def _check(self) -> None:
        lengths = {len(items) for items in self.lists.values()}
        if len(lengths) != 1 or lengths.pop() > self.bound:
            raise InvalidInputError(f"a split control message holds lists of unequal lengths or more than the "
                                    f"{self.bound} items expected")

    def add(self, frame: dict) -> bool:
        """Take the next frame; True once the message is whole (``lists`` complete)."""
        cont = frame.get("cont")
        if frame.get("id") != self.message.get("id") or len(frame) != 2 or not isinstance(cont, dict) \
                or set(cont) != set(self.lists) or not all(isinstance(v, (list, tuple)) and v for v in cont.values()):
            raise InvalidInputError("a split control message's frames are out of order or malformed")
        for key, items in cont.items():
            self.lists[key].extend(items)
        self._check()
        self.left -= 1
        return self.left == 0

    def whole(self) -> dict:
        """The message once :meth:`add` said so: its lists complete, ``more`` gone."""
        self.holder.update({key: tuple(items) for key, items in self.lists.items()})
        del self.message["more"]
        return self.message


def send(sock: socket.socket, message: dict) -> None:
    sock.sendall(pack(message))


def parse(body: bytes) -> dict:
    """A frame's body as a message; anything but a bounded JSON object is refused."""
    try:
        message = json.loads(body.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidInputError("control frame is not JSON") from None
    if not isinstance(message, dict):
        raise InvalidInputError("control frame is not an object")
    return decode(message)


def take_frame(buf: bytearray) -> dict | None:
    """Remove the first frame of ``buf`` and return its message; None while
    it is incomplete (the bytes stay for the next read)."""
    if len(buf) < _LEN.size:
        return None
    (length,) = _LEN.unpack_from(buf)
    if length > MAX_FRAME:
        raise InvalidInputError(f"control frame of {length} bytes; at most {MAX_FRAME}")
    end = _LEN.size + length
    if len(buf) < end:
        return None
    message = parse(bytes(buf[_LEN.size : end]))
    del buf[:end]
    return message


def take_frames(buf: bytearray) -> list[dict]:
    """Remove the complete frames at the start of ``buf`` and return their
    messages; a partial frame stays for the next read."""
    messages = []
    while (message := take_frame(buf)) is not None:
        messages.append(message)
    return messages


def bind_host() -> str:
    """Where listeners bind: ``GPUSHARE_CONTROL_HOST``, by default every interface."""
    host = os.environ.get("GPUSHARE_CONTROL_HOST", "0.0.0.0")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise InvalidInputError(
            f"GPUSHARE_CONTROL_HOST is {host!r}; expected an IPv4 address of this host "
            "(or 0.0.0.0 for every interface)"
        ) from None
    return host


def keepalive(sock: socket.socket, idle: int, interval: int, count: int, user_timeout_ms: int | None = None) -> None:
    """TCP keepalive on ``sock`` (and no Nagle delay): a peer on a node that
    vanished (power, partition) is noticed after about ``idle + interval *
    count`` seconds, or once unacknowledged data waited ``user_timeout_ms``.
    Unix sockets need none: the kernel ends them with the process."""
    if sock.family != socket.AF_INET:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                       ("TCP_USER_TIMEOUT", user_timeout_ms)):
        if value is not None and hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None,
                check: Callable[[], None] | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("control channel peer too slow")
        else:
            left = None
        if check is not None:  # wake each second to ask whether waiting still makes sense
            left = 1.0 if left is None else min(left, 1.0)
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - got)
        except TimeoutError:
            if check is None:
                raise
            check()
            continue
        if not chunk:
            raise EOFError("control channel closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, timeout: float | None = TIMEOUT, check: Callable[[], None] | None = None) -> dict:
    """Read one frame; ``timeout=None`` waits until the peer sends or closes.
    ``check``, called after each second of waiting, may end the wait by
    raising."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, check))
    if length > MAX_FRAME:
        raise InvalidInputError(f"control frame of {length} bytes; at most {MAX_FRAME}")
    return parse(_recv_exact(sock, length, deadline, check))


def connect(addresses: tuple[tuple[str, int], ...], timeout: float) -> socket.socket:
    """Connect to the first address that answers, within ``timeout`` in all."""
    deadline = time.monotonic() + timeout
    errors = []
    for host, port in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.create_connection((host, port), timeout=min(left, max(1.0, left / 2)))
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or exc}")
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise ExporterUnreachableError(
        "cannot reach the exporter's control channel: " + ("; ".join(errors) or f"timed out after {timeout} s")
    )
