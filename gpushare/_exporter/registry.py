"""The exporter's registry: this process's exports by share id, the ended
shares it remembers, its control listeners (TCP and, for this node, a Unix
socket), and :func:`revoke`.  Started on the first export; in a forked
child, anew."""

from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from .. import _auth, _control, _paths, _reopen, _share
from .._errors import ClosedError, GpuShareError
from .._paths.broker import control_address, may_share
from .._process import PerProcess
from .._service import get_service
from . import sessions
from .lifetimes import Export
from .sessions import MAX_ENDED, Session, _peer

__all__ = ["Exporter", "get_exporter", "is_live", "registered", "revoke", "advertised_addresses", "new_ids"]

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


class Exporter:
    """This process's exporter service; use :func:`get_exporter`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        _auth.key()  # a malformed GPUSHARE_AUTHKEY fails the first export, not each importer's hello
        bind_host = _control.bind_host()
        self._lock = threading.Lock()
        self._exports: dict[str, Export] = {}
        # Ended shares, newest last: share id -> (token, why), so that a late
        # open hears "revoked" rather than "no such share".  Bounded.
        self._ended: collections.OrderedDict[str, tuple[bytes, str]] = collections.OrderedDict()
        self._sessions: set[Session] = set()
        #: The state page (:mod:`gpushare._reopen`): one fd for the process;
        #: None where this kernel cannot make one (no view is kept then).
        self._page = _reopen.make_page()
        self.messages = 0  # control messages served, for tests and benchmarks
        self._stopped = False
        self._service = get_service()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((bind_host, 0))
            self._listener.listen(1024)
            port = self._listener.getsockname()[1]
            self.addresses = advertised_addresses(port, bind_host)
            self._service.listen(self._listener, self._accept)
        except BaseException:
            self._listener.close()
            raise
        self._local = self._listen_local(port)

    def _listen_local(self, port: int) -> socket.socket | None:
        """The control channel for importers on this node: a Unix socket at
        an address importers derive from the share (pid and port), over which
        host-fd opens get their fds with the reply.  None if the address is
        taken (importers then use TCP and the broker)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(control_address(self.pid, port))
            sock.listen(1024)
            self._service.listen(sock, self._accept_local)
        except OSError:
            sock.close()
            return None
        return sock

    # -- registry -------------------------------------------------------
    def add(self, export: Export) -> None:
        export.on_end = self._forget
        with self._lock:
            self._exports[export.share_id] = export

    def get(self, share_id: str) -> Export | None:
        with self._lock:
            return self._exports.get(share_id)

    def _forget(self, export: Export, reason: str) -> None:
        self._free_slot(export)
        with self._lock:
            if self._exports.get(export.share_id) is export:
                del self._exports[export.share_id]
            self._ended[export.share_id] = (export.token, reason, export.policy)
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)

    def keep_slot(self, export: Export) -> tuple[int, int] | None:
        """For an open of ``export`` that the importer may keep after its view
        closes: the share's slot and epoch on the state page; None when the
        page is full or cannot be made (in the service thread, the export's
        lock held)."""
        if self._page is None:
            return None
        if export.slot is None:
            export.slot = self._page.assign()
        return export.slot

    def page_fd(self) -> int:
        """A duplicate of the state page's fd (the caller owns it; after :meth:`keep_slot` gave a slot)."""
        if self._page is None:
            raise GpuShareError("the exporter has no state page")
        try:
            return self._page.give()
        except OSError as exc:
            raise GpuShareError(f"cannot duplicate the state page's fd: {exc.strerror}") from None

    def ended(self, share_id: str) -> tuple[bytes, str, Any] | None:
        with self._lock:
            return self._ended.get(share_id)

    def stats(self) -> dict[str, int]:
        """Sizes of the registry and the sessions (for tests and benchmarks)."""
        with self._lock:
            conns = [s.conn for s in self._sessions if s.conn is not None]
            return {"exports": len(self._exports), "ended": len(self._ended),
                    "sessions": len(self._sessions), "messages": self.messages,
                    "local_sessions": sum(s.local for s in self._sessions),
                    "leases": sum(len(s.leases) for s in self._sessions),
                    "queued_bytes": sum(c.backlog() for c in conns),
                    "queued_fds": sum(c.backlog_fds() for c in conns)}

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            exports = list(self._exports.values())
        _paths.stop()  # no copy goes on into an importer once the connections close
        self._service.unlisten(self._listener)
        if self._local is not None:
            self._service.unlisten(self._local)
        for exp in exports:
            with exp.lock:
                exp.close_remote()

    def abandon(self) -> None:
        """In a forked child: forget everything; the service closes the
        inherited sockets without touching the parent's."""
        self._stopped = True
        self._exports = {}
        self._sessions = set()
        self._lock = threading.Lock()
        self._page = None  # the parent's: this process writes no word of it

    def sealed(self) -> None:
        """A buffer was sealed: a writable share of it now opens over a path
        that copies, so no kept view of a writable share may be reopened
        (each gets a new slot at its next open)."""
        with self._lock:
            exports = [e for e in self._exports.values() if e.slot is not None and not e.readonly]
        for export in exports:
            with export.lock:
                self._free_slot(export)

    def _free_slot(self, export: Export) -> None:
        """No importer reopens ``export`` from a kept view from now on (its lock held)."""
        slot, export.slot = export.slot, None
        if slot is not None and self._page is not None:
            self._page.clear(slot[0])

    # -- serving (in the service thread) ----------------------------------
    def _accept(self, sock: socket.socket) -> None:
        # An importer on a node that vanishes without closing (power loss,
        # partition) ends its leases within about a minute.
        _control.keepalive(sock, 30, 10, 3)
        self._serve(sock, Session(self))

    def _accept_local(self, sock: socket.socket) -> None:
        # Checked before a byte is read, as the fd broker does.
        if not may_share(sock):
            if sessions.refusals.allow():
                log.warning("refused a control connection from %s: another user", _peer(sock))
            sock.close()
            return
        self._serve(sock, Session(self, local=True))

    def _serve(self, sock: socket.socket, session: Session) -> None:
        with self._lock:
            self._sessions.add(session)
        self._service.connect(sock, session, time.monotonic() + _control.TIMEOUT)


