"""UCX internals: the per-process region server and its client.

:func:`._server.server` and :func:`._peer.client` return this process's
:class:`._server.Server` and :class:`._peer.Client`, both on one UCX worker
(:mod:`._node`) with one progress thread.  The older
per-object API (``Agent``, ``Endpoint``...) is :mod:`gpushare.ucx`.
"""

__all__: list[str] = []  # each name is imported from the module that defines it
