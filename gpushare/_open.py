"""gpushare.open and open_async: validate the share, choose the paths this
process can take, ask the exporter for each in turn, and make the view."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
import warnings
from collections.abc import Generator
from typing import Any, Generic, TypeVar, overload

from . import _paths, _types
from ._bundle import Bundle, _State
from ._cuda import _driver
from ._errors import GpuShareError, InvalidInputError, InvalidTypeError, SlowPathWarning
from ._offering import PathList
from ._opening import OpenedShare, _open_parts, _PartFailed, open_share
from ._paths.base import Opened, Options
from ._share import BundleShare, Share, expect_share
from ._view import View

__all__ = ["open", "open_async"]

log = logging.getLogger("gpushare.api")


@overload
def open(share: BundleShare, *, prefer: PathList | None = ..., exclude: PathList | None = ...,  # noqa: A001
         timeout: float = ..., device: _types.Device | None = ..., prefault: bool = ...) -> Bundle: ...
@overload
def open(share: Share, *, prefer: PathList | None = ..., exclude: PathList | None = ...,  # noqa: A001
         timeout: float = ..., device: _types.Device | None = ..., prefault: bool = ...) -> View: ...


def open(share: Share, *, prefer: PathList | None = None, exclude: PathList | None = None,  # noqa: A001
         timeout: float = 10.0, device: _types.Device | None = None, prefault: bool = False) -> View | Bundle:
    """Open a share from any process that can reach the exporter.

    The best path for this pair is tried first, then the next ones if a
    probe fails (within ``timeout`` in all); a fallback to a slower path than
    the pair could use emits :class:`SlowPathWarning` and ``view.why`` says
    what failed.  A further open of a ``lifetime="revoked"`` share whose
    host-fd view closed less than two seconds ago reuses that view's lease
    and mapping, with no message to the exporter (never once it revoked the
    share; see docs/lifetimes.md).

    Parameters
    ----------
    share : Share
        From :func:`export`, probably unpickled: it is validated.
    prefer, exclude : list of str or comma-separated str, optional
        Paths to try first / never.  The environment variables
        ``GPUSHARE_PATHS`` (prefer) and ``GPUSHARE_EXCLUDE_PATHS`` do the same
        for a whole job; ``prefer=`` replaces ``GPUSHARE_PATHS``,
        ``exclude=`` adds to ``GPUSHARE_EXCLUDE_PATHS``.
        A bundle's share (:class:`BundleShare`, from an export of a dict,
        list or tuple) opens as a :class:`Bundle`: every allocation on its
        best path, one lease for them all.
    timeout : float
        Seconds for the whole open: reaching the exporter and every probe.
    device : int or "host", optional
        For shares of CUDA memory: the device (an ordinal of this process) to
        map it on (``"host"``/``"cpu"`` are accepted for host shares only).  By default the calling thread's current device, where it
        can reach the memory; else the memory's own device, matched by UUID.
        The calling thread's current device is left as it was.
    prefault : bool, default False
        For host memory mapped into this process (host-fd): fault in every
        page during the open (``MADV_POPULATE_READ``), so that the first
        copy or store pays no page faults.  Ignored on other paths.

    Raises
    ------
    InvalidTypeError
        ``share`` is not a :class:`Share` (bytes from :meth:`Share.to_bytes`
        are read back with :meth:`Share.from_bytes` first).
    ClosedError
        The share was revoked, its lifetime ended, or it is unknown to the exporter.
    AccessDeniedError
        Its token is wrong (forged).
    ExporterUnreachableError
        The exporter is gone or unreachable.
    GpuShareError
        Every candidate path failed; the message lists why.
    """
    share = expect_share(share, "open")
    timeout = _types.positive_timeout(timeout)
    if not isinstance(prefault, bool):
        raise InvalidTypeError(f"prefault must be a bool, not {type(prefault).__name__}")
    device = _device(share, device)
    got = open_share(share, prefer, exclude, timeout, device, prefault)
    if share.is_bundle:
        return _bundle(share, got)
    path = got.paths[0]
    if got.targets is not None:  # the exporter is this process
        opened = _paths.by_name(path).open(share, {"target": got.targets[0]}, [], None, Options())
        return View._make(share, path, got.whys[0], opened)
    if got.kept is not None:  # a closed view's kept lease and mapping (gpushare._reopen)
        lease, use = got.kept
        view = View._make(share, path, "", Opened(mapping=use.mapped), kept=use)
        view._attach_lease(lease, got.whys[0])
        log.info("opened share %s over %s (reopened a closed view's lease)", share.share_id[:8], view.why)
        _warn_slow(view, got.slow)
        return view
    view = View._make(share, path, "", got.opened[0])
    view._attach_lease(got.lease, got.whys[0])
    log.info("opened share %s over %s", share.share_id[:8], view.why)
    if got.keep_key is not None:
        got.lease.may_keep(got.keep_key, view._use)
    _warn_slow(view, got.slow)
    return view


def _bundle(share: Share, got: OpenedShare) -> Bundle:
    """The :class:`Bundle` over what the open made of each allocation."""
    state = _State(share, share._bundle, got.parts, got.paths, got.opened, got.whys, got.lease,
                   got.targets)
    bundle = Bundle._make(state, share._bundle.tree)
    log.info("opened bundle %s: %d tensors in %d allocations over %s", share.share_id[:8], share._bundle.count,
             len(got.paths), ", ".join(sorted(set(got.paths))))
    _warn_slow(bundle, got.slow, 4)  # at open's caller, past this function
    return bundle


def _warn_slow(opened: View | Bundle, slow: str | None, stacklevel: int = 3) -> None:
    """Warn of a slower path than the pair could use (``SlowPathWarning``,
    at ``open``'s caller); a warning turned into an error leaves nothing open."""
    if slow is None:
        return
    try:
        warnings.warn(SlowPathWarning(slow), stacklevel=stacklevel)
    except BaseException:
        opened.close()
        raise


def _device(share: Share, device: Any) -> int | None:
    """``device=`` of an open: where its CUDA memory is mapped (None: the
    calling thread's current device, or the memory's own)."""
    if _types.is_host(device):
        if not share.is_bundle and share.device != "host":
            raise InvalidInputError(
                f"device={device!r}: this share is CUDA memory, which cannot be mapped on the host; "
                "open it on a CUDA device (or device=None) and copy out with view.get()"
            )
        return None
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidInputError(f"device must be a CUDA device ordinal (an int >= 0) or 'host', not {device!r}")
    if not share.is_bundle and share.device == "host":
        raise InvalidInputError(f"device={device} given for a share of host memory")
    if _driver.unavailable_reason() is None:
        _driver.valid_ordinal(device)  # a wrong device is the caller's error, not a path's
    return device


def _import(share: Share, path: str, payload: Any, timeout: float, fds: list[int],
            device: int | None = None, lease: Any = None, prefault: bool = False) -> View:
    """One path's grant turned into a view, as the open pipeline does it
    (``fds``, owned, are closed here): for tests that feed it offers."""
    deadline = time.monotonic() + timeout
    try:
        opened = _open_parts([share], [path], payload, fds, lease, device, deadline, prefault, bundle=False)
    except _PartFailed as failed:
        raise failed.error from None
    return View._make(share, path, "", opened[0])


# ---------------------------------------------------------------- asyncio


def _close_late(future: asyncio.Future) -> None:
    """The open finished after its caller gave up: close what it opened."""
    if future.cancelled() or future.exception() is not None:
        return
    with contextlib.suppress(GpuShareError):
        future.result().close()


@overload
def open_async(share: BundleShare, *, prefer: PathList | None = ..., exclude: PathList | None = ...,
               timeout: float = ..., device: int | None = ...) -> Opening[Bundle]: ...
@overload
def open_async(share: Share, *, prefer: PathList | None = ..., exclude: PathList | None = ...,
               timeout: float = ..., device: int | None = ...) -> Opening[View]: ...


def open_async(share: Share, *, prefer: PathList | None = None, exclude: PathList | None = None,
               timeout: float = 10.0, device: int | None = None) -> Opening[Any]:
    """:func:`gpushare.open` for asyncio: the event loop keeps running while
    the share is opened: ``view = await gs.open_async(share)``, or
    ``async with gs.open_async(share) as view`` (closed at the block's end).

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
    Opening
        Awaitable (the view) and an async context manager (the view, closed
        when the block ends).

    Examples
    --------
    >>> async def read(share, out):  # doctest: +SKIP
    ...     async with gs.open_async(share) as view:
    ...         await view.get_async(out)
    """
    return Opening(expect_share(share, "open_async"), prefer, exclude, timeout, device)


_Opened = TypeVar("_Opened")


class Opening(Generic[_Opened]):
    """What :func:`open_async` returns: ``await`` it for the view, or use it
    with ``async with`` (the view, closed when the block ends)."""

    __slots__ = ("_args", "_view")

    def __init__(self, *args: Any) -> None:
        self._args = args
        self._view: Any = None

    async def _open(self) -> _Opened:
        share, prefer, exclude, timeout, device = self._args
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, open, share, prefer=prefer, exclude=exclude,
                                 timeout=timeout, device=device)
        future = loop.run_in_executor(None, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_late)
            raise

    def __await__(self) -> Generator[Any, None, _Opened]:
        return self._open().__await__()

    async def __aenter__(self) -> _Opened:
        self._view = await self._open()
        return self._view

    async def __aexit__(self, *exc: object) -> None:
        view, self._view = self._view, None
        if view is not None:
            view.close()
