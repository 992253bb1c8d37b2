"""The exporter's side of :func:`gpushare.export`: registry, control channel, lifetimes.

Started on the first export (never on import of gpushare): a TCP listener
served by the process's service thread (:mod:`gpushare._service`), like every
control connection and every lease.  An importer keeps one control
connection to this exporter for all its opens; each open it makes is a
*lease*, a record on that connection, ended by a ``close`` message or by the
connection ending (the importer closed it or died: the kernel reports it).
An export whose lifetime ended (retired, revoked, its object gone) leaves the
registry, and its fd registrations are withdrawn; a small bounded memory of
ended shares lets a late open hear why.  In a forked child the parent's
exporter is never used: the child starts its own on its first export.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import _auth, _control, _paths, _reopen, _share
from ._errors import ClosedError, GpuShareError, InvalidInputError
from ._manifest import MAX_PARTS as _MAX_PARTS
from ._paths import cma, host_fd
from ._paths.broker import (
    control_address,
    may_share,
    peer_credentials,
    release_registrations,
)
from ._process import PerProcess
from ._service import Connection, Protocol, get_service
from ._share import altered
from ._types import collection_paused

__all__ = ["Exporter", "get_exporter", "is_live", "registered", "revoke", "advertised_addresses"]

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
    policy: Any  # "auto" | "closed" | "revoked" | "none" | int
    obj: Any = None
    obj_ref: Any = None
    opens: int = 0
    total: int = 0
    revoked: bool = False
    retired: bool = False
    readonly: bool = False
    #: Where the share's bytes start in the memory the paths serve (as the Share says).
    offset: int = 0
    registrations: list = field(default_factory=list)
    #: Lifetime "auto": a weak reference to the Share that export() returned,
    #: and whether it (or a copy) left the process, pickled or as bytes.
    share_ref: Any = None
    sent: bool = False
    #: What a path keeps for the share while it serves it, by path name
    #: (ucx-rma: the share's region in this process's region server, made on
    #: the first ucx-rma open; every lease over it holds a key of its own).
    state: dict[str, Any] = field(default_factory=dict)
    #: Each path's grant payload, made on its first open (:func:`gpushare._paths.base.descriptor_payload`).
    payloads: dict[str, Any] = field(default_factory=dict)
    #: A bundle's allocations, each an export of its own that only the
    #: bundle's leases reach (None: a share of one buffer); and the digest
    #: of its manifest, which an open must name.
    parts: list[Export] | None = None
    digest: bytes | None = None
    #: (slot, epoch) on the exporter's state page, while importers may keep
    #: closed views of it for a reopen (:mod:`gpushare._reopen`).
    slot: tuple[int, int] | None = None
    #: Set by the exporter's registry: called once when the share's lifetime ends.
    on_end: Callable[[Export, str], None] | None = None
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
        if self.policy == "auto":
            self.close_remote()
            self.settle()
        elif self.policy == "closed" and self.total >= 1:
            self.retire()
        elif isinstance(self.policy, int) and self.total >= self.policy:
            self.retire()
        elif self.policy == "none" or self.opens == 0:
            # No remote view is open: the region goes (its registration would
            # keep the object alive); a later ucx-rma open adds it again.
            self.close_remote()

    def needed(self) -> bool:
        """Lifetime "auto": whether the exporting process may still hand the
        share out: it holds the Share export() returned, or a share that left
        the process awaits its first import (lock held)."""
        return (self.share_ref is not None and self.share_ref() is not None) or (self.sent and self.total == 0)

    def settle(self) -> None:
        """Lifetime "auto" with no import open: keep ``obj`` while the share is
        :meth:`needed`; else hold it only weakly, openable while the exporting
        process still uses the object, and end once it is gone (lock held)."""
        if self.policy != "auto" or self.retired or self.revoked or self.opens > 0 or self.needed():
            return
        self.obj = None
        if self.obj_ref is None or self.obj_ref() is None:
            self.retire()

    def hold(self) -> None:
        """An open of an "auto" share: the object is held strongly again while
        the lease lasts (lock held; :meth:`refusal` said the object lives)."""
        if self.obj is None:
            self.obj = self.target()

    def close_remote(self) -> None:
        held: list[Any] = []
        self._take_states(held)
        kinds: dict[type, list[Any]] = {}
        for state in held:
            kinds.setdefault(type(state), []).append(state)
        for kind, states in kinds.items():
            # a region: every key of it is revoked, remote access stops at once;
            # a kind that closes many at once (a bundle's regions) does so
            close_all = getattr(kind, "close_all", None)
            if close_all is not None:
                close_all(states)
            else:
                for state in states:
                    state.close()

    def _take_states(self, out: list[Any]) -> None:
        """What the paths hold for this share and its parts, taken (lock held)."""
        states, self.state = self.state, {}
        out.extend(states.values())
        for part in self.parts or ():
            part._take_states(out)

    def end(self, reason: str) -> None:
        """The share's lifetime ended: leave the registry (lock held)."""
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end(self, reason)

    def close_mapped(self) -> None:
        """Stop handing out this share's fds: a descriptor given out before is dead."""
        regs, self.registrations = self.registrations, []
        if regs:
            release_registrations(regs)
        for part in self.parts or ():
            part.close_mapped()

    def retire(self) -> None:
        if not self.retired:
            log.info("share %s retired: its lifetime (%s) ended", self.share_id[:8], self.policy)
        self.retired = True
        self.close_remote()
        self.close_mapped()
        self.obj = None
        self.end("retired")

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
        self._sessions: set[_Session] = set()
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
        cma = sys.modules.get("gpushare._paths.cma")
        if cma is not None:
            cma.stop()  # no copy goes on into an importer once the connections close
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
        self._serve(sock, _Session(self))

    def _accept_local(self, sock: socket.socket) -> None:
        # Checked before a byte is read, as the fd broker does.
        if not may_share(sock):
            if refusals.allow():
                log.warning("refused a control connection from %s: another user", _peer(sock))
            sock.close()
            return
        self._serve(sock, _Session(self, local=True))

    def _serve(self, sock: socket.socket, session: _Session) -> None:
        with self._lock:
            self._sessions.add(session)
        self._service.connect(sock, session, time.monotonic() + _control.TIMEOUT)


