"""The exporter's file-descriptor broker: a Unix socket that hands the file
descriptors behind an export to a peer that presents the export's token.

One broker per process, started on the first export (never on import of
gpushare), served by the process's service thread (``gpushare._service``,
epoll: no limit on descriptor numbers), stopped at interpreter exit.  A forked
child never uses its parent's broker: it drops the inherited socket and starts
its own on its first export.

Wire protocol (all integers big-endian), one request per connection:

* request, importer to broker: ``magic "GSFD", protocol u8, export_id u64,
  token 32 bytes`` (45 bytes);
* reply: ``magic "GSFD", protocol u8, status u8, message length u16, fd count
  u32`` then the UTF-8 message.  When the status is OK there is no message
  and the file descriptors travel in ``SCM_RIGHTS`` messages of at most 250:
  the first on the reply itself, the others each on one byte ``"F"``.

The broker checks the peer's credentials (``SO_PEERCRED``: the same user id,
or root) before it reads a byte, and compares tokens with
:func:`hmac.compare_digest`.  The importer checks the broker's credentials
too: the process must be the exporter named in the descriptor.  Every socket
operation on both sides has a timeout.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._descriptors import POSIX_FD_FORMAT, PosixFdBufferDescriptor
from .._errors import AccessDeniedError, ExporterUnreachableError, InvalidInputError
from .._process import PerProcess, node_identity
from .._service import get_service

__all__ = ["Broker", "control_address", "fetch_fds", "get_broker", "grant", "publish",
           "release_registrations"]

_MAGIC = b"GSFD"
_PROTOCOL = 1
_REQUEST = struct.Struct("!4sBQ32s")
_REPLY = struct.Struct("!4sBBHI")
_OK, _DENIED, _UNKNOWN, _BAD_REQUEST = 0, 1, 2, 3
_FDS_PER_MESSAGE = 250
_UCRED = struct.Struct("3i")
#: Seconds any single exchange with a broker may take, on either side.
TIMEOUT = 5.0


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of ``sock``."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def _uid_may_share(uid: int) -> bool:
    return uid == os.getuid() or uid == 0


@dataclass(frozen=True)
class _Export:
    token: bytes
    fds: tuple[int, ...]


class Broker:
    """Serves the exports of this process.  Use :func:`get_broker`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.address = f"\0gpushare-{self.pid}-{secrets.token_hex(8)}"
        self._lock = threading.Lock()
        self._exports: dict[int, _Export] = {}
        self._next_id = 1
        self._stopped = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(self.address)
            self._listener.listen(128)
            self._service = get_service()
            self._service.listen(self._listener, self._accept)
        except BaseException:
            self._listener.close()
            raise

    # -- registry -------------------------------------------------------
    def register(self, fds: Sequence[int]) -> tuple[int, bytes]:
        """Serve ``fds`` (borrowed: the caller keeps them open until
        :meth:`revoke`) under a fresh token; returns ``(export_id, token)``."""
        token = secrets.token_bytes(32)
        with self._lock:
            export_id = self._next_id
            self._next_id += 1
            self._exports[export_id] = _Export(token, tuple(fds))
        return export_id, token

    def revoke(self, export_id: int) -> None:
        """Stop serving an export; returns once no hand-over still uses its fds
        (a hand-over duplicates them under the lock)."""
        with self._lock:
            self._exports.pop(export_id, None)

    def serves(self, export_id: int) -> bool:
        with self._lock:
            return export_id in self._exports

    def __len__(self) -> int:
        with self._lock:
            return len(self._exports)

    def grant(self, export_id: int, token: bytes) -> tuple[int, list[int] | str]:
        """Duplicates of export ``export_id``'s fds if ``token`` is its token
        (the caller owns them), else a status and why not."""
        with self._lock:
            entry = self._exports.get(export_id)
            expected = entry.token if entry is not None else bytes(32)
            granted = hmac.compare_digest(expected, token) and entry is not None
            if entry is None:
                return _UNKNOWN, f"export {export_id} is not served: the exporter closed it"
            if not granted:
                return _DENIED, f"wrong token for export {export_id}"
            dups: list[int] = []
            try:
                for fd in entry.fds:
                    dups.append(os.dup(fd))
            except BaseException:
                for fd in dups:
                    os.close(fd)
                raise
            return _OK, dups

    # -- lifetime -------------------------------------------------------
    def stop(self) -> None:
        """Stop serving and close the socket (in the process that started it)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._exports.clear()
        self._service.unlisten(self._listener)

    def _abandon(self) -> None:
        """In a forked child: forget the exports; the service closes the
        inherited socket without touching the parent's broker."""
        self._stopped = True
        self._exports = {}
        self._lock = threading.Lock()

    # -- serving (in the service thread) ----------------------------------
    def _accept(self, conn: socket.socket) -> None:
        """Check the peer before reading a byte; its request must arrive by
        its deadline, or the connection is dropped while others are served."""
        try:
            _, uid, _ = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        c = self._service.connect(conn, _BrokerSession(self), time.monotonic() + TIMEOUT)
        if not _uid_may_share(uid):
            c.send(_reply_bytes(_DENIED, f"user id {uid} may not import memory of user id {os.getuid()}"))
            c.close_when_sent()


