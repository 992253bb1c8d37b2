"""UCX internals: the per-process region server and its client.

:func:`server` and :func:`client` return this process's :class:`Server` and
:class:`Client`, both on one UCX worker with one progress thread.  The older
per-object API (``Agent``, ``Endpoint``...) is :mod:`gpushare.ucx`.
"""

from ._node import KEY_BYTES
from ._peer import Client, Peer, client
from ._server import Region, Server, server

__all__ = ["server", "client", "Server", "Client", "Region", "Peer", "KEY_BYTES"]
