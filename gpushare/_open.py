"""gpushare.open and open_async: validate the share, choose the paths this
process can take, ask the exporter for each in turn, and make the view."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import time
import warnings
from collections.abc import Generator
from typing import Any, Generic, TypeVar, overload

from . import _paths, _types
from ._bundle import Bundle
from ._cuda import _driver
from ._errors import (
    AccessDeniedError,
    ClosedError,
    ExporterUnreachableError,
    GpuShareError,
    InvalidInputError,
    SlowPathWarning,
    UnsupportedError,
)
from ._exporter import refusal_text, registered
from ._importer import get_importer
from ._offering import PathList
from ._open_tree import open_tree
from ._paths import same_process, ucx_rma
from ._reach import MESSAGE_CHARS, addresses_for, choose, here_for, raise_refusal, slow_reason, unreachable
from ._share import BundleShare, Share, altered
from ._view import View

__all__ = ["open", "open_async", "choose", "here_for"]

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
    ClosedError
        The share was revoked, its lifetime ended, or it is unknown to the exporter.
    AccessDeniedError
        Its token is wrong (forged).
    ExporterUnreachableError
        The exporter is gone or unreachable.
    GpuShareError
        Every candidate path failed; the message lists why.
    """
    if not isinstance(share, Share):
        raise InvalidInputError(f"open expects a gpushare.Share, not {type(share).__name__}")
    timeout = _types.positive_timeout(timeout)
    if not isinstance(prefault, bool):
        raise InvalidInputError("prefault must be a bool")
    if share.is_bundle:
        return open_tree(share, prefer, exclude, timeout, _bundle_device(device), prefault)
    if _types.is_host(device):
        if share.device != "host":
            raise InvalidInputError(
                f"device={device!r}: this share is CUDA memory, which cannot be mapped on the host; "
                "open it on a CUDA device (or device=None) and copy out with view.get()"
            )
        device = None
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise InvalidInputError(f"device must be a CUDA device ordinal (an int >= 0) or 'host', not {device!r}")
        if share.device == "host":
            raise InvalidInputError(f"device={device} given for a share of host memory")
        if _driver.unavailable_reason() is None:
            _driver.valid_ordinal(device)  # a wrong device is the caller's error, not a path's
    order, left_out, natural = choose(share, prefer, exclude)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("opening share %s: candidates %s; %s", share.share_id[:8], order or "none",
                  "; ".join(left_out) or "nothing left out")
    if not order:
        raise UnsupportedError("no path can serve this share here: " + "; ".join(left_out))
    failures: list[str] = []
    first = _paths.by_name(order[0])
    if first is same_process.PATH:
        export = registered(share)
        if export is None:  # it ended since the paths were chosen
            raise ClosedError("cannot open share: its lifetime ended or it was revoked")
        with export.lock:
            refusal = export.refusal()
            target = export.target()
        if refusal is not None:
            raise ClosedError(f"cannot open share: {refusal_text(refusal, export.policy)}")
        why_altered = altered(share.device, share.nbytes, share.offset, share.readonly, export.device,
                              export.nbytes, export.offset, export.readonly)
        if export.parts is not None:  # a bundle's share with its manifest taken out
            why_altered = ("the share names a bundle of tensors but carries no manifest: the share was altered "
                           "(forged or corrupt)")
        if why_altered:
            raise InvalidInputError(why_altered)
        why = f"{first.name}: {first.reason}"
        log.info("opened share %s over %s", share.share_id[:8], why)
        return View._make(share, first.name, why, first.open(share, {"target": target}, [], None, _paths.Options()))
    key = (share.share_id, share.token, share.device, share.nbytes, share.offset, share.readonly, first.name,
           prefault) if first.reopens else None
    if key is not None:
        kept = get_importer().reopen(share, key)
        if kept is not None:
            return _reopened(share, first.name, kept, left_out, natural, prefer, exclude)
    deadline = time.monotonic() + timeout
    if first is ucx_rma.PATH:
        ucx_rma.warm()  # load UCX here while the exporter prepares its offer

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ExporterUnreachableError(
                f"open did not finish within {timeout} s" + (f" ({'; '.join(failures)})" if failures else "")
            )
        return remaining

    importer = get_importer()
    addresses = addresses_for(share)
    try:
        # what the share says of the memory: the exporter refuses an open of a share that was altered
        said = {"device": share.device, "nbytes": share.nbytes, "offset": share.offset, "readonly": share.readonly}
        for path in order:
            request = {"op": "open", "share": share.share_id, "token": share.token, "path": path, "said": said}
            try:
                reply, lease, fds = importer.open(share, addresses, request, deadline)
            except ExporterUnreachableError as exc:
                raise ExporterUnreachableError(unreachable(share, str(exc))) from None
            if lease is None:
                if reply.get("code") == "path":
                    failures.append(f"{path} failed: {str(reply.get('message'))[:MESSAGE_CHARS]}")
                    log.info("share %s: %s; trying the next path", share.share_id[:8], failures[-1])
                    continue
                raise_refusal(reply)
            try:
                view = _import(share, path, reply.get("payload"), left(), fds, device, lease, prefault)
            except AccessDeniedError:
                lease.failed()
                raise  # a refusal is final: no other path may grant what this one refused
            except GpuShareError as exc:
                failures.append(f"{path} failed: {exc}")
                log.info("share %s: %s; trying the next path", share.share_id[:8], failures[-1])
                lease.failed()
                continue
            except BaseException:
                lease.failed()
                raise
            mapped = view._mapped
            # the mapping shows whether the memory is host or CUDA memory, whatever an exporter answered
            # (it may map CUDA memory on another device than the exporter's: only host or CUDA is compared)
            real = None if mapped is None else "host" if mapped.device == "host" else share.device
            why_altered = None if real is None else altered(share.device, 0, 0, False, real, 0, 0, False)
            if why_altered:  # the share is corrupt: no other path is tried with it
                view.close()
                lease.failed()
                raise InvalidInputError(why_altered)
            why = _paths.explain(path, left_out, failures)
            log.info("opened share %s over %s", share.share_id[:8], why)
            view._attach_lease(lease, why)
            if key is not None and path == first.name:
                lease.may_keep(key, view._use)
            _warn_slow(view, slow_reason(share, path, failures, left_out, natural, prefer, exclude, "gpushare"))
            return view
    except GpuShareError:
        raise
    except (EOFError, OSError, TimeoutError) as exc:
        raise ExporterUnreachableError(unreachable(share, f"it stopped answering: {exc}")) from None
    raise GpuShareError("every path failed: " + "; ".join(failures))


