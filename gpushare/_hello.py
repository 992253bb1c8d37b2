"""The importer's way in to an exporter: a control connection over the
exporter's Unix socket on this node (credentials checked both ways), the
hello, and the mutual proof of the key (:mod:`gpushare._auth`)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from . import _auth, _control
from ._errors import AccessDeniedError, ExporterUnreachableError, GpuShareError
from ._paths.broker import check_peer, control_address
from ._process import Stopped, node_key

__all__ = ["seconds_left", "connect_local", "say_hello", "refusal_error"]


def seconds_left(deadline: float) -> float:
    """Seconds until ``deadline``; :class:`TimeoutError` once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the open ran out of time")
    return left


def connect_local(share: Any, deadline: float) -> socket.socket | None:
    """A control connection over the exporter's Unix socket, when it is on
    this node and answers as the exporter, of this user or root; else None
    (and the caller uses TCP)."""
    if share.node != node_key():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(seconds_left(deadline))
        sock.connect(control_address(share.exporter_pid, share.control[0][1]))
        check_peer(sock, share.exporter_pid, "the control socket")
        say_hello(sock, share.exporter_pid, deadline, share.node)
    except AccessDeniedError:
        sock.close()
        raise  # a refusal is final: no other way in is tried
    except (OSError, EOFError, GpuShareError):
        sock.close()
        return None
    return sock


def say_hello(sock: socket.socket, exporter_pid: int, deadline: float, node: str = "") -> None:
    """Say hello on a new control connection, and prove with the exporter,
    each to the other, that both hold the key (:mod:`gpushare._auth`).  The
    hello says nothing about this process (a nonce and the protocol only);
    its pid and node go with its proof, once the exporter proved the key.
    Nothing the exporter says is used before that."""
    our_nonce = _auth.new_nonce()
    _control.send(sock, {"op": "hello", "v": _control.PROTOCOL, "nonce": our_nonce})
    reply = _control.recv(sock, seconds_left(deadline), Stopped(exporter_pid, node))
    if reply.get("code") == "denied":
        raise refusal_error(exporter_pid, reply)
    if not reply.get("ok") or reply.get("op") != "hello" or reply.get("v") != _control.PROTOCOL:
        why = reply.get("message") or f"it speaks control protocol {reply.get('v')!r:.20}, not {_control.PROTOCOL}"
        raise ExporterUnreachableError(
            f"exporter pid {exporter_pid} refused the connection: {str(why)[:200]} "
            "(run the same gpushare version on both sides)"
        )
    theirs = reply.get("nonce")
    if not isinstance(theirs, bytes) or len(theirs) != _auth.NONCE_BYTES or not _auth.verify(
            "exporter", our_nonce, theirs, reply.get("proof")):
        raise AccessDeniedError(
            f"the exporter (pid {exporter_pid}) could not prove it holds this process's key: it is another "
            "program (set the same key on both sides: GPUSHARE_AUTHKEY or gpushare.set_authkey) or an impostor"
        )
    _control.send(sock, {"op": "auth", "proof": _auth.proof("importer", our_nonce, theirs), "pid": os.getpid(),
                         "node": node_key()})


def refusal_error(exporter_pid: int, reply: dict) -> GpuShareError:
    """The error for an exporter's refusal of the connection (its hello, or
    this process's proof of the key): the same on this node and from another."""
    message = str(reply.get("message"))[:300]
    if reply.get("code") == "denied":
        return AccessDeniedError(f"exporter pid {exporter_pid} refused this process: {message}")
    return ExporterUnreachableError(f"exporter pid {exporter_pid} refused the connection: {message}")