#: Leases one control connection (one importer process) may hold at once;
#: an open beyond it is refused (docs/limits.md).
MAX_LEASES = 1 << 16
#: Ended shares remembered (to say why a late open is refused).
MAX_ENDED = 4096
#: Seconds a control connection with no lease may stay idle.
IDLE_TIMEOUT = 120.0
#: Bytes of replies a connection may leave unread: a request read while more
#: are queued drops the connection (docs/limits.md).
MAX_BACKLOG = 4 << 20
#: File descriptors its unread replies may hold, likewise.
MAX_BACKLOG_FDS = 1024


class _Session(Protocol):
    """One importer's control connection: its hello, then its opens, each a lease.

    Every frame is parsed by :func:`gpushare._control.take_frames` (bounded
    size and depth).  Nothing but ``hello`` is accepted before the hello,
    which is where a peer authenticates (:meth:`authenticate`).
    """

    def __init__(self, exporter: Exporter, *, local: bool = False) -> None:
        self.exporter = exporter
        self.local = local  # a Unix socket from this user on this node: fds may go with replies
        self.ready = False
        self.finished = False  # refused for good: nothing more is read
        self.leases: dict[int, Export] = {}
        #: (importer's nonce, ours) between our hello and the importer's proof.
        self.nonces: tuple[bytes, bytes] | None = None
        #: The pid the importer gave with its proof (informational, for the log).
        self.claimed_pid: int | None = None
        #: What each lease's path granted (its state, what ends it).
        self.grants: dict[int, _paths.Grant] = {}
        #: What a path keeps for the whole connection, by path name (cma: the
        #: importer's process, one pidfd for all its leases).
        self.held: dict[str, Any] = {}
        #: The connection (set when its first bytes come; paths ask it who the peer is).
        self.conn: Connection | None = None
        #: cma copies queued or running for this connection.
        self._copies = 0
        self._copies_lock = threading.Lock()
        #: share id -> [export, unused retries, paths tried]: an open the
        #: importer could not use ("failed") still counts, but buys one
        #: uncounted open of a path this connection has not tried for that
        #: share, so a fallback stays one import and a peer cannot collect a
        #: payload per message (each path at most once per counted import).
        self.retries: dict[str, list[Any]] = {}
        self._next_lease = 1
        self.page_sent = False  # the state page went to this importer
        #: A bundle's open request split over frames, until its last.
        self._assembly: _control.Assembly | None = None
        #: The largest bundle grant sent on this connection (bytes): the
        #: backlog may hold one such reply beyond MAX_BACKLOG.
        self._grant_bytes = 0

    # -- protocol ---------------------------------------------------------
    def data_received(self, conn: Connection, fds: list[int]) -> None:
        self.conn = conn
        for fd in fds:
            os.close(fd)  # importers send none
        if self.finished:
            conn.rbuf.clear()
            return
        # One frame at a time, the backlog checked before each: one read can
        # hold thousands of requests, and each adds a reply.
        while not (self.finished or conn.closed):
            if conn.backlog() > MAX_BACKLOG + self._grant_bytes or conn.backlog_fds() > MAX_BACKLOG_FDS:
                self._overloaded(conn)
            message = _control.take_frame(conn.rbuf)
            if message is None:
                return
            self.exporter.messages += 1
            message = self._whole(message)
            if message is not None:
                self._handle(conn, message)

    def _whole(self, message: dict) -> dict | None:
        """A message, once whole: a bundle's open may come split over frames
        (one path per allocation), at most the bundle's allocations in all."""
        if self._assembly is not None:
            if not self._assembly.add(message):
                return None
            message, self._assembly = self._assembly.whole(), None
            return message
        if "more" not in message:
            return message
        if not self.ready or message.get("op") != "open":
            raise InvalidInputError("only a bundle's open request may be split over frames")
        export = self.exporter.get(message.get("share")) if isinstance(message.get("share"), str) else None
        # an open of a share that ended is refused once whole; its bound is the most any bundle has
        bound = len(export.parts) if export is not None and export.parts is not None else (
            0 if export is not None else _MAX_PARTS)
        self._assembly = _control.Assembly(message, message, ("parts",), bound)
        return None

    def _overloaded(self, conn: Connection) -> None:
        """The importer asks and does not read: drop it (raising closes the
        connection, and its queued replies and leases go with it)."""
        if refusals.allow():  # a key holder reconnecting in a loop cannot fill the log either
            log.warning("dropped the control connection of %s: it left %d bytes and %d fds of replies unread "
                        "(at most %d and %d)", _peer(conn), conn.backlog(), conn.backlog_fds(), MAX_BACKLOG,
                        MAX_BACKLOG_FDS)
        raise InvalidInputError(f"the importer sends requests but does not read the replies (more than "
                                f"{MAX_BACKLOG} bytes or {MAX_BACKLOG_FDS} fds unread)")

    def connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        leases, self.leases = self.leases, {}
        grants, self.grants = self.grants, {}  # copies in flight keep their memory pinned until they finish
        retries, self.retries = self.retries, {}
        self.held = {}  # copies in flight keep what they use
        with self.exporter._lock:
            self.exporter._sessions.discard(self)
        for lease, export in leases.items():  # the importer closed, died or misbehaved
            with export.lock:
                _ended(grants.get(lease))
                export.opens -= 1
                export.after_close()
        for export, unused, _ in retries.values():
            if unused:  # a failed open never retried: its policy applies now
                with export.lock:
                    export.after_close()

    # -- messages ---------------------------------------------------------
    def authenticate(self, conn: Connection, hello: dict) -> str | None:
        """Check the importer's nonce and make this side's challenge; the
        importer's proof is checked on its next message (:meth:`_prove`),
        before any other is read."""
        nonce = hello.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != _auth.NONCE_BYTES:
            return f"the hello carries no {_auth.NONCE_BYTES}-byte nonce"
        try:
            _auth.key()
        except InvalidInputError as exc:  # the environment changed since the first export
            return f"the exporter cannot check keys: {exc}"
        self.nonces = (nonce, _auth.new_nonce())
        return None

    def _prove(self, conn: Connection, msg: dict) -> bool:
        """The importer's answer to the challenge: true when it holds the key."""
        nonces, self.nonces = self.nonces, None
        if nonces is None or msg.get("op") != "auth" or not _auth.verify("importer", *nonces, msg.get("proof")):
            return False  # logged with the refusal
        pid = msg.get("pid")  # who it says it is, told only now that it proved the key: informational
        if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31:
            self.claimed_pid = pid
        return True

    def refuse(self, conn: Connection, rid: Any, code: str, message: str) -> None:
        """Answer request ``rid`` with a refusal (paths call this)."""
        self._refuse(conn, rid, code, message)

    refusal_text = staticmethod(lambda code, policy: refusal_text(code, policy))

    def take_copy(self) -> bool:
        """Count one more copy queued for this connection, unless it has too many."""
        with self._copies_lock:
            if self._copies >= cma.MAX_QUEUED:
                return False
            self._copies += 1
            return True

    def copy_done(self) -> None:
        with self._copies_lock:
            self._copies -= 1

    def _refuse(self, conn: Connection, rid: Any, code: str, message: str, *, close: bool = False,
                part: int | None = None) -> None:
        """Answer ``rid`` with a refusal; ``part``: the bundle's allocation it is about (data the
        importer acts on, as its next path for that allocation)."""
        if refusals.allow():
            said = f" (pid {self.claimed_pid}, as it says)" if self.claimed_pid is not None and not self.local else ""
            log.log(logging.WARNING if code in ("denied", "bad") else logging.INFO, "refused %s%s%s: %s (%s)",
                    _peer(conn), said, "" if self.ready else " before it proved the key", message, code)
        reply = {"id": rid, "ok": False, "code": code, "message": message}
        if part is not None:
            reply["part"] = part
        conn.send(_control.pack(reply))
        if close:
            self.finished = True
            conn.close_when_sent()

    def _handle(self, conn: Connection, msg: dict) -> None:
        op = msg.get("op")
        rid = msg.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 1 << 63):
            self._refuse(conn, None, "bad", "request ids are non-negative ints", close=True)
            return
        if self.nonces is not None:  # the hello was answered: only the importer's proof may come
            if not self._prove(conn, msg):
                self._refuse(conn, rid, "denied", "this process does not hold the exporter's key "
                             "(GPUSHARE_AUTHKEY or gpushare.set_authkey on both sides)", close=True)
                return
            self.ready = True
            self._idle(conn)
            return
        if not self.ready:
            if op != "hello":
                self._refuse(conn, rid, "bad", "expected hello", close=True)
                return
            if msg.get("v") != _control.PROTOCOL:
                self._refuse(conn, rid, "bad", f"control protocol {msg.get('v')!r:.20}; this exporter "
                             f"speaks {_control.PROTOCOL} (run the same gpushare version on both sides)",
                             close=True)
                return
            why = self.authenticate(conn, msg)
            if why is not None:
                self._refuse(conn, rid, "denied", why, close=True)
                return
            importer_nonce, exporter_nonce = self.nonces
            conn.send(_control.pack({"op": "hello", "ok": True, "v": _control.PROTOCOL, "pid": os.getpid(),
                                     "nonce": exporter_nonce,
                                     "proof": _auth.proof("exporter", importer_nonce, exporter_nonce)}))
        elif op == "open":
            self._open(conn, rid, msg)
        elif op == cma.OP:
            cma.serve_copy(self, conn, rid, msg)
        elif op == "ping":  # an importer waiting on a transfer asks for a sign of life
            conn.send(_control.pack({"id": rid, "ok": True}))
        elif op in ("close", "failed"):
            self._end(conn, msg.get("lease"), failed=op == "failed")
        else:
            self._refuse(conn, rid, "bad", f"unexpected {op!r:.20}", close=True)

    def _idle(self, conn: Connection) -> None:
        conn.deadline = None if self.leases else time.monotonic() + IDLE_TIMEOUT

    def _lookup(self, msg: dict) -> tuple[Export | None, str | None, Any]:
        """The export an open names, or the refusal code (and the ended share's policy)."""
        share_id, token = msg.get("share"), msg.get("token")
        if not isinstance(share_id, str) or not isinstance(token, bytes):
            return None, "bad", None
        export = self.exporter.get(share_id)
        if export is not None:
            return (export, None, None) if hmac.compare_digest(token, export.token) else (None, "denied", None)
        ended = self.exporter.ended(share_id)
        if ended is None:
            return None, "unknown", None
        return (None, ended[1], ended[2]) if hmac.compare_digest(token, ended[0]) else (None, "denied", None)

    def _open(self, conn: Connection, rid: Any, msg: dict) -> None:
        export, code, policy = self._lookup(msg)
        if export is None:
            self._refuse(conn, rid, code or "unknown", refusal_text(code or "unknown", policy))
            return
        if len(self.leases) >= MAX_LEASES:
            self._refuse(conn, rid, "limit", f"this importer process holds {MAX_LEASES} leases of this exporter "
                         f"already, the most one connection may hold (gpushare._exporter.MAX_LEASES): close "
                         "views it no longer uses")
            return
        said = msg.get("said")
        if said is not None:  # what the importer's share says of the memory (absent from older importers)
            why = _said_altered(said, export)
            if why is not None:
                self._refuse(conn, rid, "altered" if why else "bad", why or "malformed 'said' in an open request")
                return
        path = msg.get("path")
        if export.parts is not None:
            path, why = _bundle_request(msg, export)
            if why is not None:
                self._refuse(conn, rid, "altered" if why.startswith("the share") else "bad", why)
                return
        entry = self.retries.get(export.share_id)
        retry = entry is not None and entry[1] > 0 and path not in entry[2]
        with export.lock:
            refusal = export.refusal()
            if refusal is not None and not (retry and refusal == "exhausted"):
                self._refuse(conn, rid, refusal, refusal_text(refusal, export.policy))
                return
            if export.parts is None and path not in export.offers:
                self._refuse(conn, rid, "path", f"path {path!r:.20} is not offered")
                return
            try:
                grant = _serve(export, path, self)
            except GpuShareError as exc:
                part = getattr(exc, "part", None)
                self._refuse(conn, rid, "path", f"{exc}" if part is not None else f"exporter cannot serve {path}: {exc}",
                             part=part)
                return
            if grant is None:  # opened in the exporting process only
                self._refuse(conn, rid, "path", f"path {path!r:.20} is not offered")
                return
            fds = grant.fds
            if len(fds) > MAX_BACKLOG_FDS:
                for fd in fds:
                    os.close(fd)
                _ended(grant)
                self._refuse(conn, rid, "limit", f"this open needs {len(fds)} file descriptors; at most "
                             f"{MAX_BACKLOG_FDS} go with one reply (docs/limits.md)")
                return
            try:
                lease = self._next_lease
                reply = {"id": rid, "ok": True, "lease": lease, "payload": grant.payload}
                page_fd = self._keep(export, path, reply)
                if page_fd is not None:
                    fds = [*fds, page_fd]
                if fds:
                    reply["fds"] = len(fds)
                # a bundle's grant (one per allocation) goes in as many frames as it needs
                frame = (_control.pack(reply) if export.parts is None
                         else _control.pack_split(reply, grant.payload, ("parts", "fds")))
                if len(frame) > _control.MAX_FRAME:
                    self._grant_bytes = max(self._grant_bytes, len(frame))
            except GpuShareError as exc:
                for fd in fds:
                    os.close(fd)
                _ended(grant)
                self._refuse(conn, rid, "path", f"{exc} (the exporter cannot serve {_summary(path)})")
                return
            export.opens += 1
            if export.policy == "auto":
                export.hold()
            if retry:
                entry[1] -= 1
                entry[2].add(path)
            else:
                export.total += 1
        self._next_lease += 1
        self.leases[lease] = export
        self.grants[lease] = grant
        conn.deadline = None
        conn.send(frame, fds)
        if "page" in reply:
            self.page_sent = True
        if log.isEnabledFor(logging.INFO):  # who the peer is costs a system call: asked only for the log
            log.info("share %s: lease opened over %s by %s", export.share_id[:8], path, _peer(conn))

    def _keep(self, export: Export, path: Any, reply: dict) -> int | None:
        """Let the importer keep this lease after its view closes, where
        closing changes nothing here: a same-node importer, a share of one
        buffer that lives until revoked, a path whose mapping holds the
        memory (:mod:`gpushare._reopen`).  Adds ``keep`` to ``reply`` and
        returns the state page's fd to send with it, the first time."""
        if not (self.local and export.parts is None and export.policy == "revoked"
                and _paths.by_name(path).reopens):
            return None
        got = self.exporter.keep_slot(export)
        if got is None:
            return None
        if self.page_sent:
            reply["keep"] = list(got)
            return None
        try:
            fd = self.exporter.page_fd()
        except GpuShareError:
            return None  # out of descriptors, say: this lease is not kept, the open goes on
        reply["keep"], reply["page"] = list(got), True  # the page: the last fd
        return fd

    def _end(self, conn: Connection, lease: Any, *, failed: bool) -> None:
        """A lease ends: the view closed, or the importer could not use the
        offer (``failed``: the open still counts, but the connection may open
        one path of that share it has not tried without counting)."""
        export = self.leases.pop(lease, None) if isinstance(lease, int) else None
        if export is None:
            return  # already ended: nothing to do
        grant = self.grants.pop(lease, None)  # copies in flight keep the memory pinned until they finish
        path = grant.path.name if grant is not None else None
        if log.isEnabledFor(logging.INFO):
            log.info("share %s: lease of %s ended%s", export.share_id[:8], _peer(conn),
                     " (the importer could not use the path)" if failed else "")
        with export.lock:
            _ended(grant)  # that importer's access to the memory ends now
            export.opens -= 1
            waits = False
            if failed:
                entry = self.retries.setdefault(export.share_id, [export, 0, set()])
                entry[1] += 1
                entry[2].add(path)
                waits = export.opens == 0  # the importer falls back next: the policy waits for that open
            if not waits:
                export.after_close()
        self._idle(conn)


