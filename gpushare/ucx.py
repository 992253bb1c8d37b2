"""Remote memory access through UCX: register memory, share a key, put and get.

A thin, safe layer over libucxx's ``MemoryHandle``, ``RemoteKey`` and memory
put/get requests::

    from gpushare import ucx

    with ucx.Agent() as agent:
        ep = agent.connect(peer_address)          # bytes from the peer's agent.address
        rkey = ep.unpack_remote_key(key_blob)     # bytes from the peer's key.serialize()
        ep.mem_put(data, rkey.base_address, rkey).wait()
        ep.flush().wait()                         # now the data is in the peer's memory

UCX is loaded when the first :class:`Agent` is made.  See ``docs/ucx.md``.
"""

from ._ucx._agent import PROGRESS_MODES, Agent, Endpoint, MemoryHandle, RemoteKey, Request

__all__ = ["Agent", "Endpoint", "MemoryHandle", "RemoteKey", "Request", "PROGRESS_MODES", "ucx_version"]

for _cls in (Agent, Endpoint, MemoryHandle, RemoteKey, Request):
    _cls.__module__ = __name__  # they present themselves as gpushare.ucx.X
del _cls


def ucx_version() -> tuple[int, int, int]:
    """The version of the UCX library in use, as (major, minor, release)."""
    from ._ucx._loader import native

    return tuple(native().ucx_version())
