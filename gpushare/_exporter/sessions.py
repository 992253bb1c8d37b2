"""The exporter's control sessions: one per importer connection, its hello
and mutual key check, then its opens, each a lease served by its path, and
the lease's end.  Runs on the service thread."""

from __future__ import annotations

import collections
import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _auth, _control, _paths
from .._errors import GpuShareError, InvalidInputError
from .._manifest import MAX_PARTS as _MAX_PARTS
from .._paths.base import Grant
from .._paths.broker import peer_credentials
from .._connection import Connection, Protocol
from .._share import altered
from .._types import Regrowth, collection_paused
from .lifetimes import Export, refusal_text

if TYPE_CHECKING:
    from .registry import Exporter

__all__ = ["Session", "RefusalLog", "refusals", "MAX_LEASES", "MAX_ENDED", "IDLE_TIMEOUT", "MAX_BACKLOG",
           "MAX_BACKLOG_FDS"]

log = logging.getLogger("gpushare.export")


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


class Session(Protocol):
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
        self.grants: dict[int, Grant] = {}
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
        #: When ``retries`` is pruned next (see _forget_ended).
        self._retries_pruning = Regrowth(16)
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

    def take_copy(self, limit: int) -> bool:
        """Count one more copy queued for this connection, unless it has ``limit`` already."""
        with self._copies_lock:
            if self._copies >= limit:
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
            claimed = (f" (pid {self.claimed_pid}, as it says)" if self.claimed_pid is not None and not self.local
                       else "")
            log.log(logging.WARNING if code in ("denied", "bad") else logging.INFO, "refused %s%s%s: %s (%s)",
                    _peer(conn), claimed, "" if self.ready else " before it proved the key", message, code)
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
        elif (handler := _paths.control_op(op)) is not None:
            handler(self, conn, rid, msg)
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
                         f"already, the most one connection may hold (gpushare._exporter.sessions.MAX_LEASES): close "
                         "views it no longer uses")
            return
        described = msg.get("said")  # the wire's name for it
        if described is not None:  # what the importer's share says of the memory (absent from older importers)
            why = _altered_description(described, export)
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
        if failed and self._retries_pruning.due(len(self.retries)):
            self._forget_ended()
        self._idle(conn)

    def _forget_ended(self) -> None:
        """Drop the retries of shares that ended (revoked, retired, no longer the exporter's):
        none of them opens again.  Done when the entries have doubled since the last time, so
        a connection that lives for hours keeps about twice the entries of its live shares,
        not one per share it ever failed to use."""
        live = {}
        for share_id, entry in self.retries.items():
            export = entry[0]
            if not (export.revoked or export.retired) and self.exporter.get(share_id) is export:
                live[share_id] = entry
        self.retries = live
        self._retries_pruning.kept = len(live)


class _Bundled:
    """What served a bundle's lease: its parts' paths, named as one key (for
    the retries a failed open buys)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _serve(export: Export, path: str, session: Session) -> Grant | None:
    """The grant of one open (lock held): each allocation's path served, one
    lease for them all.  A share of one buffer is its own only allocation,
    and its grant the path's own; a bundle's is a grant per allocation and
    how many of the reply's fds are each one's."""
    bundle = export.parts is not None
    parts = export.parts if bundle else [export]
    grants: list[Grant] = []
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

    return Grant({"parts": [g.payload for g in grants], "fds": [len(g.fds) for g in grants]},
                        [fd for g in grants for fd in g.fds], on_end=end, parts=grants, path=_Bundled(path))


def _serve_each(parts: list[Export], path: str, bundle: bool, session: Session, grants: list[Grant]) -> None:
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


def _altered_description(described: Any, export: Export) -> str | None:
    """Why the memory an open's share describes (its ``said``: the device,
    size, offset and read-only flag) is not ``export``'s: the share was
    altered; ``""`` for a malformed description; ``None`` when it matches."""
    if not isinstance(described, dict) or len(described) != 4:
        return ""
    device, nbytes, offset, readonly = (described.get(k) for k in ("device", "nbytes", "offset", "readonly"))
    if not (device == "host" or (type(device) is int and 0 <= device < 1 << 16)) or not all(
            type(v) is int and 0 <= v < 1 << 62 for v in (nbytes, offset)) or type(readonly) is not bool:
        return ""
    return altered(device, nbytes, offset, readonly, export.device, export.nbytes, export.offset, export.readonly)


def _ended(grant: Grant | None) -> None:
    """A lease ended: what its path granted is withdrawn (export lock held)."""
    if grant is not None and grant.on_end is not None:
        grant.on_end()


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
