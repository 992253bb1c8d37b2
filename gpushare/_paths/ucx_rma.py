"""The ucx-rma path: remote memory access through UCX, to any node.

The exporter adds the share's memory to its region server on the first
ucx-rma open (:func:`serve`) and grants each lease a key of its own, revoked
when the lease ends; the importer connects to the region server once per
exporter and moves bytes with get/put (:class:`RmaTransport`), each
transfer checked by the exporter.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, NoReturn

from .._cuda import _driver
from .._errors import (
    ClosedError,
    InvalidInputError,
    UCXConnectionError,
    WaitTimeoutError,
)
from .._process import await_alive
from .._ucx import _device, _loader, _node, _peer, _server
from .base import KINDS, Grant, Here, Memory, Offer, Opened, Options, Paced, Path, exporter_exited, no_fds

if TYPE_CHECKING:
    from .._share import Share

__all__ = ["PATH", "RmaTransport", "raise_rma_error"]

#: What the region server counts for each reply under way (src/native/region.hpp:
#: kReplyCost, plus the data of a reply sent eagerly, up to kEagerMax); it refuses
#: an importer more than 64 MiB of them (kMaxPeerReplyBytes).
REPLY_COST = 4096
EAGER_MAX = 256 * 1024
#: The most one part of a batch may cost, and the parts under way at once: half
#: of the server's allowance, the rest for the connection's other transfers.
BATCH_COST = 16 << 20
BATCH_WINDOW = 2


class UcxRma(Path):
    name = "ucx-rma"
    rank = 6
    mapped = False
    holds_memory = False
    reopens = False
    maps_strided = False
    cross_node = True
    network = True
    serves = frozenset(KINDS)
    reason = "remote memory access through UCX, each transfer checked by the exporter; copies with get/put"

    def offer(self, memory: Memory) -> Offer | None:
        return None if memory.strided else Offer()

    def grant_fds(self, export: Any) -> int:
        return 0

    def serve(self, export: Any, session: Any) -> Grant:
        """The region server's address, this share's region and a key of its
        own for one lease (lock held); the region is added on the first
        ucx-rma open.  The lease's end revokes the key."""
        srv = _server.server()
        region = export.state.get(self.name)
        if region is None:
            region = export.state[self.name] = srv.add_region(export.target(), readonly=export.readonly)
        region_id, key = region.grant()
        # The key is revoked on the region it was granted on, even if that
        # closed (and another took its place) before the lease ended.
        return Grant({"address": srv.address, "region": region_id, "key": key},
                     on_end=lambda: _revoke(region, key))

    def not_offered(self, share: Any) -> str | None:
        if share.strides is not None:
            return f"not {self.name}: the share is a strided array, which goes only where it is mapped"
        return None

    def facts(self, share: Share, near: bool) -> str | None:
        """Why this process cannot start UCX (forked after its parent did), or None."""
        return _loader.refusal()

    def warm(self) -> None:
        warm()

    def unavailable(self, share: Any, here: Here) -> str | None:
        why_not = here.fact(self.name)
        return why_not if isinstance(why_not, str) else None

    def open(self, share: Any, grant: dict, fds: list[int], lease: Any, how: Options) -> Opened:
        no_fds(self.name, fds)
        address, region_id, key = grant.get("address"), grant.get("region"), grant.get("key")
        if (not isinstance(address, bytes) or isinstance(region_id, bool) or not isinstance(region_id, int)
                or not 0 <= region_id < 1 << 64 or not isinstance(key, bytes) or len(key) != _node.KEY_BYTES):
            raise InvalidInputError("exporter sent a malformed ucx-rma offer")
        # One connection per exporter, shared by every view of its shares;
        # the exporter checks this view's key on every transfer.
        peer = _peer.client().connect(address, timeout=how.timeout)
        return Opened(transport=RmaTransport(share, peer, (region_id, key), lease))


PATH: Path = UcxRma()


def warm() -> None:
    """Load UCX while the exporter prepares its offer."""
    _node.warm()


def _revoke(region: Any, key: bytes) -> None:
    """A ucx-rma lease ended: its key stops working at once (lock held), and
    a closed region is forgotten once no lease holds a key to it.
    Transfers admitted before finish on their own: the service thread
    does not wait for them."""
    try:
        region.revoke(key, timeout=0)
    except (WaitTimeoutError, ClosedError):
        pass  # revoked all the same (or the process's node is closed)


