"""This process's UCX node: one UCX context, one worker and one progress
thread, shared by its region :class:`~gpushare._ucx._server.Server` and its
:class:`~gpushare._ucx._peer.Client`; its configuration, and the checks of
a region's key and id both sides make."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from .. import _types
from .._errors import ClosedError, InvalidInputError
from .._process import PerProcess
from ._common import default_transports, mt_config, wake_timeout_ms
from ._loader import keep_forever, native

if TYPE_CHECKING:
    from ._peer import Peer

__all__ = ["node_config", "tcp_segment_config", "put_part", "warm", "KEY_BYTES"]

#: Length in bytes of a region key.
KEY_BYTES = 16
_CLOSE_TIMEOUT = 10.0
_OK = ("UCS_OK", "GS_OK")


# -- the process's node: one UCX context, one worker, one progress thread ------


def node_config() -> dict[str, str]:
    """UCX settings of the process's worker.

    The default transports (:func:`default_transports`) unless ``UCX_TLS``
    chooses; either way without ``cuda_ipc``, which maps one physical
    allocation per registered range and takes VMM memory only with fabric
    handles: over it a buffer of several allocations would expose its first
    one only.  Processes on one node share GPU memory over the mapped paths.
    """
    cfg: dict[str, str] = {}
    tls = os.environ.get("UCX_TLS")
    if tls is None:
        cfg["TLS"] = default_transports()
    elif not tls.startswith("^") and "cuda_ipc" in tls.split(","):
        cfg["TLS"] = ",".join(t for t in tls.split(",") if t != "cuda_ipc") or "tcp"
    cfg.update(mt_config())
    cfg.update(tcp_segment_config())
    return cfg


def tcp_segment_config() -> dict[str, str]:
    """Larger TCP segments than UCX's (8 KiB sent, 64 KiB received at a
    time): each segment costs a pass through UCX's TCP progress, which made
    a 1 MiB transfer take about 0.9 ms on loopback; 512 KiB / 1 MiB bring it
    to about 0.35 ms, and 64 KiB transfers to half their time.  The buffers
    come from pools that grow as needed; the processes' RSS grew by about
    1 MiB.  ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE`` in the
    environment win."""
    wanted = {"TCP_TX_SEG_SIZE": "512k", "TCP_RX_SEG_SIZE": "1m"}
    return {k: v for k, v in wanted.items() if "UCX_" + k not in os.environ}


#: Puts of more than this many bytes, up to 1 MiB, travel in parts of it.
PUT_PART = 512 * 1024


def put_part(cfg: dict[str, str]) -> int:
    """The part size of puts for a worker with settings ``cfg``; 0: whole.

    Over TCP with the segments of :func:`tcp_segment_config`, a part of
    512 KiB is one eager message that UCX sends from the caller's buffer
    and the exporter copies straight from its receive segment; a whole
    1 MiB put is copied into segments on both sides and reassembled on the
    exporter, and took about 20% longer on loopback.  Over any other
    transport (InfiniBand's eager messages are a few KiB) or other segment
    sizes, puts travel whole.
    """
    if "UCX_TCP_TX_SEG_SIZE" in os.environ or "UCX_TCP_RX_SEG_SIZE" in os.environ:
        return 0
    tls = cfg.get("TLS", os.environ.get("UCX_TLS", ""))
    names = set(tls.split(",")) - {""}
    if tls.startswith("^") or not names or not names <= {"tcp", "cuda_copy", "self"}:
        return 0
    return PUT_PART


class _Node:
    """This process's UCX worker, shared by its :class:`Server` and :class:`Client`."""

    def __init__(self) -> None:
        cfg = node_config()
        progress = os.environ.get("GPUSHARE_UCX_PROGRESS", "blocking")
        if progress not in ("blocking", "polling"):
            raise InvalidInputError(f"GPUSHARE_UCX_PROGRESS must be 'blocking' or 'polling', not {progress!r}")
        self.native = native().Node(cfg, progress == "polling", True,
                                    wake_timeout_ms(cfg.get("TLS", os.environ.get("UCX_TLS"))), put_part(cfg))
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.held: list[Any] = []  # buffers of regions whose transfers did not drain
        self.peers: dict[bytes, Peer] = {}  # by worker address

    def check(self) -> Any:
        if os.getpid() != self.pid:
            raise ClosedError(f"this UCX server/client belongs to process {self.pid}: UCX state does not survive "
                              "fork; in this process call server() or client() again (or open the share again)")
        if self.native.closed:
            raise ClosedError("the process's UCX node is closed")
        return self.native

    def stop(self) -> None:
        with self.lock:
            peers, self.peers = list(self.peers.values()), {}
        for p in peers:
            p._shutdown(1.0)
        self.native.close()
        with self.lock:
            held, self.held = self.held, []
        for lb in held:
            lb.release()


def _abandon(node: _Node) -> None:
    # No lock: a thread of the parent may have held it when the process forked.
    keep_forever(node.native)
    for p in list(node.peers.values()):
        keep_forever(p._native)


_NODE: PerProcess[_Node] = PerProcess(_Node, stop=_Node.stop, abandon=_abandon)


def _check_key(key: Any) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"a region key must be bytes, not {type(key).__name__}")
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise InvalidInputError(f"a region key is {KEY_BYTES} bytes, not {len(key)}")
    return key


def _check_region_id(region_id: Any) -> int:
    return _types.in_range(region_id, "region_id", 1)


def warm() -> None:
    """Start making this process's worker in the background, if there is none.

    For an importer about to ask an exporter for a ucx-rma offer: loading
    UCX here then overlaps the exporter's answer (which may load UCX there)
    instead of following it.  An error is not reported here: the
    :func:`client` call that needs the worker makes it again and raises."""
    if _NODE.current() is not None:
        return

    def make() -> None:
        try:
            _NODE.get()
        except BaseException:  # noqa: BLE001 - client() raises it where it matters
            pass

    threading.Thread(target=make, name="gpushare-ucx-load", daemon=True).start()
