"""The open pipeline of every share: a share of one buffer is a bundle of
one allocation.

For each allocation, the paths this process can take, best first
(:func:`gpushare._open_plan.choose`).  Then one request to the exporter naming
a path per allocation, and one lease for them all.  A path the exporter
refuses, or that this process cannot map, names its allocation as data (the
refusal's ``part``, or :class:`_PartFailed`): everything opened is closed
and that allocation alone goes on with its next path, within one deadline.
One same-process shortcut, one reopen of a kept lease (a share of one
buffer), and one slow-path rule serve every share.

A bundle's manifest was validated when its share was made (unpickled, read
from bytes); the exporter checks that it is the one it made (its digest)
before it grants anything, so a forged bundle maps nothing.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from . import _paths
from ._errors import (
    AccessDeniedError,
    ClosedError,
    ExporterUnreachableError,
    GpuShareError,
    InvalidInputError,
    UnsupportedError,
)
from ._exporter.lifetimes import refusal_text
from ._exporter.registry import registered
from ._importer import get_importer
from ._open_plan import MESSAGE_CHARS, addresses_for, choose, raise_refusal, slow_reason, unreachable
from ._paths.base import Opened, Options, Path
from ._share import Share, altered
from ._types import collection_paused

__all__ = ["OpenedShare", "open_share", "part_shares"]

log = logging.getLogger("gpushare.api")


def part_shares(share: Share) -> list[Share]:
    """The share's allocations, each as a share of one buffer (for choosing
    and opening its path; never sent anywhere): a share of one buffer is its
    own only allocation."""
    if not share.is_bundle:
        return [share]
    return [share._replace(nbytes=p.nbytes, device=p.device, shape=(p.nbytes,), typestr="|u1", offers=p.offers,
                           fabric=p.fabric, readonly=p.readonly, offset=0, dtype_name=None, dlpack_dtype=None,
                           strides=None, manifest=None)
            for p in share._bundle.parts]


@dataclass
class OpenedShare:
    """What an open made: per allocation, its path, what the path opened and
    ``why``; the one lease; the slow-path warning owed (or None); and, where
    the exporter is this process, its own objects (``targets``), or a closed
    view's kept lease and use (``kept``, a share of one buffer)."""

    paths: list[str]
    opened: list[Opened]
    whys: list[str]
    lease: Any = None
    slow: str | None = None
    targets: list[Any] | None = None
    kept: tuple | None = None
    #: The reopen key this lease may be kept under once its view closes.
    keep_key: tuple | None = None
    #: The share's allocations, each as a share of one buffer (:func:`part_shares`).
    parts: list[Share] = field(default_factory=list)


def _leaves(tree: Any, out: list[Any]) -> None:
    """The exporter's own tensors, in the order its export listed them."""
    if isinstance(tree, dict):
        for value in tree.values():
            _leaves(value, out)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _leaves(value, out)
    else:
        out.append(tree)


def _choices(parts: list[Share], prefer: Any, exclude: Any) -> list[tuple[list[str], list[str], list[str]]]:
    """Each allocation's candidates: allocations alike in what the paths read
    (offers, device, read-only, fabric) are alike here, chosen for once."""
    if len(parts) == 1:
        return [choose(parts[0], prefer, exclude)]
    seen: dict[tuple, tuple[list[str], list[str], list[str]]] = {}
    out = []
    for p in parts:
        sig = (p.offers, p.device, p.readonly, p.fabric)
        found = seen.get(sig)
        if found is None:
            found = seen[sig] = choose(p, prefer, exclude)
        out.append(found)
    return out


def _open_own_export(share: Share, parts: list[Share], subject: str, path: Path) -> OpenedShare:
    """The exporter is this process, and ``path`` (an in-process one) takes
    it: its own objects, no lease."""
    export = registered(share)
    if export is None:  # it ended since the paths were chosen
        raise ClosedError("cannot open share: its lifetime ended or it was revoked")
    with export.lock:
        refusal = export.refusal()
        target = export.target()
    if refusal is not None:
        raise ClosedError(f"cannot open share: {refusal_text(refusal, export.policy)}")
    if share.is_bundle:
        why_altered = None if export.digest == share._bundle.digest else (
            "the share's manifest is not the one its exporter made: the share was altered (forged or corrupt)")
    else:
        why_altered = altered(share.device, share.nbytes, share.offset, share.readonly, export.device,
                              export.nbytes, export.offset, export.readonly)
        if export.parts is not None:  # a bundle's share with its manifest taken out
            why_altered = ("the share names a bundle of tensors but carries no manifest: the share was altered "
                           "(forged or corrupt)")
    if why_altered:
        raise InvalidInputError(why_altered)
    targets: list[Any] = []
    if share.is_bundle:
        _leaves(target, targets)
    else:
        targets.append(target)
    count = len(parts)
    log.info("opened %s %s over %s", subject, share.share_id[:8], path.name)
    return OpenedShare([path.name] * count, [Opened() for _ in range(count)],
                       [f"{path.name}: {path.reason}"] * count, targets=targets, parts=parts)