class _Bundled:
    """What served a bundle's lease: its parts' paths, named as one key (for
    the retries a failed open buys)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _serve(export: Export, path: str, session: _Session) -> _paths.Grant | None:
    """The grant of one open (lock held): each allocation's path served, one
    lease for them all.  A share of one buffer is its own only allocation,
    and its grant the path's own; a bundle's is a grant per allocation and
    how many of the reply's fds are each one's."""
    bundle = export.parts is not None
    parts = export.parts if bundle else [export]
    grants: list[_paths.Grant] = []
    try:
        with collection_paused(len(parts)):
            _serve_each(parts, path, bundle, session, grants)
        if len(grants) < len(parts):  # opened in the exporting process only
            return None
    except BaseException:
        for grant in grants:
            for fd in grant.fds:
                os.close(fd)
            _ended(grant)
        raise
    if not bundle:
        return grants[0]

    def end() -> None:
        for grant in grants:
            _ended(grant)

    return _paths.Grant({"parts": [g.payload for g in grants], "fds": [len(g.fds) for g in grants]},
                        [fd for g in grants for fd in g.fds], on_end=end, parts=grants, path=_Bundled(path))


def _serve_each(parts: list[Export], path: str, bundle: bool, session: _Session, grants: list[_paths.Grant]) -> None:
    """Each allocation's path served, its grant appended to ``grants`` (the
    caller's to end on a failure); for a share of one buffer whose path is
    served in the exporting process only, nothing."""
    for i, (part, name) in enumerate(zip(parts, path.split(",") if bundle else [path], strict=True)):
        served = _paths.by_name(name)
        try:
            grant = served.serve(part, session)
        except GpuShareError as exc:
            if not bundle:
                raise
            raise _of_part(type(exc)(f"{exc} (the exporter cannot serve allocation {i} of the bundle over "
                                     f"{name}; the open asked for {_summary(path)})"), i) from None
        if grant is None:
            if not bundle:
                return
            raise _of_part(InvalidInputError(f"{name} is opened in the exporting process only (allocation {i} "
                                             "of the bundle)"), i)
        grant.path = served
        grants.append(grant)


def _of_part(exc: GpuShareError, part: int) -> GpuShareError:
    exc.part = part  # type: ignore[attr-defined]  # the refusal names it as data
    return exc


def _summary(paths: str) -> str:
    """A bundle's paths, one per allocation, summed up: ``cuda-ipc x300, cma x2``."""
    names = paths.split(",")
    if len(names) == 1:
        return names[0]
    counts = collections.Counter(names)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def _bundle_request(msg: dict, export: Export) -> tuple[str, str | None]:
    """The paths an open of a bundle asks for, one per allocation (as one
    key), and why the request cannot be served (or None)."""
    paths, named = msg.get("parts"), msg.get("manifest")
    if not isinstance(named, bytes) or not hmac.compare_digest(named, export.digest or b""):
        return "", ("the share's manifest is not the one its exporter made: the share was altered (forged or "
                    "corrupt)")
    if not isinstance(paths, (list, tuple)) or len(paths) != len(export.parts or ()):
        return "", f"an open of this bundle names a path for each of its {len(export.parts or ())} allocations"
    for i, (name, part) in enumerate(zip(paths, export.parts or (), strict=True)):
        if not isinstance(name, str) or name not in part.offers:
            return "", f"allocation {i}: path {name!r:.20} is not offered"
    return ",".join(paths), None


