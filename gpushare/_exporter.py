"""The exporter's side of :func:`gpushare.export`: registry, control channel, lifetimes.

Started on the first export (never on import of gpushare): a TCP listener and
one daemon thread accepting importers, one thread per open importer session.
An importer keeps its control connection open for as long as its view is
open: that connection is its lease, and its end (a close, or the importer's
death, which the kernel reports as the connection closing) counts as the
import closing.  In a forked child the parent's exporter is never used: the
child starts its own on its first export.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import socket
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from . import _control
from ._errors import ClosedError, GpuShareError, InvalidInputError
from ._process import PerProcess

__all__ = ["Exporter", "get_exporter", "registered", "revoke", "advertised_addresses"]

log = logging.getLogger("gpushare.export")


def _ipv4_addresses() -> list[str]:
    """This host's IPv4 addresses (up interfaces, loopback excluded)."""
    import fcntl
    import struct

    addrs: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if not ip.startswith("127.") and ip not in addrs:
                addrs.append(ip)
    return addrs


def advertised_addresses(port: int, bind_host: str) -> tuple[tuple[str, int], ...]:
    """Where importers can reach a control listener bound to ``bind_host``."""
    if bind_host not in ("0.0.0.0", ""):
        return ((bind_host, port),)
    return tuple([("127.0.0.1", port)] + [(ip, port) for ip in _ipv4_addresses()][:15])


@dataclass
class Export:
    """One exported buffer, as the exporter tracks it."""

    share_id: str
    token: bytes
    nbytes: int
    device: Any
    memory_type: str
    offers: tuple[str, ...]
    descriptors: dict[str, Any]
    policy: Any  # "closed" | "revoked" | "none" | int
    obj: Any = None
    obj_ref: Any = None
    opens: int = 0
    total: int = 0
    revoked: bool = False
    retired: bool = False
    readonly: bool = False
    registrations: list = field(default_factory=list)
    agent: Any = None
    mh: Any = None
    key: bytes | None = None
    # Re-entrant: releasing the last reference to the object (closing the
    # share's agent) can run the weak-reference callback in the same thread.
    lock: threading.RLock = field(default_factory=threading.RLock)

    def target(self) -> Any:
        if self.obj is not None:
            return self.obj
        return self.obj_ref() if self.obj_ref is not None else None

    # -- policy ---------------------------------------------------------
    def refusal(self) -> str | None:
        """Why a new open is refused now, or None (call with the lock held)."""
        if self.revoked:
            return "revoked"
        if self.retired or self.target() is None:
            return "retired"
        if isinstance(self.policy, int) and self.total >= self.policy:
            return "exhausted"
        return None

    def after_close(self) -> None:
        """Apply the lifetime policy after an import closed (lock held)."""
        if self.opens > 0:
            return
        if self.policy == "closed" and self.total >= 1:
            self.retire()
        elif isinstance(self.policy, int) and self.total >= self.policy:
            self.retire()
        elif self.policy == "none":
            self.close_remote()  # the UCX registration would keep the object alive

    def close_remote(self) -> None:
        agent, self.agent, self.mh, self.key = self.agent, None, None, None
        if agent is not None:
            agent.close()  # every remote endpoint to it dies: remote access stops

    def close_mapped(self) -> None:
        """Stop handing out this share's fds: a descriptor given out before is dead."""
        regs, self.registrations = self.registrations, []
        if regs:
            from ._api import _release_registrations

            _release_registrations(regs)

    def retire(self) -> None:
        if not self.retired:
            log.info("share %s retired: its lifetime (%s) ended", self.share_id[:8], self.policy)
        self.retired = True
        self.close_remote()
        self.close_mapped()
        self.obj = None

    # -- ucx-rma --------------------------------------------------------
    def rma_offer(self) -> tuple[bytes, bytes]:
        """Agent address and serialized key for this export (lock held)."""
        if self.agent is None:
            from . import ucx

            target = self.target()
            agent = ucx.Agent(config=_rma_config(target))
            try:
                mh = agent.create_memory_handle(self.nbytes, target, memory_type=self.memory_type)
                key = mh.create_remote_key().serialize()
            except BaseException:
                agent.close()
                raise
            self.agent, self.mh, self.key = agent, mh, key
        return self.agent.address, self.key


def _rma_config(target: Any) -> dict[str, str]:
    """UCX settings for serving ``target`` over ucx-rma.

    UCX's ``cuda_ipc`` transport takes CUDA virtual memory only when it was
    made with fabric handles, and maps just the one physical allocation at
    the registered address: over it, a buffer of several allocations would
    expose its first one only.  For such buffers it is left out, and UCX
    moves the data through its other transports (staged through host memory
    on one node).
    """
    from ._paths import cuda_vmm

    if cuda_vmm.is_vmm_buffer(target):
        mr = target.memory_resource
        if len(mr.sizes) > 1 or "fabric" not in mr.handle_types:
            return {"TLS": "^cuda_ipc"}
    return {}