class RmaTransport:
    """A ucx-rma view's transfers, on the connection to the exporter's region server."""

    host_only = False

    def __init__(self, share: Any, peer: Any, region: tuple[int, bytes], lease: Any) -> None:
        self.share = share
        self.peer = peer
        self.region = region
        self.lease = lease  # asked for signs of life while a transfer waits
        # One request per exporter and kind of memory: puts into host shares
        # travel gathered, several to a message.
        self.batch_key = (id(peer), share.device == "host")
        # Once the view is gone, the connection forgets the region (every
        # open of a share whose region closed in between names a new one).
        forget = weakref.finalize(self, peer.forget_region, region[0])
        forget.atexit = False

    def _move(self, get: bool, offset: int, buf: Any, timeout: float | None, stream: Any, check: Any) -> None:
        check(buf, offset, get)  # bounds and the buffer; the connection pins it itself
        try:
            # CUDA memory: after the work queued on ``stream`` or the
            # buffer's own stream (the legacy one when none is named).
            (self.peer.get if get else self.peer.put)(*self.region, offset, buf, timeout, alive=self.lease,
                                                      stream=stream)
        except (UCXConnectionError, ClosedError) as exc:
            raise_rma_error(self.share, exc)

    def get(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None:
        self._move(True, offset, buf, timeout, stream, check)

    def put(self, offset: int, buf: Any, timeout: float | None, stream: Any, span: Any, check: Any) -> None:
        self._move(False, offset, buf, timeout, stream, check)

    async def _move_async(self, get: bool, offset: int, buf: Any, stream: Any, span: Any) -> None:
        handle = _device.consumer_stream(stream)
        local, _ = span(buf, offset, get, _driver.LEGACY_STREAM if handle is None else handle)
        try:
            # CUDA memory: the producer's work drains first without
            # blocking the loop (the post below then waits for nothing).
            await _device.order_before_async(local, handle)
        finally:
            local.release()
        post = self.peer.get_async if get else self.peer.put_async
        try:
            # Liveness as for the blocking calls: a frozen exporter ends the wait.
            await await_alive(post(*self.region, offset, buf, stream=stream), self.lease)
        except (UCXConnectionError, ClosedError) as exc:
            raise_rma_error(self.share, exc)

    async def get_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None:
        await self._move_async(True, offset, buf, stream, span)

    async def put_async(self, offset: int, buf: Any, stream: Any, span: Any) -> None:
        await self._move_async(False, offset, buf, stream, span)

    def batch(self, items: list, direction: str) -> list:
        """One request per exporter, in parts whose replies cost the exporter
        at most :data:`BATCH_COST` each (its region server refuses an
        importer more than 64 MiB of replies under way), a few at a time."""
        peer, host = self.peer, self.share.device == "host"
        chunks: list[list] = [[]]
        cost = 0
        for t, offset, buf in items:
            n = getattr(buf, "nbytes", None)  # what cannot say its size is counted as the most an eager reply holds
            eager = EAGER_MAX if type(n) is not int else n if 0 <= n <= EAGER_MAX else 0
            item_cost = REPLY_COST + eager
            if cost + item_cost > BATCH_COST and chunks[-1]:
                chunks.append([])
                cost = 0
            chunks[-1].append((*t.region, offset, buf))
            cost += item_cost
        if len(chunks) == 1:
            return [peer.get_batch(chunks[0]) if direction == "get" else peer.put_batch(chunks[0], host_regions=host)]

        def starter(entries: list) -> Any:
            if direction == "get":
                return lambda: peer.get_batch(entries)
            return lambda: peer.put_batch(entries, host_regions=host)

        return [Paced([starter(c) for c in chunks], BATCH_WINDOW, f"a batched {direction} over ucx-rma")]

    def close(self) -> None:
        pass  # the connection serves every view of the exporter; the lease's end revokes the key


def raise_rma_error(share: Any, exc: UCXConnectionError | ClosedError) -> NoReturn:
    """Raise ``exc`` (caught from a ucx-rma transfer), saying what a broken
    connection means: the exporter's side went away."""
    if isinstance(exc, UCXConnectionError):
        pid = share.exporter_pid
        what = ("has exited" if exporter_exited(share) else
                "closed its side: the share was revoked or its lifetime ended, or the process exited")
        raise type(exc)(exc.status, f"{exc.message}: the exporter (pid {pid}) {what}; this view cannot be used "
                                    "any more: close it, and open a share from a running exporter") from exc
    if "exporter" in str(exc):
        raise ClosedError(f"{exc}: the share was revoked or its lifetime ended; this view cannot be used any "
                          "more: close it (and open the share again if it is still exported)") from None
    raise exc