class _BrokerSession:
    """One request, one reply, per connection."""

    wants_fds = False

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.done = False

    def data_received(self, conn: Any, fds: list[int]) -> None:
        if self.done or len(conn.rbuf) < _REQUEST.size:
            return
        self.done = True
        request = bytes(conn.rbuf[: _REQUEST.size])
        conn.rbuf.clear()
        magic, protocol, export_id, token = _REQUEST.unpack(request)
        if magic != _MAGIC or protocol != _PROTOCOL:
            conn.send(_reply_bytes(_BAD_REQUEST, f"not a gpushare request of protocol {_PROTOCOL}"))
        else:
            status, granted = self.broker.grant(export_id, token)
            if status != _OK:
                conn.send(_reply_bytes(status, str(granted)))
            else:
                # The reply carries the first fds (one wake-up of the importer
                # for most buffers); any more follow on one byte each.
                dups = list(granted)
                header = _REPLY.pack(_MAGIC, _PROTOCOL, _OK, 0, len(dups))
                for start in range(0, max(len(dups), 1), _FDS_PER_MESSAGE):
                    conn.send(header if start == 0 else b"F", dups[start : start + _FDS_PER_MESSAGE])
        conn.close_when_sent()

    def connection_lost(self, conn: Any, exc: BaseException | None) -> None:
        pass

    def deadline_passed(self, conn: Any) -> None:
        conn.close()


def _reply_bytes(status: int, message: str, count: int = 0) -> bytes:
    text = message.encode()[:1024]
    return _REPLY.pack(_MAGIC, _PROTOCOL, status, len(text), count) + text


_service: PerProcess[Broker] = PerProcess(Broker, stop=Broker.stop, abandon=Broker._abandon)


def get_broker() -> Broker:
    """This process's broker, started on first use (and again after a fork)."""
    return _service.get()


def release_registrations(regs: list[tuple[int, list[int]]]) -> None:
    """End registrations ``(export_id, fds)`` of this process's broker: revoke
    each and close its fds; ``regs`` is left empty."""
    broker = get_broker()
    for export_id, fds in regs:
        broker.revoke(export_id)
        for fd in fds:
            os.close(fd)
    regs.clear()


def grant(export_id: int, token: bytes) -> list[int] | None:
    """Duplicates of a registration's fds (the caller owns them), or None
    when this process's broker does not serve it with that token."""
    broker = _service.current()
    if broker is None:
        return None
    status, granted = broker.grant(export_id, token)
    return list(granted) if status == _OK else None


def control_address(pid: int, port: int) -> str:
    """The Unix-socket address of the control channel of exporter ``pid``
    whose TCP control port is ``port`` (abstract, in its network namespace)."""
    return f"\0gpushare-control-{pid}-{port}"


def check_peer(sock: socket.socket, pid: int, what: str) -> None:
    """Refuse a Unix-socket peer that is not process ``pid`` of this user (or root)."""
    peer_pid, peer_uid, _ = peer_credentials(sock)
    if peer_pid != pid:
        raise AccessDeniedError(f"{what} is process {peer_pid}, not exporter pid {pid}; "
                                "refusing memory from an impostor")
    if not _uid_may_share(peer_uid):
        raise AccessDeniedError(f"{what} runs as user id {peer_uid}; this process is user id {os.getuid()}")


