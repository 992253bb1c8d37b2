"""Remote memory access through UCX: register memory, share a key, put and get.

A thin, safe layer over libucxx's ``MemoryHandle``, ``RemoteKey`` and memory
put/get requests::

    from gpushare import ucx

    with ucx.Agent() as agent:
        ep = agent.connect(peer_address)          # bytes from the peer's agent.address
        rkey = ep.unpack_remote_key(key_blob)     # bytes from the peer's key.serialize()
        ep.mem_put(data, rkey.base_address, rkey).wait()
        ep.flush().wait()                         # now the data is in the peer's memory

The region server is the other way, and the one the sharing API uses: one
UCX worker per process serves every region, and the exporter checks every
request (region, key, range, read-only) before any byte moves::

    region = ucx.server().add_region(array)      # exporter
    region_id, key = region.grant()              # one capability per importer
    peer = ucx.client().connect(address)         # importer: one per exporter
    peer.get(region_id, key, 0, out)
    peer.get_batch([(region_id, key, off, buf) for off, buf in pieces]).wait()

UCX is loaded when the first :class:`Agent`, server or client is made.  See
``docs/ucx.md``.
"""

from ._ucx import _loader
from ._ucx._agent import Agent, Endpoint
from ._ucx._batch import MAX_BATCH_ITEMS
from ._ucx._common import PROGRESS_MODES, Request
from ._ucx._plan import BatchPlan
from ._ucx._registered import MemoryHandle, RemoteKey
from ._ucx._local import LocalPeer
from ._ucx._node import KEY_BYTES
from ._ucx._peer import Client, Peer, client
from ._ucx._server import Region, Server, server

__all__ = ["Agent", "Endpoint", "MemoryHandle", "RemoteKey", "Request", "BatchPlan", "PROGRESS_MODES", "ucx_version", "LocalPeer",
           "Server", "Region", "Client", "Peer", "server", "client", "KEY_BYTES", "MAX_BATCH_ITEMS"]

for _cls in (Agent, Endpoint, MemoryHandle, RemoteKey, Request, BatchPlan, Server, Region, Client, Peer, LocalPeer):
    _cls.__module__ = __name__  # they present themselves as gpushare.ucx.X
del _cls


def ucx_version() -> tuple[int, int, int]:
    """The version of the UCX library in use, as (major, minor, release)."""
    return tuple(_loader.native().ucx_version())
