"""The exporter's file-descriptor broker: a Unix socket that hands the file
descriptors behind an export to a peer that presents the export's token.

One broker per process, started on the first export (never on import of
gpushare), served by one daemon thread, stopped at interpreter exit.  A forked
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

import functools
import hmac
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .._descriptors import POSIX_FD_FORMAT, PosixFdBufferDescriptor
from .._errors import AccessDeniedError, ExporterUnreachableError, InvalidInputError
from .._process import PerProcess

__all__ = ["Broker", "fetch_fds", "get_broker", "node_identity", "publish"]

_MAGIC = b"GSFD"
_PROTOCOL = 1
_REQUEST = struct.Struct("!4sBQ32s")
_REPLY = struct.Struct("!4sBBHI")
_OK, _DENIED, _UNKNOWN, _BAD_REQUEST = 0, 1, 2, 3
_FDS_PER_MESSAGE = 250
_UCRED = struct.Struct("3i")
#: Seconds any single exchange with a broker may take, on either side.
TIMEOUT = 5.0


@functools.cache
def node_identity() -> str:
    """This node's identity: the kernel boot id and the host name (read once)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{boot_id}:{socket.gethostname()}"


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
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
            self._listener.listen(64)
            self._wake_r, self._wake_w = socket.socketpair()
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="gpushare-broker", daemon=True)
        self._thread.start()

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
        """Stop serving an export; returns once no hand-over still uses its fds."""
        with self._lock:
            self._exports.pop(export_id, None)

    def serves(self, export_id: int) -> bool:
        with self._lock:
            return export_id in self._exports

    # -- lifetime -------------------------------------------------------
    def stop(self) -> None:
        """Stop serving and close the socket (in the process that started it)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._exports.clear()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=TIMEOUT + 1.0)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def _abandon(self) -> None:
        """In a forked child: close the inherited sockets without touching the
        parent's broker (no shutdown, no wake-up), forget the exports."""
        self._stopped = True
        self._exports = {}
        self._lock = threading.Lock()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    # -- serving --------------------------------------------------------
    def _serve(self) -> None:
        """Accept connections and read their requests without blocking on any
        one peer: a connection that sends nothing is dropped at its deadline
        while others are served."""
        pending: dict[socket.socket, tuple[float, bytearray]] = {}
        try:
            while True:
                wait = None
                if pending:
                    wait = max(min(d for d, _ in pending.values()) - time.monotonic(), 0.0)
                try:
                    ready, _, _ = select.select([self._listener, self._wake_r, *pending], [], [], wait)
                except (OSError, ValueError):
                    return
                if self._wake_r in ready or self._stopped:
                    return
                if self._listener in ready:
                    self._accept(pending)
                now = time.monotonic()
                for conn in list(pending):
                    deadline, data = pending[conn]
                    if conn in ready:
                        self._read(conn, deadline, data, pending)
                    elif deadline <= now:
                        del pending[conn]
                        conn.close()
        finally:
            for conn in pending:
                conn.close()

    def _accept(self, pending: dict[socket.socket, tuple[float, bytearray]]) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        try:
            conn.setblocking(False)
            _, uid, _ = _peer_credentials(conn)
            if _uid_may_share(uid):
                entry = pending[conn] = (time.monotonic() + TIMEOUT, bytearray())
                self._read(conn, *entry, pending)  # the request has usually arrived
                return
            _reply(conn, _DENIED, f"user id {uid} may not import memory of user id {os.getuid()}")
        except OSError:
            pass
        conn.close()

    def _read(
        self,
        conn: socket.socket,
        deadline: float,
        data: bytearray,
        pending: dict[socket.socket, tuple[float, bytearray]],
    ) -> None:
        try:
            chunk = conn.recv(_REQUEST.size - len(data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        data += chunk
        if chunk and len(data) < _REQUEST.size:
            return
        del pending[conn]
        try:
            if chunk:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                self._handle(conn, bytes(data), deadline)
        except Exception:  # noqa: BLE001, S110 - no peer may stop the broker
            pass  # the peer went away or misbehaved; its problem, not ours
        finally:
            conn.close()

    def _handle(self, conn: socket.socket, request: bytes, deadline: float) -> None:
        magic, protocol, export_id, token = _REQUEST.unpack(request)
        if magic != _MAGIC or protocol != _PROTOCOL:
            _reply(conn, _BAD_REQUEST, f"not a gpushare request of protocol {_PROTOCOL}")
            return
        dups: list[int] = []
        try:
            with self._lock:
                entry = self._exports.get(export_id)
                expected = entry.token if entry is not None else bytes(32)
                granted = hmac.compare_digest(expected, token) and entry is not None
                if granted and entry is not None:
                    for fd in entry.fds:
                        dups.append(os.dup(fd))
            if entry is None:
                _reply(conn, _UNKNOWN, f"export {export_id} is not served: the exporter closed it")
                return
            if not granted:
                _reply(conn, _DENIED, f"wrong token for export {export_id}")
                return
            # The reply carries the first fds (one wake-up of the importer
            # for most buffers); any more follow on one byte each.
            header = _REPLY.pack(_MAGIC, _PROTOCOL, _OK, 0, len(dups))
            for start in range(0, len(dups), _FDS_PER_MESSAGE):
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                data = header if start == 0 else b"F"
                socket.send_fds(conn, [data], dups[start : start + _FDS_PER_MESSAGE])
        finally:
            for fd in dups:
                os.close(fd)


def _reply(conn: socket.socket, status: int, message: str, count: int = 0) -> None:
    text = message.encode()[:1024]
    conn.sendall(_REPLY.pack(_MAGIC, _PROTOCOL, status, len(text), count) + text)


_service: PerProcess[Broker] = PerProcess(Broker, stop=Broker.stop, abandon=Broker._abandon)


def get_broker() -> Broker:
    """This process's broker, started on first use (and again after a fork)."""
    return _service.get()


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
            peer_pid, peer_uid, _ = _peer_credentials(sock)
            if peer_pid != pid:
                raise AccessDeniedError(
                    f"the broker at {address!r} is process {peer_pid}, not exporter pid {pid}; "
                    "refusing memory from an impostor"
                )
            if not _uid_may_share(peer_uid):
                raise AccessDeniedError(
                    f"the broker runs as user id {peer_uid}; this process is user id {os.getuid()}"
                )
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