def open_share(share: Share, prefer: Any, exclude: Any, timeout: float, device: int | None,
               prefault: bool) -> OpenedShare:
    """Open every allocation of ``share`` on its best path that works."""
    bundle = share.is_bundle
    subject = "bundle" if bundle else "share"
    parts = part_shares(share)
    choices = _choices(parts, prefer, exclude)
    for i, (order, left_out, _) in enumerate(choices):
        if not order:
            raise UnsupportedError(("no path can serve this share here: " if not bundle else
                                    f"no path can serve allocation {i} of this bundle here: ") + "; ".join(left_out))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("opening %s %s: candidates %s", subject, share.share_id[:8],
                  "; ".join(",".join(order) for order, _, _ in choices[:4]))
    if all(_paths.by_name(order[0]).in_process for order, _, _ in choices):
        return _open_own_export(share, parts, subject, _paths.by_name(choices[0][0][0]))
    orders = [[p for p in order if not _paths.by_name(p).in_process] for order, _, _ in choices]
    for i, order in enumerate(orders):
        if not order:
            raise UnsupportedError(f"allocation {i} of this bundle can be opened only in its exporting process")
    importer = get_importer()
    first = _paths.by_name(orders[0][0])
    key = None
    if not bundle and first.reopens:
        key = (share.share_id, share.token, share.device, share.nbytes, share.offset, share.readonly, first.name,
               prefault)
        kept = importer.reopen(share, key)
        if kept is not None:
            return OpenedShare([first.name], [], [_paths.explain(first.name, choices[0][1], [])], kept=kept,
                               slow=slow_reason(share, first.name, [], choices[0][1], choices[0][2], prefer,
                                                exclude, "gpushare"), parts=parts)
    picks = [0] * len(parts)
    failures: list[list[str]] = [[] for _ in parts]
    deadline = time.monotonic() + timeout
    _paths.warm([order[0] for order in orders])  # (load UCX) while the exporter prepares its offer
    addresses = addresses_for(share)

    def next_path(i: int, why: str) -> None:
        failures[i].append(f"{orders[i][picks[i]]} failed: {why[:MESSAGE_CHARS]}")
        log.info("%s %s%s: %s; trying the next path", subject, share.share_id[:8],
                 f" allocation {i}" if bundle else "", failures[i][-1])
        picks[i] += 1
        if picks[i] >= len(orders[i]):
            raise GpuShareError(("every path failed: " if not bundle else
                                 f"every path failed for allocation {i} of the bundle: ") + "; ".join(failures[i]))

    try:
        while True:
            if deadline - time.monotonic() <= 0:
                failed = "; ".join(f for fs in failures for f in fs)
                raise ExporterUnreachableError(f"open did not finish within {timeout} s" + (
                    f" ({failed})" if failed else ""))
            paths = [order[pick] for order, pick in zip(orders, picks, strict=True)]
            try:
                reply, lease, fds = importer.open(share, addresses, _request(share, paths), deadline)
            except ExporterUnreachableError as exc:
                raise ExporterUnreachableError(unreachable(share, str(exc))) from None
            if lease is None:
                part = reply.get("part", None if bundle else 0)  # the allocation a path refusal is about, as data
                if reply.get("code") == "path" and type(part) is int and 0 <= part < len(parts):
                    next_path(part, str(reply.get("message", "")))
                    continue
                raise_refusal(reply)
            try:
                opened = _open_parts(parts, paths, reply.get("payload"), fds, lease, device, deadline, prefault,
                                     bundle)
            except _PartFailed as failed:
                lease.failed()
                if isinstance(failed.error, AccessDeniedError):
                    raise failed.error from None  # a refusal is final: no other path may grant it
                next_path(failed.index, str(failed.error))
                continue
            except BaseException:
                lease.failed()
                raise
            break
    except GpuShareError:
        raise
    except (EOFError, OSError, TimeoutError) as exc:
        raise ExporterUnreachableError(unreachable(share, f"it stopped answering: {exc}")) from None
    whys = [_paths.explain(paths[i], left_out, failures[i]) for i, (_, left_out, _) in enumerate(choices)]
    slow = [why for i, (_, left_out, natural) in enumerate(choices)
            if (why := slow_reason(share, paths[i], failures[i], left_out, natural, prefer, exclude,
                                   f"allocation {i}" if bundle else "gpushare")) is not None]
    warning = None
    if slow:
        warning = slow[0] if not bundle else "gpushare: " + "; ".join(slow[:3]) + (
            f"; and {len(slow) - 3} more allocations" if len(slow) > 3 else "")
    return OpenedShare(paths, opened, whys, lease, warning, keep_key=key if paths[0] == first.name else None,
                       parts=parts)


