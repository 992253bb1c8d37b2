"""Batched transfers: many (view, offset, buffer) moves, one call, one completion.

:func:`get_batch` and :func:`put_batch` check every item first (nothing moves
when one is bad), then start them all: the ucx-rma items of one exporter go
as one batch on its connection (one request), mapped items as copies (host
copies at once, CUDA copies queued on their streams).  The returned
:class:`BatchRequest` completes when every item has.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from . import _view
from ._errors import InvalidTypeError, WaitTimeoutError
from ._view import View

__all__ = ["BatchRequest", "get_batch", "put_batch"]


class BatchRequest:
    """The completion of a batch: ``wait(timeout)``, ``done()``,
    ``exception()`` and ``await``, as for :class:`gpushare.ucx.Request`."""

    __slots__ = ("_parts", "_count")

    def __init__(self, parts: list[Any], count: int) -> None:
        self._parts = parts
        self._count = count

    def __len__(self) -> int:
        """How many items the batch moves."""
        return self._count

    def done(self) -> bool:
        """Whether every item has completed (or one failed)."""
        return all(p.done() for p in self._parts)

    def exception(self) -> BaseException | None:
        """The first error among the completed items, or ``None``."""
        for p in self._parts:
            if p.done():
                exc = p.exception()
                if exc is not None:
                    return exc
        return None

    def wait(self, timeout: float | None = None) -> None:
        """Block until every item completes; raise the first error.

        Raises
        ------
        WaitTimeoutError
            If ``timeout`` seconds pass first; the items stay in flight.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self._parts:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0 and not p.done():
                raise WaitTimeoutError(f"the batch did not complete within {timeout} s; it stays in flight")
            p.wait(left)

    def __await__(self) -> Any:
        for p in self._parts:
            yield from p.__await__()

    def __repr__(self) -> str:
        return f"<gpushare.BatchRequest {self._count} items, {'done' if self.done() else 'in flight'}>"


def _items(items: Iterable[Any], direction: str) -> list[tuple[Any, int, Any]]:
    if isinstance(items, (str, bytes)):
        raise InvalidTypeError(f"a batch is an iterable of (view, offset, buffer) tuples, not {type(items).__name__}")
    try:
        out = list(items)
    except TypeError:
        raise InvalidTypeError(
            f"a batch is an iterable of (view, offset, buffer) tuples, not {type(items).__name__}") from None
    for i, item in enumerate(out):
        if not isinstance(item, tuple) or len(item) != 3 or not isinstance(item[0], View):
            raise InvalidTypeError(f"batch item {i} is not a (view, offset, buffer) tuple: {item!r:.80}")
        view, offset, buf = item
        _view.check_item(view, offset, buf, direction)  # bounds, state and buffer, before anything moves
    return out


def _start(items: Iterable[Any], direction: str) -> BatchRequest:
    checked = _items(items, direction)
    parts: list[Any] = []
    # Items whose transports share a key travel together (a ucx-rma batch
    # per exporter and kind of memory); mapped items are copies.
    groups: dict[Any, list[tuple[Any, int, Any]]] = {}
    for view, offset, buf in checked:
        transport = _view.transport_of(view)
        if transport is not None:
            groups.setdefault(transport.batch_key, []).append((transport, offset, buf))
            continue
        request = _view.start_copy(view, offset, buf, direction)
        if request is not None:
            parts.append(request)
    for entries in groups.values():
        parts.extend(entries[0][0].batch(entries, direction))
    return BatchRequest(parts, len(checked))


def get_batch(items: Iterable[tuple[Any, int, Any]]) -> BatchRequest:
    """Copy out of many shares at once: for each ``(view, offset, dst)``,
    ``len(dst)`` bytes from ``view`` at ``offset`` into ``dst``.

    Every item is checked first (bounds, open views, writable destinations):
    a bad one raises before anything moves.  The ucx-rma items of one
    exporter travel as one batch on its connection.

    Returns
    -------
    BatchRequest
        Completes when every destination holds its bytes.
    """
    return _start(items, "get")


def put_batch(items: Iterable[tuple[Any, int, Any]]) -> BatchRequest:
    """Copy into many shares at once: for each ``(view, offset, src)``,
    ``src`` into ``view`` at ``offset``.  As :func:`get_batch`; read-only
    shares are refused before anything moves.

    Returns
    -------
    BatchRequest
        Completes when every item is in the shared memory (in the exporter's
        memory for ucx-rma; visible to every process that maps it for
        mapped paths).
    """
    return _start(items, "put")
