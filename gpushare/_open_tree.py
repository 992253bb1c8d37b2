"""gpushare.open of a bundle's share: the best path for each allocation,
one request and one lease for them all, then the :class:`Bundle`.

The manifest was validated when the share was made (unpickled, read from
bytes); the exporter checks that it is the one it made (its digest) before
it grants anything, so a forged bundle maps nothing.  Where an allocation's
path fails (the exporter cannot serve it, or this process cannot map the
offer), everything opened is closed and the open asks again with that
allocation's next path, within the same deadline.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

from . import _paths
from ._bundle import Bundle, _State
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
from ._paths import same_process, ucx_rma
from ._reach import MESSAGE_CHARS, addresses_for, choose, raise_refusal, slow_reason, unreachable
from ._share import Share, node_key

__all__ = ["open_tree"]

log = logging.getLogger("gpushare.api")


def part_shares(share: Share) -> list[Share]:
    """Each allocation of a bundle as a share of one buffer (for choosing
    and opening its path; never sent anywhere)."""
    f = share._fields_
    return [Share._trusted(f[:6] + (p.nbytes, p.device, (p.nbytes,), "|u1", p.offers, f[11], p.fabric, p.readonly,
                                    0, None, None, None, None))
            for p in share._bundle.parts]


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


def open_tree(share: Share, prefer: Any, exclude: Any, timeout: float, device: int | None,
              prefault: bool) -> Bundle:
    """:func:`gpushare.open` of a bundle's share."""
    manifest = share._bundle
    parts = part_shares(share)
    choices = [choose(p, prefer, exclude) for p in parts]
    for i, (order, left_out, _) in enumerate(choices):
        if not order:
            raise UnsupportedError(f"no path can serve allocation {i} of this bundle here: " + "; ".join(left_out))
    export = registered(share) if share.node == node_key() else None
    if export is not None and all(_paths.by_name(order[0]) is same_process.PATH for order, _, _ in choices):
        with export.lock:
            refusal = export.refusal()
            tree = export.target()
        if refusal is not None:
            raise ClosedError(f"cannot open share: {refusal_text(refusal, export.policy)}")
        if export.digest != manifest.digest:
            raise InvalidInputError("the share's manifest is not the one its exporter made: the share was altered "
                                    "(forged or corrupt)")
        targets: list[Any] = []
        _leaves(tree, targets)
        path = same_process.PATH
        why = f"{path.name}: {path.reason}"
        state = _State(share, manifest, parts, [path.name] * len(parts), [_paths.Opened() for _ in parts],
                       [why] * len(parts), None, targets)
        log.info("opened bundle %s over %s", share.share_id[:8], path.name)
        return Bundle._make(state, manifest.tree)
    orders = [[p for p in order if _paths.by_name(p) is not same_process.PATH] for order, _, _ in choices]
    for i, order in enumerate(orders):
        if not order:
            raise UnsupportedError(f"allocation {i} of this bundle can be opened only in its exporting process")
    picks = [0] * len(parts)
    failures: list[list[str]] = [[] for _ in parts]
    deadline = time.monotonic() + timeout
    if any(_paths.by_name(order[0]) is ucx_rma.PATH for order in orders):
        ucx_rma.warm()
    importer = get_importer()
    addresses = addresses_for(share)
    said = {"device": share.device, "nbytes": share.nbytes, "offset": share.offset, "readonly": share.readonly}

    def next_path(i: int, why: str) -> None:
        failures[i].append(f"{orders[i][picks[i]]} failed: {why[:MESSAGE_CHARS]}")
        log.info("bundle %s allocation %d: %s; trying the next path", share.share_id[:8], i, failures[i][-1])
        picks[i] += 1
        if picks[i] >= len(orders[i]):
            raise GpuShareError(f"every path failed for allocation {i} of the bundle: " + "; ".join(failures[i]))

    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExporterUnreachableError(f"open did not finish within {timeout} s")
            paths = [order[pick] for order, pick in zip(orders, picks, strict=True)]
            request = {"op": "open", "share": share.share_id, "token": share.token, "path": "bundle",
                       "parts": paths, "said": said, "manifest": manifest.digest}
            try:
                reply, lease, fds = importer.open(share, addresses, request, deadline)
            except ExporterUnreachableError as exc:
                raise ExporterUnreachableError(unreachable(share, str(exc))) from None
            if lease is None:
                message = str(reply.get("message", ""))
                part = reply.get("part")  # the allocation a path refusal is about, as data
                if reply.get("code") == "path" and type(part) is int and 0 <= part < len(parts):
                    next_path(part, message)
                    continue
                raise_refusal(reply)
            opened: list[_paths.Opened] = []
            try:
                opened = _open_parts(parts, paths, reply.get("payload"), fds, lease, device, deadline, prefault)
            except _PartFailed as failed:
                lease.failed()
                if isinstance(failed.error, AccessDeniedError):
                    raise failed.error from None
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
                                   f"allocation {i}")) is not None]
    state = _State(share, manifest, parts, paths, opened, whys, lease, None)
    bundle = Bundle._make(state, manifest.tree)
    log.info("opened bundle %s: %d tensors in %d allocations over %s", share.share_id[:8], manifest.count,
             len(parts), ", ".join(sorted(set(paths))))
    if slow:
        try:
            warnings.warn(SlowPathWarning("gpushare: " + "; ".join(slow[:3]) + (
                f"; and {len(slow) - 3} more allocations" if len(slow) > 3 else "")), stacklevel=3)
        except BaseException:
            bundle.close()
            raise
    return bundle