def _request(share: Share, paths: list[str]) -> dict:
    """An open request: one path for a share of one buffer; a path per
    allocation and the manifest's digest for a bundle."""
    request = {"op": "open", "share": share.share_id, "token": share.token,
               # what the share says of the memory: the exporter refuses an open of a share that was altered
               "said": {"device": share.device, "nbytes": share.nbytes, "offset": share.offset,
                        "readonly": share.readonly}}
    if share.is_bundle:
        request.update(path="bundle", parts=paths, manifest=share._bundle.digest)
    else:
        request["path"] = paths[0]
    return request


class _PartFailed(Exception):
    """Allocation ``index``'s path failed here (the next path may serve it)."""

    def __init__(self, index: int, error: GpuShareError) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


def _open_parts(parts: list[Share], paths: list[str], payload: Any, fds: list[int], lease: Any,
                device: int | None, deadline: float, prefault: bool, bundle: bool = True) -> list[Opened]:
    """Each allocation's grant opened (``fds``, owned, are closed here
    unless a path keeps them).  ``payload``: the exporter's grant, for a
    bundle one per allocation and the count of fds that are each one's."""
    with collection_paused(len(parts)):
        return _open_each(parts, paths, payload, fds, lease, device, deadline, prefault, bundle)


def _open_each(parts: list[Share], paths: list[str], payload: Any, fds: list[int], lease: Any,
               device: int | None, deadline: float, prefault: bool, bundle: bool) -> list[Opened]:
    opened: list[Opened] = []
    fds_of_part: list[list[int]] = [fds]  # each list's fds are closed at the end, unless a path took them
    one = not bundle
    try:
        if one:
            payloads, counts = [payload], [len(fds)]
        elif (not isinstance(payload, dict) or not isinstance(payload.get("parts"), (list, tuple))
                or not isinstance(payload.get("fds"), (list, tuple)) or len(payload["parts"]) != len(parts)
                or len(payload["fds"]) != len(parts) or any(type(n) is not int or n < 0 for n in payload["fds"])
                or sum(payload["fds"]) != len(fds)):
            raise InvalidInputError("exporter sent a malformed bundle offer")
        else:
            payloads, counts = payload["parts"], payload["fds"]
        at = 0
        fds_of_part = []
        for count in counts:
            fds_of_part.append(fds[at:at + count])
            at += count
        for i, (part, path, grant, part_fds) in enumerate(zip(parts, paths, payloads, fds_of_part, strict=True)):
            how = Options(device, max(0.001, deadline - time.monotonic()), prefault, part=None if one else i)
            try:
                if not isinstance(grant, dict):
                    raise InvalidInputError("exporter sent a malformed offer" + ("" if one else f" for allocation {i}"))
                got = _paths.by_name(path).open(part, grant, part_fds, lease, how)
            except GpuShareError as exc:
                raise _PartFailed(i, exc) from None
            opened.append(got)
            # the mapping shows whether the memory is host or CUDA memory, whatever an exporter answered
            mapped = got.mapping
            real = None if mapped is None else "host" if mapped.device == "host" else part.device
            why = None if real is None else altered(part.device, 0, 0, False, real, 0, 0, False)
            if why:  # the share is corrupt: no other path is tried with it
                raise InvalidInputError(why if one else f"allocation {i} of the bundle: {why}")
    except BaseException:
        for got in opened:
            if got.mapping is not None:
                got.mapping.close()
            if got.transport is not None:
                got.transport.close()
        raise
    finally:
        for part_fds in fds_of_part:  # a path that keeps fds clears its list
            for fd in part_fds:
                os.close(fd)
    return opened