def _said_altered(said: Any, export: Export) -> str | None:
    """Why an open's ``said`` (the device, size, offset and read-only flag its
    share names) does not describe ``export``: the share was altered; ``""``
    for a malformed ``said``; ``None`` when it matches."""
    if not isinstance(said, dict) or len(said) != 4:
        return ""
    device, nbytes, offset, readonly = (said.get(k) for k in ("device", "nbytes", "offset", "readonly"))
    if not (device == "host" or (type(device) is int and 0 <= device < 1 << 16)) or not all(
            type(v) is int and 0 <= v < 1 << 62 for v in (nbytes, offset)) or type(readonly) is not bool:
        return ""
    return altered(device, nbytes, offset, readonly, export.device, export.nbytes, export.offset, export.readonly)


def _ended(grant: _paths.Grant | None) -> None:
    """A lease ended: what its path granted is withdrawn (export lock held)."""
    if grant is not None and grant.on_end is not None:
        grant.on_end()


_REFUSALS = {
    "unknown": "the exporter has no such share (closed, or never exported here)",
    "denied": "wrong token for this share",
    "bad": "malformed open request",
    "revoked": "the share was revoked by its exporter",
    "retired": "the share is no longer available: its lifetime ended",
    "exhausted": "the share was opened as many times as its lifetime allows",
    "closed": "the lease ended (the view was closed)",
}