def may_share(sock: socket.socket) -> bool:
    """Whether the peer of a Unix socket runs as this user or root."""
    try:
        _, uid, _ = peer_credentials(sock)
    except OSError:
        return False
    return _uid_may_share(uid)


def publish(
    fds: Sequence[int],
    *,
    device: str | int,
    sizes: tuple[int, ...],
    size: int,
    owner_uuid: str | None,
) -> tuple[Broker, PosixFdBufferDescriptor]:
    """Serve ``fds`` (borrowed until revoked) and describe them."""
    broker = get_broker()
    export_id, token = broker.register(fds)
    try:
        desc = PosixFdBufferDescriptor._from_fields(
            POSIX_FD_FORMAT,
            broker.address,
            export_id,
            token,
            os.getpid(),
            node_identity(),
            device,
            sizes,
            size,
            owner_uuid,
        )
    except BaseException:
        broker.revoke(export_id)
        raise
    return broker, desc


def _unreachable(address: str, pid: int, why: str) -> ExporterUnreachableError:
    return ExporterUnreachableError(f"cannot reach the broker of exporter pid {pid} at {address!r}: {why}")


def fetch_fds(
    address: str,
    export_id: int,
    token: bytes,
    count: int,
    *,
    pid: int,
    timeout: float = TIMEOUT,
) -> list[int]:
    """Ask the broker at ``address`` for export ``export_id``; return its
    ``count`` file descriptors (the caller owns and must close them).

    On any failure every received descriptor is closed before the error
    propagates.
    """
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            raise _unreachable(
                address, pid, "nothing listens there; the exporter exited or never exported"
            ) from None
        except TimeoutError:
            raise _unreachable(address, pid, f"connect timed out after {timeout} s") from None
        # The request goes first (it reaches the broker with the connection);
        # sending the token to whoever listens at this address gives nothing
        # away: only descriptor holders know the random address.  Nothing
        # is accepted from the broker before its credentials are checked.
        try:
            try:
                sock.sendall(_REQUEST.pack(_MAGIC, _PROTOCOL, export_id, token))
            except (BrokenPipeError, ConnectionResetError):
                pass  # a broker that refuses us answers before reading; read its answer
            check_peer(sock, pid, f"the broker at {address!r}")
            data = _recv_with_fds(sock, _REPLY.size, fds, deadline)
            magic, protocol, status, length, n = _REPLY.unpack(data)
            if magic != _MAGIC or protocol != _PROTOCOL:
                raise InvalidInputError(f"the broker at {address!r} does not speak protocol {_PROTOCOL}")
            message = _recv_with_fds(sock, length, fds, deadline).decode("utf-8", "replace")
            if status == _DENIED:
                raise AccessDeniedError(f"exporter pid {pid} refused the import: {message}")
            if status == _UNKNOWN:
                raise ExporterUnreachableError(f"exporter pid {pid}: {message}")
            if status != _OK:
                raise InvalidInputError(f"exporter pid {pid} refused the request: {message}")
            if n != count:
                raise InvalidInputError(
                    f"exporter pid {pid} offers {n} file descriptors; the descriptor names {count}"
                )
            while len(fds) < count:
                _recv_with_fds(sock, 1, fds, deadline, limit=count)
        except TimeoutError:
            raise _unreachable(address, pid, f"no answer within {timeout} s") from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _unreachable(address, pid, f"connection lost ({exc})") from None
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        sock.close()


def _recv_with_fds(
    sock: socket.socket, n: int, fds: list[int], deadline: float, *, limit: int | None = None
) -> bytes:
    """Read exactly ``n`` bytes, appending any file descriptors that arrive
    to ``fds``; more than ``limit`` descriptors in all is an error."""
    data = bytearray()
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        msg, got, flags, _ = socket.recv_fds(sock, n - len(data), _FDS_PER_MESSAGE)
        fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise InvalidInputError(
                "file descriptors were dropped in transit: more than one message may carry, "
                "or this process is at its open-file limit (RLIMIT_NOFILE)"
            )
        if limit is not None and len(fds) > limit:
            raise InvalidInputError(f"the broker sent {len(fds)} file descriptors; expected {limit}")
        if not msg:
            raise ConnectionResetError("the broker closed the connection")
        data += msg
    return bytes(data)
