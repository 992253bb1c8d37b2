"""Before an open: which paths this process can take for a share (and
why not the others), which of the exporter's addresses to try, and what
the exporter's refusal or silence means."""

from __future__ import annotations

import os
from typing import Any, NoReturn

from . import _paths
from ._cuda import _driver
from ._errors import AccessDeniedError, ClosedError, InvalidInputError
from ._exporter.registry import registered
from ._paths.base import Here, exporter_exited
from ._process import node_key
from ._share import Share

__all__ = ["here_for", "choose", "raise_refusal", "unreachable", "addresses_for", "slow_reason", "MESSAGE_CHARS"]


def here_for(share: Share) -> Here:
    """What this process is, as far as the paths ``share`` offers care."""
    node = node_key()
    near = share.node == node
    cuda_reason = _driver.unavailable_reason() if _paths.needs_cuda(share, near) else None
    pid = os.getpid()
    exported = share.exporter_pid == pid and near and registered(share) is not None
    return Here(node, pid, exported, cuda_reason, _paths.facts(share, near))


def choose(share: Share, prefer: Any, exclude: Any) -> tuple[list[str], list[str], list[str]]:
    """(ordered candidates, reasons for the paths left out, the natural best
    order) for ``share`` in this process, with the caller's and the
    environment's preferences."""
    env_prefer = os.environ.get("GPUSHARE_PATHS")
    env_exclude = os.environ.get("GPUSHARE_EXCLUDE_PATHS")
    here = here_for(share)
    # The paths' verdicts read only these (and the reasons name the exporter's pid).
    key = (share.offers, share.device, share.strides is None, share.node, share.readonly, share.fabric,
           share.exporter_pid, here, _as_key(prefer), _as_key(exclude), env_prefer, env_exclude)
    keep = _UNKEYED not in (key[8], key[9])
    try:
        known = _chosen.get(key)
    except TypeError:  # something unhashable in the share: nothing is remembered
        known, keep = None, False
    if known is not None:
        order, left_out, natural = known
        return list(order), list(left_out), list(natural)
    prefer_l = _paths.path_list(prefer, "prefer") if prefer is not None else (
        _paths.path_list(env_prefer, "GPUSHARE_PATHS") if env_prefer else [])
    exclude_l = _paths.path_list(exclude, "exclude") if exclude is not None else []
    if env_exclude:
        exclude_l += _paths.path_list(env_exclude, "GPUSHARE_EXCLUDE_PATHS")
    chosen = _paths.candidates(share, here, prefer_l, exclude_l)
    if keep:
        if len(_chosen) >= _CHOSEN_MAX:
            _chosen.clear()
        _chosen[key] = tuple(tuple(part) for part in chosen)
    return chosen


#: What :func:`choose` found for a kind of share in this process (the
#: shares of one exporter choose alike: a look-up after the first).
_chosen: dict[tuple, tuple[tuple[str, ...], ...]] = {}
_CHOSEN_MAX = 256
_UNKEYED = object()


def _as_key(paths: Any) -> Any:
    """``prefer=``/``exclude=`` as part of a key, where it can be one
    without consuming it (None, a str, a list or tuple of str)."""
    if paths is None or isinstance(paths, str):
        return paths
    if type(paths) in (list, tuple) and all(type(p) is str for p in paths):
        return (type(paths), tuple(paths))
    return _UNKEYED


def slow_reason(share: Share, path: str, failures: list[str], left_out: list[str], natural: list[str],
                prefer: Any, exclude: Any, subject: str) -> str | None:
    """Why opening ``share`` (``subject``: "gpushare", "allocation 3") over
    ``path`` deserves a :class:`SlowPathWarning`, or None: it fell back from
    a faster path that failed (``failures``), or it reaches a same-node
    exporter over a network transport (ucx-rma) without being asked to."""
    if failures and natural and path in natural and natural.index(path) > 0:
        return f"{subject} fell back to {path}: {'; '.join(failures)}"
    if (_paths.slow_alone(path) and share.node == node_key() and prefer is None and exclude is None
            and not (os.environ.get("GPUSHARE_PATHS") or os.environ.get("GPUSHARE_EXCLUDE_PATHS"))):
        return (f"{subject} goes over {path}, a network transport, to a same-node peer: "
                + "; ".join(left_out or ["no same-node path is offered for this memory"]))
    return None


#: How much of an exporter's message a refusal or a path's failure keeps
#: (an exporter is untrusted: what it says is bounded).
MESSAGE_CHARS = 300


def raise_refusal(reply: dict) -> NoReturn:
    code, message = reply.get("code"), str(reply.get("message", ""))[:MESSAGE_CHARS]
    if code == "denied":
        raise AccessDeniedError(f"exporter refused: {message}")
    if code in ("revoked", "retired", "exhausted", "unknown"):
        raise ClosedError(f"cannot open share: {message}")
    if code == "altered":
        raise InvalidInputError(message)
    raise InvalidInputError(f"exporter answered: {message}")


def unreachable(share: Share, detail: str) -> str:
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


def addresses_for(share: Share) -> tuple[tuple[str, int], ...]:
    """The exporter's control addresses in the order to try them from here."""
    control, near = share.control, share.node == node_key()
    key = (control, near)
    known = _ordered.get(key)
    if known is None:
        if near:
            known = tuple(a for a in control if a[0] == "127.0.0.1") + tuple(
                a for a in control if a[0] != "127.0.0.1")
        else:
            known = tuple(a for a in control if not a[0].startswith("127.")) or control
        if len(_ordered) >= _CHOSEN_MAX:
            _ordered.clear()
        _ordered[key] = known
    return known


#: What :func:`addresses_for` found, by the share's addresses and whether its exporter is on this node.
_ordered: dict[tuple, tuple[tuple[str, int], ...]] = {}
