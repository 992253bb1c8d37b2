"""asyncio forms of the sharing API: :func:`open_async`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools

from ._api import PathList, View, open
from ._errors import GpuShareError
from ._share import Share

__all__ = ["open_async"]


def _close_late(future: asyncio.Future) -> None:
    """The open finished after its caller gave up: close what it opened."""
    if future.cancelled() or future.exception() is not None:
        return
    with contextlib.suppress(GpuShareError):
        future.result().close()


async def open_async(share: Share, *, prefer: PathList | None = None, exclude: PathList | None = None,
                     timeout: float = 10.0, device: int | None = None) -> View:
    """:func:`gpushare.open` for asyncio: the event loop keeps running while
    the share is opened.

    The open (reaching the exporter, mapping or connecting) runs in the
    loop's default executor; arguments, errors and the returned view are
    those of :func:`gpushare.open`.  Use the view with ``async with``.  If the
    awaiting task is cancelled, the view the open still makes is closed as
    soon as it exists.

    Parameters
    ----------
    share : Share
        From :func:`gpushare.export`.
    prefer, exclude : list of str or comma-separated str, optional
        As for :func:`gpushare.open`.
    timeout : float
        Seconds for the whole open.
    device : int, optional
        As for :func:`gpushare.open`.

    Returns
    -------
    View

    Examples
    --------
    >>> async def read(share, out):  # doctest: +SKIP
    ...     async with await gs.open_async(share) as view:
    ...         await view.get_async(out)
    """
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, open, share, prefer=prefer, exclude=exclude,
                             timeout=timeout, device=device)
    future = loop.run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_late)
        raise
