"""A prepared batch of the seed API (``Endpoint.prepare_put_batch``/``prepare_get_batch``):
items resolved, pinned and checked once, then posted as one request as often as the caller
likes.  A one-shot batch (``Endpoint.mem_put_batch``/``mem_get_batch``) is a plan posted once.

What a post re-checks: the plan, its endpoint and agent, and its key are open; a CUDA plan's
producers' work is waited for again.  What it does not redo: resolving and checking the items
(they stay pinned, their ranges inside the key's region, for the plan's life).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import ClosedError, GpuShareError, InvalidInputError
from . import _device
from ._batch import release_all, resolve_items
from ._common import MEMORY_TYPE_CODES, Request, user_callback

__all__ = ["BatchPlan", "prepare", "post_once"]


class BatchPlan:
    """Puts or gets of fixed ``(buffer, remote_address)`` items against one key, checked once
    and posted many times.

    Made by :meth:`Endpoint.prepare_put_batch` and :meth:`Endpoint.prepare_get_batch`.  Each
    :meth:`post` moves every item as one :class:`Request`, as one
    :meth:`Endpoint.mem_put_batch` would, without resolving or checking the items again: what a
    caller moving the same buffers over and over (a cache's blocks, a model's layers) pays per
    item in Python is paid once.  The plan keeps its buffers referenced (pinned) until it is
    closed and no request of it is in flight.
    """

    # _state: (local buffers, addresses, lengths, remote addresses, handles, producers) or None
    # once closed, read once by each post: a close in another thread never leaves a post with
    # the native arguments of buffers it no longer holds.
    __slots__ = ("_op", "_endpoint", "_rkey", "_state", "_code", "_size", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("BatchPlan objects are made by Endpoint.prepare_put_batch/prepare_get_batch")

    @property
    def kind(self) -> str:
        """``"put"`` or ``"get"``."""
        return self._op

    @property
    def closed(self) -> bool:
        return self._state is None

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} items"
        return f"<gpushare.ucx.BatchPlan {self._op}, {state}>"

    def post(self, callback: Callable[[GpuShareError | None, Any], Any] | None = None,
             callback_data: Any = None, *, stream: Any = None, flush: bool = False) -> Request:
        """Post every item as one request.

        Parameters
        ----------
        callback, callback_data
            As for :meth:`Endpoint.mem_put`.
        stream : optional
            For CUDA memory: each post waits, in this thread, for the work queued on ``stream``
            and on the streams the buffers' ``__cuda_array_interface__`` named when the plan was
            made (those streams must outlive the plan), or on the legacy default stream when
            neither is named.  A DLPack producer ordered its pending work when the plan was made
            only: name its stream here to order later work.
        flush : bool
            For a put plan: the request completes only once every put is complete at the peer,
            as if :meth:`Endpoint.flush` had been posted behind the puts and waited for too,
            without a request of its own (NIXL's WRITE completes so).  Default: local
            completion, as for :meth:`Endpoint.mem_put_batch`.

        Raises
        ------
        ClosedError
            If the plan, its key, its endpoint or its agent is closed.
        InvalidInputError
            If ``callback`` is not callable, or ``flush`` is not a bool or is asked of a get plan
            (a get is complete when its data is here).
        """
        if self._state is None:
            raise ClosedError("batch plan is closed")
        if callback is not None and not callable(callback):
            raise InvalidInputError("callback must be callable or None")
        check_flush(flush, self._op)
        return self._post(callback, callback_data, None if stream is None else _device.consumer_stream(stream),
                          flush=flush)

    def _post(self, callback: Callable | None, callback_data: Any, consumer: int | None,
              release: bool = False, flush: bool = False) -> Request:
        """Post the plan; ``release``: release its buffers if it fails before posting (a one-shot
        batch's); ``flush``: complete at the peer."""
        state = self._state
        if state is None:
            raise ClosedError("batch plan is closed")
        locals_, addresses, lengths, remote, memhs, producers = state
        ep = self._endpoint
        nreq = None
        try:
            n = ep._check_open()
            ep._check_key(self._rkey)
            ep._agent._zero_unused()
            holder: list[Request] = []
            on_done = None if callback is None else user_callback(callback, callback_data, holder, self._op)
            for first_on_stream in producers:  # one per producer's stream
                _device.order_before(first_on_stream, consumer)  # as for one request
            with _device.on_memory_device(locals_[0] if locals_ else None):
                nreq = n.rma_batch(self._op == "put", addresses, lengths, remote, self._rkey._native, self._code,
                                   memhs, flush, None)
        except BaseException:
            if release and nreq is None:  # nothing posted: nothing of UCX's uses them
                release_all(locals_)
            raise
        # Posted: the request holds the buffers until it is done.
        return ep._request(nreq, locals_, on_done, holder)

    def close(self) -> None:
        """Drop the plan's buffers (idempotent).  A request of it still in flight keeps them
        referenced until it is done."""
        self._state = None

    def __enter__(self) -> BatchPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepare(endpoint: Any, op: str, items: Any, rkey: Any, consumer: int | None) -> BatchPlan:
    """The plan of ``op`` (``"put"`` or ``"get"``) of ``items`` against ``rkey`` on
    ``endpoint``; ``consumer``: the stream a DLPack producer orders its pending work before
    (None: the legacy default stream).  Raises before anything is pinned for good."""
    endpoint._check_open()
    endpoint._check_key(rkey)
    locals_, remote = resolve_items(items, op, rkey._base, rkey._base + rkey._size, consumer)
    try:
        registration = endpoint._agent._registration
        memhs = [registration(lb.address, lb.nbytes, lb.memory_type) for lb in locals_]
    except BaseException:
        release_all(locals_)
        raise
    plan = object.__new__(BatchPlan)
    plan._op = op
    plan._endpoint = endpoint
    plan._rkey = rkey
    plan._code = MEMORY_TYPE_CODES[locals_[0].memory_type] if locals_ else 0
    plan._size = len(locals_)
    cuda = bool(locals_) and locals_[0].memory_type == "cuda"
    plan._state = (locals_, [lb.address for lb in locals_], [lb.nbytes for lb in locals_], remote, memhs,
                   list({lb.stream: lb for lb in locals_}.values()) if cuda else [])
    return plan


def check_flush(flush: Any, op: str) -> None:
    """Refuse a ``flush`` that is no bool, or is asked of gets."""
    if not isinstance(flush, bool):
        raise InvalidInputError(f"flush must be a bool, not {type(flush).__name__}")
    if flush and op != "put":
        raise InvalidInputError("flush applies to puts only: a get is complete when its data is here")


def post_once(endpoint: Any, op: str, items: Any, rkey: Any, callback: Callable | None, callback_data: Any,
              stream: Any, flush: bool = False) -> Request:
    """A one-shot batch: the plan of ``items``, posted once and dropped (its buffers released
    if the post fails); ``flush``: complete at the peer."""
    endpoint._check_open()
    endpoint._check_key(rkey)
    if callback is not None and not callable(callback):
        raise InvalidInputError("callback must be callable or None")
    check_flush(flush, op)
    consumer = None if stream is None else _device.consumer_stream(stream)
    plan = prepare(endpoint, op, items, rkey, consumer)
    try:
        return plan._post(callback, callback_data, consumer, release=True, flush=flush)
    finally:
        plan.close()
