"""The consumer's end of a channel's connection: connecting, the join's
mutual challenge, and the records that arrive."""

from __future__ import annotations

import os
import socket
import time
from collections import deque

from .. import _auth, _control
from .._errors import AccessDeniedError, ChannelBrokenError, InvalidInputError
from .._process import node_key
from .waits import _pidfd, _peer_pid, _exited, _why_gone
from .handle import ChannelHandle
from .records import PROTOCOL, _PUBLISH, _END, _ABORT, _FAILED, _HANDSHAKE_TIMEOUT, _KEEPALIVE, _Wire, _heartbeat

__all__ = []



class _Inbox:
    """What a consumer's producer told it: the steps published and not yet
    taken, the end, or why the channel broke."""

    __slots__ = ("broken", "end", "queue", "slots", "who")

    def __init__(self, handle: ChannelHandle) -> None:
        self.slots, self.who = handle.slots, f"the channel's producer (pid {handle.producer_pid})"
        self.queue: deque[tuple[int, int]] = deque()  # (step, slot)
        self.end: int | None = None
        self.broken: str | None = None

    def gone(self, detail: str) -> None:
        self.broken = f"{self.who} {detail} without closing the channel"

    def check_alive(self, wire: _Wire, pid: int, local: bool) -> bool:
        """For a waiting consumer: whether the producer, not done, stopped answering (then broken)."""
        if self.end is None and self.broken is None:
            self.broken = wire.frozen(time.monotonic(), self.who, pid, local)
        return self.broken is not None

    def pump(self, wire: _Wire, woken: frozenset[int], pidfd: int | None) -> None:
        """Take in every record that arrived; never blocks.  ``woken``: the
        fds a wait found readable (``pidfd`` there: the producer exited)."""
        if self.broken is not None:
            return
        eof = self._parse(*wire.read())
        if eof is None and self.end is None and pidfd in woken and _exited(pidfd):
            # The producer exited: what it sent before is still to be read.
            eof = self._parse(*wire.read()) or "exited"
        if eof is not None and self.end is None and self.broken is None:
            self.gone(_why_gone(eof, pidfd))

    def _parse(self, records: list[tuple[int, int, int]], eof: str | None) -> str | None:
        for op, slot, step in records:
            if self.broken is not None:
                break
            if op == _PUBLISH and slot < self.slots:
                self.queue.append((step, slot))
            elif op == _END:
                self.end = step
            elif op == _FAILED:
                self.broken = f"{self.who} gave up on an error after {step} steps"
            elif op == _ABORT:
                self.broken = (f"consumer {slot} of the channel died or closed its connection without leaving; "
                               "the producer stopped the channel")
            else:
                self.broken = f"the producer sent a malformed message (op {op})"
        return eof


def _connect(handle: ChannelHandle, timeout: float) -> socket.socket:
    pid = handle.producer_pid
    errors = []
    if handle._field("node") == node_key():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(f"\0{handle._field('unix')}")
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"unix socket: {exc}")
        addresses = [a for a in handle._field("tcp") if a[0] == "127.0.0.1"]
    else:
        addresses = [a for a in handle._field("tcp") if not a[0].startswith("127.")]
    for host, port in addresses:
        try:
            return socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc}")
    raise ChannelBrokenError(f"cannot reach the channel's producer (pid {pid}): {'; '.join(errors) or 'no address'}; "
                             "it may have exited or closed the channel")




def _handshake(sock: socket.socket, handle: ChannelHandle, timeout: float = _HANDSHAKE_TIMEOUT) -> int:
    """Join the channel on a new connection (blocking, ``timeout`` seconds in
    all): prove, each to the other, that both hold the token; the consumer's
    index."""
    deadline = time.monotonic() + timeout
    token, pid = handle._field("token"), handle.producer_pid
    mine = _auth.new_nonce()

    def recv() -> dict:
        try:
            return _control.recv(sock, max(0.01, deadline - time.monotonic()))
        except EOFError:
            raise AccessDeniedError(f"the channel's producer (pid {pid}) refused the connection: the handle is "
                                    "not valid for it, or it runs another gpushare version") from None

    _control.send(sock, {"op": "join", "v": PROTOCOL, "channel": handle.channel_id, "pid": os.getpid(),
                         "nonce": mine})
    reply = recv()
    if reply.get("ok") is not True:
        raise AccessDeniedError(f"the channel's producer (pid {pid}) refused the join: "
                                f"{str(reply.get('message'))[:200]}")
    theirs = reply.get("nonce")
    if not isinstance(theirs, bytes) or len(theirs) != _auth.NONCE_BYTES or not _auth.verify(
            "producer", mine, theirs, reply.get("proof"), secret=token):
        raise AccessDeniedError("the channel's producer did not prove it holds the channel's token")
    _control.send(sock, {"op": "auth", "proof": _auth.proof("consumer", mine, theirs, secret=token)})
    answer = recv()
    code, index = answer.get("code"), answer.get("index")
    if code == "full":
        raise AccessDeniedError(f"the channel already has its {handle.consumers} consumers")
    if code == "closed":
        raise ChannelBrokenError("the channel's producer is closing the channel")
    if answer.get("ok") is not True:
        raise AccessDeniedError(f"the channel's producer (pid {pid}) refused the join: "
                                f"{str(answer.get('message'))[:200]}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < handle.consumers:
        raise InvalidInputError(f"the producer answered consumer index {index!r:.20}")
    return index


def _join(handle: ChannelHandle, timeout: float) -> tuple[_Wire, int, int | None]:
    """Connect and join: this consumer's end of the connection (its
    heartbeat started), its index, and a pidfd of the producer (on its node)."""
    sock = _connect(handle, timeout)
    try:
        _control.keepalive(sock, *_KEEPALIVE)
        try:
            index = _handshake(sock, handle, timeout)
        except OSError as exc:
            raise AccessDeniedError(f"the channel's producer (pid {handle.producer_pid}) refused the "
                                    f"connection: the handle is not valid for it ({exc})") from None
        peer = _peer_pid(sock)
    except BaseException:
        sock.close()
        raise
    wire = _Wire(sock)
    _heartbeat(wire)
    return wire, index, _pidfd(peer) if peer is not None else None