#: What would have fitted, by policy, for a share whose lifetime ended.
_FITS = {
    "auto": ("no import was open and the exporting process held neither the Share nor the object any more; "
             "keep a reference to one of them there until every importer has opened it (or export with "
             "lifetime=N or 'revoked' and call share.revoke())"),
    "closed": ("lifetime 'closed' ends as soon as every importer so far has closed it; for a share that "
               "several processes open one after another (Pool workers, Queue readers) use the default "
               "lifetime='auto', lifetime=N or 'revoked'"),
    "none": ("lifetime 'none' held the object weakly and it was garbage collected in the exporter; "
             "lifetime='auto' (the default) keeps it while the exporter holds the Share"),
}


def refusal_text(code: str, policy: Any) -> str:
    """Why an open is refused, and for a share whose lifetime ended, which
    lifetime would have fitted."""
    text = _REFUSALS[code]
    if code == "retired" and policy in _FITS:
        return f"{text}: {_FITS[policy]}"
    if code in ("retired", "exhausted") and isinstance(policy, int):
        return (f"{text}: lifetime={policy} allows {policy} import{'s' if policy > 1 else ''} and "
                f"{'they were' if code == 'exhausted' else 'all were made and closed'}; to hand it to more "
                "processes, export it with a larger N, or with lifetime='auto' (the default) or 'revoked'")
    return text

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


