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
from typing import Any

from . import _paths, _types
from ._cuda import _driver
from ._cuda.fabric import cliques as fabric_cliques
from ._errors import (
    AccessDeniedError,
    ClosedError,
    ExporterUnreachableError,
    GpuShareError,
    InvalidInputError,
    SlowPathWarning,
    UnsupportedError,
)
from ._export import PathList
from ._exporter import refusal_text, registered
from ._importer import get_importer
from ._paths import cma, same_process, ucx_rma
from ._paths.base import exporter_exited
from ._share import Share, altered, node_key
from ._view import View

__all__ = ["open", "open_async", "choose", "here_for"]

log = logging.getLogger("gpushare.api")


def here_for(share: Share) -> _paths.Here:
    """What this process is, as far as the paths ``share`` offers care."""
    node = node_key()
    near = share.node == node
    fabric = _paths.fabric.PATH.name in share.offers
    cuda_reason = None
    if share.device != "host" and (near or fabric):
        cuda_reason = _driver.unavailable_reason()
    cliques: tuple[str, ...] = ()
    fabric_reason = None
    if fabric and share.fabric is not None:
        found, fabric_reason = fabric_cliques()
        cliques = tuple(found.values())
    cma_reason = cma.available() if near and cma.PATH.name in share.offers else None
    here = os.getpid()
    exported = share.exporter_pid == here and near and registered(share) is not None
    return _paths.Here(node, here, exported, cuda_reason, cliques, fabric_reason, cma_reason)


def choose(share: Share, prefer: Any, exclude: Any) -> tuple[list[str], list[str], list[str]]:
    """(ordered candidates, reasons for the paths left out, the natural best
    order) for ``share`` in this process, with the caller's and the
    environment's preferences."""
    env_prefer = os.environ.get("GPUSHARE_PATHS")
    env_exclude = os.environ.get("GPUSHARE_EXCLUDE_PATHS")
    prefer_l = _paths.path_list(prefer, "prefer") if prefer is not None else (
        _paths.path_list(env_prefer, "GPUSHARE_PATHS") if env_prefer else [])
    exclude_l = _paths.path_list(exclude, "exclude") if exclude is not None else []
    if env_exclude:
        exclude_l += _paths.path_list(env_exclude, "GPUSHARE_EXCLUDE_PATHS")
    return _paths.candidates(share, here_for(share), prefer_l, exclude_l)


def _raise_refusal(reply: dict) -> None:
    code, message = reply.get("code"), str(reply.get("message", ""))[:300]
    if code == "denied":
        raise AccessDeniedError(f"exporter refused: {message}")
    if code in ("revoked", "retired", "exhausted", "unknown"):
        raise ClosedError(f"cannot open share: {message}")
    if code == "altered":
        raise InvalidInputError(message)
    raise InvalidInputError(f"exporter answered: {message}")


def open(share: Share, *, prefer: PathList | None = None, exclude: PathList | None = None,  # noqa: A001
         timeout: float = 10.0, device: _types.Device | None = None, prefault: bool = False) -> View:
    """Open a share from any process that can reach the exporter.

    The best path for this pair is tried first, then the next ones if a
    probe fails (within ``timeout`` in all); a fallback to a slower path than
    the pair could use emits :class:`SlowPathWarning` and ``view.why`` says
    what failed.

    Parameters
    ----------
    share : Share
        From :func:`export`, probably unpickled: it is validated.
    prefer, exclude : list of str or comma-separated str, optional
        Paths to try first / never.  The environment variables
        ``GPUSHARE_PATHS`` (prefer) and ``GPUSHARE_EXCLUDE_PATHS`` do the same
        for a whole job; ``prefer=`` replaces ``GPUSHARE_PATHS``,
        ``exclude=`` adds to ``GPUSHARE_EXCLUDE_PATHS``.
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
        if why_altered:
            raise InvalidInputError(why_altered)
        why = f"{first.name}: {first.reason}"
        log.info("opened share %s over %s", share.share_id[:8], why)
        return View._make(share, first.name, why, first.open(share, {"target": target}, [], None, _paths.Options()))
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
    addresses = _addresses_for(share)
    try:
        # what the share says of the memory: the exporter refuses an open of a share that was altered
        said = {"device": share.device, "nbytes": share.nbytes, "offset": share.offset, "readonly": share.readonly}
        for path in order:
            request = {"op": "open", "share": share.share_id, "token": share.token, "path": path, "said": said}
            try:
                reply, lease, fds = importer.open(share, addresses, request, deadline)
            except ExporterUnreachableError as exc:
                raise ExporterUnreachableError(_unreachable(share, str(exc))) from None
            if lease is None:
                if reply.get("code") == "path":
                    failures.append(f"{path} failed: {str(reply.get('message'))[:200]}")
                    log.info("share %s: %s; trying the next path", share.share_id[:8], failures[-1])
                    continue
                _raise_refusal(reply)
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
            slow = None
            if failures and natural and natural.index(path) > 0:
                slow = f"gpushare fell back to {path}: {'; '.join(failures)}"
            elif _paths.by_name(path) is ucx_rma.PATH and share.node == node_key() and prefer is None and (
                    exclude is None) and not (os.environ.get("GPUSHARE_PATHS")
                                              or os.environ.get("GPUSHARE_EXCLUDE_PATHS")):
                slow = ("gpushare serves this same-node peer over ucx-rma, a network transport: "
                        + "; ".join(left_out or ["no same-node path is offered for this memory"]))
            if slow is not None:
                try:
                    warnings.warn(SlowPathWarning(slow), stacklevel=2)
                except BaseException:
                    view.close()  # the warning was turned into an error: leave nothing open
                    raise
            return view
    except GpuShareError:
        raise
    except (EOFError, OSError, TimeoutError) as exc:
        raise ExporterUnreachableError(_unreachable(share, f"it stopped answering: {exc}")) from None
    raise GpuShareError("every path failed: " + "; ".join(failures))


def _unreachable(share: Share, detail: str) -> str:
    """The message of an :class:`ExporterUnreachableError` for ``share``: what
    happened to the exporter, and what to do."""
    pid = share.exporter_pid
    exited = exporter_exited(share)
    if exited:
        return (f"the exporter (pid {pid}) has exited, and its shares went with it: export the buffer again "
                f"from a running process and open the new share ({detail})")
    if exited is None:
        return (f"cannot reach the exporter (pid {pid} on another node): {detail}; check that it is still "
                "running and that this node can reach its control addresses "
                f"{', '.join(f'{h}:{p}' for h, p in share.control)} (see GPUSHARE_CONTROL_HOST)")
    return (f"the exporter (pid {pid}) is running on this node but did not answer: {detail}; it may be "
            "stuck, or its control channel bound to an address this process cannot reach (GPUSHARE_CONTROL_HOST)")


def _addresses_for(share: Share) -> tuple[tuple[str, int], ...]:
    if share.node == node_key():
        return tuple(a for a in share.control if a[0] == "127.0.0.1") + tuple(
            a for a in share.control if a[0] != "127.0.0.1")
    return tuple(a for a in share.control if not a[0].startswith("127.")) or share.control


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
