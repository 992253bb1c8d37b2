"""Channels: a ring of shared slots with publish/wait, for step loops.

One producer, a fixed number of consumers.  The producer fills a slot and
publishes step ``t``; every consumer waits for step ``t``, reads the slot
(zero-copy where its path maps the memory) and releases it; the producer
reuses a slot only once every consumer released the step in it.

Slots are gpushare shares (host memory from :func:`gpushare.allocate`, or
CUDA memory), opened by each consumer through :func:`gpushare.open`.
Notifications go over one connection per consumer (a Unix socket on the
same node, TCP across nodes), admitted by the process's service thread;
what they say, how a join is checked and how a wait tells a frozen peer
from a busy one is in this package's modules (``handle``, ``records``, ``hub``, ``join``,
``waits``).  Waiting is waiting on
the kernel (``poll`` or the asyncio loop's reader) on that connection and,
on one node, on a pidfd of the peer, so a process that dies wakes its peers
at once.
"""

from __future__ import annotations

# Pickles of a ChannelHandle name their constructor here (``gpushare._channel._rebuild_handle``,
# set by :mod:`.handle`): it stays importable from this module for as long as such pickles exist.
from .handle import _rebuild_handle as _rebuild_handle

__all__ = ["_rebuild_handle"]