def _reopened(share: Share, path: str, kept: tuple, left_out: list[str], natural: list[str],
              prefer: PathList | None, exclude: PathList | None) -> View:
    """A view over a closed view's kept lease and mapping (:mod:`gpushare._reopen`)."""
    lease, use = kept
    view = View._make(share, path, "", _paths.Opened(mapping=use.mapped), kept=use)
    view._attach_lease(lease, _paths.explain(path, left_out, []))
    if log.isEnabledFor(logging.INFO):
        log.info("opened share %s over %s (reopened a closed view's lease)", share.share_id[:8], view.why)
    _warn_slow(view, slow_reason(share, path, [], left_out, natural, prefer, exclude, "gpushare"), 4)
    return view


def _warn_slow(view: View, slow: str | None, stacklevel: int = 3) -> None:
    """Warn of a slower path than the pair could use (``SlowPathWarning``,
    at ``open``'s caller); a warning turned into an error leaves nothing open."""
    if slow is None:
        return
    try:
        warnings.warn(SlowPathWarning(slow), stacklevel=stacklevel)
    except BaseException:
        view.close()
        raise


def _bundle_device(device: Any) -> int | None:
    """``device=`` of a bundle's open: where its CUDA allocations are mapped."""
    if device is None or _types.is_host(device):
        return None
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidInputError(f"device must be a CUDA device ordinal (an int >= 0) or 'host', not {device!r}")
    if _driver.unavailable_reason() is None:
        _driver.valid_ordinal(device)
    return device


def _import(share: Share, path: str, payload: Any, timeout: float, fds: list[int],
            device: int | None = None, lease: Any = None, prefault: bool = False) -> View:
    """Turn an exporter's offer into a view; ``fds`` (owned, closed here)
    came with the offer over a same-node control connection.  ``prefault``:
    fault in a host mapping before the view is made."""
    try:
        if not isinstance(payload, dict):
            raise InvalidInputError("exporter sent a malformed offer")
        opened = _paths.by_name(path).open(share, payload, fds, lease, _paths.Options(device, timeout, prefault))
        return View._make(share, path, "", opened)
    finally:
        for fd in fds:
            os.close(fd)


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
    return Opening(share, prefer, exclude, timeout, device)


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