class Exporter:
    """This process's exporter service; use :func:`get_exporter`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        bind_host = os.environ.get("GPUSHARE_CONTROL_HOST", "0.0.0.0")
        try:
            ipaddress.IPv4Address(bind_host)
        except ValueError:
            raise InvalidInputError(
                f"GPUSHARE_CONTROL_HOST is {bind_host!r}; expected an IPv4 address of this host "
                "(or 0.0.0.0 for every interface)"
            ) from None
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(128)
        self.addresses = advertised_addresses(self._listener.getsockname()[1], bind_host)
        self._lock = threading.Lock()
        self._exports: dict[str, Export] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._accept_loop, name="gpushare-exporter", daemon=True)
        self._thread.start()

    # -- registry -------------------------------------------------------
    def add(self, export: Export) -> None:
        with self._lock:
            self._exports[export.share_id] = export

    def get(self, share_id: str) -> Export | None:
        with self._lock:
            return self._exports.get(share_id)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            exports = list(self._exports.values())
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for exp in exports:
            with exp.lock:
                exp.close_remote()

    def abandon(self) -> None:
        """In a forked child: drop the inherited socket, touch nothing else."""
        self._stopped = True
        try:
            self._listener.close()
        except OSError:
            pass

    # -- serving --------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # An importer on a node that vanishes without closing (power loss,
            # partition) ends its lease within about a minute.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
            threading.Thread(target=self._session, args=(conn,), name="gpushare-lease", daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        export: Export | None = None
        leased = False
        try:
            hello = _control.recv(conn)
            if hello.get("op") != "hello":
                _control.send(conn, {"ok": False, "code": "bad", "message": "expected hello"})
                return
            share_id, token = hello.get("share"), hello.get("token")
            export = self.get(share_id) if isinstance(share_id, str) else None
            if export is None:
                _control.send(conn, {"ok": False, "code": "unknown",
                                     "message": "the exporter has no such share (closed, or never exported here)"})
                return
            if not isinstance(token, bytes) or not hmac.compare_digest(token, export.token):
                log.warning("refused an open of share %s from %s: wrong token", export.share_id[:8],
                            _peer(conn))
                _control.send(conn, {"ok": False, "code": "denied", "message": "wrong token for this share"})
                return
            _control.send(conn, {"ok": True})
            while True:
                msg = _control.recv(conn, timeout=None if leased else _control.TIMEOUT)
                op = msg.get("op")
                if op == "open" and not leased:
                    leased = self._open(conn, export, msg.get("path"))
                elif op == "failed" and leased:
                    log.debug("share %s: the importer at %s could not use its path", export.share_id[:8],
                              _peer(conn))
                    with export.lock:
                        export.opens -= 1
                        export.total -= 1
                        export.after_close()
                    leased = False
                elif op == "close":
                    return
                else:
                    _control.send(conn, {"ok": False, "code": "bad", "message": f"unexpected {op!r:.20}"})
                    return
        except (EOFError, OSError, TimeoutError, InvalidInputError):
            return  # the importer closed, died or misbehaved: its lease ends
        finally:
            if leased and export is not None:
                log.info("share %s: lease of %s ended", export.share_id[:8], _peer(conn))
                with export.lock:
                    export.opens -= 1
                    export.after_close()
            try:
                conn.close()
            except OSError:
                pass

    def _open(self, conn: socket.socket, export: Export, path: Any) -> bool:
        with export.lock:
            refusal = export.refusal()
            if refusal is not None:
                _control.send(conn, {"ok": False, "code": refusal, "message": _REFUSALS[refusal]})
                return False
            if path not in export.offers or path == "same-process":
                _control.send(conn, {"ok": False, "code": "path", "message": f"path {path!r:.20} is not offered"})
                return False
            try:
                if path == "ucx-rma":
                    address, key = export.rma_offer()
                    payload = {"address": address, "key": key}
                else:
                    desc = export.descriptors[path]
                    payload = {"descriptor": [desc.handle_type, *desc._fields()]}
            except GpuShareError as exc:
                _control.send(conn, {"ok": False, "code": "path", "message": f"exporter cannot serve {path}: {exc}"})
                return False
            export.opens += 1
            export.total += 1
        log.info("share %s: lease opened over %s by %s", export.share_id[:8], path, _peer(conn))
        _control.send(conn, {"ok": True, "payload": payload})
        return True


_REFUSALS = {
    "revoked": "the share was revoked by its exporter",
    "retired": "the share is no longer available: its lifetime ended (every importer closed it, or the object is gone)",
    "exhausted": "the share was opened as many times as its lifetime allows",
}

_service: PerProcess[Exporter] = PerProcess(Exporter, stop=Exporter.stop, abandon=Exporter.abandon)


def get_exporter() -> Exporter:
    """This process's exporter, started on first use (and again after fork)."""
    return _service.get()


def registered(share: Any) -> Export | None:
    """The export behind ``share`` if this very process made it."""
    exp = _service.current()
    if exp is None or share.exporter_pid != os.getpid():
        return None
    export = exp.get(share.share_id)
    if export is None or not hmac.compare_digest(export.token, share.token):
        return None
    return export


def revoke(share: Any) -> None:
    export = registered(share)
    if export is None:
        raise ClosedError(
            f"only the exporting process (pid {share.exporter_pid}) can revoke this share"
        )
    log.info("share %s revoked", share.share_id[:8])
    with export.lock:
        export.revoked = True
        export.close_remote()
        export.close_mapped()
        export.obj = None


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "a closed connection"
    return f"{host}:{port}"


def new_ids() -> tuple[str, bytes]:
    return secrets.token_hex(16), secrets.token_bytes(32)


def weak_or_none(obj: Any, export: Export) -> Any:
    """A weak reference to ``obj`` that retires ``export`` when ``obj`` goes."""
    def retire() -> None:
        with export.lock:
            export.retire()

    def gone(_: Any) -> None:
        # Weak-reference callbacks run wherever the last reference went,
        # possibly under locks of their own: retire from a thread of its own.
        export.retired = True
        try:
            threading.Thread(target=retire, name="gpushare-retire", daemon=True).start()
        except RuntimeError:
            pass  # interpreter shutdown: the exporter's exit hook closes everything

    try:
        return weakref.ref(obj, gone)
    except TypeError:
        raise InvalidInputError(
            f"lifetime='none' keeps no reference, so it needs an object that supports weak "
            f"references; {type(obj).__name__} does not (wrap it, or use another lifetime)"
        ) from None