_instance: PerProcess[Exporter] = PerProcess(Exporter, stop=Exporter.stop, abandon=Exporter.abandon)


def get_exporter() -> Exporter:
    """This process's exporter, started on first use (and again after fork)."""
    return _instance.get()


def is_live(share_id: str) -> bool:
    """Whether this process's exporter (if it has one: none is started) still holds share ``share_id``."""
    exp = _instance.current()
    return exp is not None and exp.get(share_id) is not None


def registered(share: Any) -> Export | None:
    """The export behind ``share`` if this very process made it."""
    exp = _instance.current()
    if exp is None or share.exporter_pid != os.getpid():
        return None
    export = exp.get(share.share_id)
    if export is None or not hmac.compare_digest(export.token, share.token):
        return None
    return export


def revoke(share: Any) -> None:
    export = registered(share)
    if export is None:
        exp = _instance.current()
        ended = exp.ended(share.share_id) if exp is not None and share.exporter_pid == os.getpid() else None
        if ended is not None and hmac.compare_digest(ended[0], share.token):
            return  # its lifetime ended already: nothing is left to revoke
        raise ClosedError(
            f"only the exporting process (pid {share.exporter_pid}) can revoke this share"
        )
    log.info("share %s revoked", share.share_id[:8])
    with export.lock:
        export.revoked = True
        export.close_remote()
        export.close_mapped()
        export.obj = None
        export.end("revoked")


_share.set_revoke_hook(revoke)


def _sealed() -> None:
    exp = _instance.current()
    if exp is not None:
        exp.sealed()


_paths.on_seal(_sealed)


def new_ids() -> tuple[str, bytes]:
    return secrets.token_hex(16), secrets.token_bytes(32)