host_fd.on_seal(_sealed)


def _peer(conn: Any) -> str:
    """Who is at the other end of a control connection, for the log."""
    sock = getattr(conn, "sock", conn)
    try:
        if sock.family == socket.AF_UNIX:
            return f"pid {peer_credentials(sock)[0]} on this node"
        host, port = sock.getpeername()[:2]
    except OSError:
        return "a closed connection"
    return f"{host}:{port}"


class RefusalLog:
    """The exporter's refusals on its logger, at most :attr:`per_second` lines
    a second: a flood of bad peers cannot fill the log; the next line after
    a full second says how many were left out."""

    def __init__(self, per_second: int = 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_second = per_second
        self._clock = clock
        self._lock = threading.Lock()
        self._window = 0.0
        self._count = 0
        self._suppressed = 0

    def allow(self) -> bool:
        """Whether the refusal at hand may be logged (then log it)."""
        now = self._clock()
        with self._lock:
            suppressed = 0
            if now - self._window >= 1.0:
                suppressed, self._suppressed = self._suppressed, 0
                self._window, self._count = now, 0
            if self._count >= self.per_second:
                self._suppressed += 1
                return False
            self._count += 1
        if suppressed:
            log.warning("suppressed %d more refusals (at most %d are logged a second)", suppressed, self.per_second)
        return True


#: This process's exporter refusals, rate-limited.
refusals = RefusalLog()


def new_ids() -> tuple[str, bytes]:
    return secrets.token_hex(16), secrets.token_bytes(32)


def track_auto(obj: Any, share: Any, export: Export) -> None:
    """Lifetime "auto": watch the Share export() returned and the object, and
    settle the export (:meth:`Export.settle`) in the service thread when
    either goes or the share leaves the process."""
    service = get_service()

    def settle() -> None:
        with export.lock:
            export.settle()

    def gone(_: Any) -> None:
        # Weak-reference callbacks run wherever the last reference went,
        # possibly under locks of their own: settle in the service thread.
        service.call_soon(settle)

    def sent() -> None:
        export.sent = True

    try:
        export.obj_ref = weakref.ref(obj, gone)
    except TypeError:
        export.obj_ref = None  # bytes, bytearray: kept only while the share is needed
    export.share_ref = weakref.ref(share, gone)
    share._on_send(sent)


def weak_or_none(obj: Any, export: Export) -> Any:
    """A weak reference to ``obj`` that retires ``export`` when ``obj`` goes."""
    service = get_service()

    def retire() -> None:
        with export.lock:
            export.retire()

    def gone(_: Any) -> None:
        # Weak-reference callbacks run wherever the last reference went,
        # possibly under locks of their own: retire in the service thread.
        export.retired = True
        service.call_soon(retire)

    try:
        return weakref.ref(obj, gone)
    except TypeError:
        raise InvalidInputError(
            f"lifetime='none' keeps no reference, so it needs an object that supports weak "
            f"references; {type(obj).__name__} does not (wrap it, or use another lifetime)"
        ) from None