class _PartFailed(Exception):
    def __init__(self, index: int, error: GpuShareError) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


def _open_parts(parts: list[Share], paths: list[str], payload: Any, fds: list[int], lease: Any,
                device: int | None, deadline: float, prefault: bool) -> list[_paths.Opened]:
    """Each allocation's grant opened (``fds``, owned, are closed here)."""
    opened: list[_paths.Opened] = []
    given: list[list[int]] = [fds]  # each list's fds are closed at the end, unless a path took them
    try:
        if (not isinstance(payload, dict) or not isinstance(payload.get("parts"), (list, tuple))
                or not isinstance(payload.get("fds"), (list, tuple)) or len(payload["parts"]) != len(parts)
                or len(payload["fds"]) != len(parts) or any(type(n) is not int or n < 0 for n in payload["fds"])
                or sum(payload["fds"]) != len(fds)):
            raise InvalidInputError("exporter sent a malformed bundle offer")
        at = 0
        given = []
        for count in payload["fds"]:
            given.append(fds[at:at + count])
            at += count
        for i, (part, path, grant, mine) in enumerate(zip(parts, paths, payload["parts"], given, strict=True)):
            if not isinstance(grant, dict):
                raise InvalidInputError(f"exporter sent a malformed offer for allocation {i}")
            how = _paths.Options(device, max(0.001, deadline - time.monotonic()), prefault, part=i)
            try:
                got = _paths.by_name(path).open(part, grant, mine, lease, how)
            except GpuShareError as exc:
                raise _PartFailed(i, exc) from None
            opened.append(got)
            mapped = got.mapping
            if mapped is not None and (mapped.device == "host") != (part.device == "host"):
                raise InvalidInputError(f"allocation {i} of the bundle says {'host' if part.device == 'host' else 'CUDA'}"
                                        " memory, but its exporter serves the other kind: the share was altered "
                                        "(forged or corrupt)")
    except BaseException:
        for got in opened:
            if got.mapping is not None:
                got.mapping.close()
            if got.transport is not None:
                got.transport.close()
        raise
    finally:
        for mine in given:  # a path that keeps fds clears its list
            for fd in mine:
                os.close(fd)
    return opened
