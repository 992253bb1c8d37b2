"""A share's export record and its lifetime policy: when an open is
allowed, when the last close or the object's going ends the share, and the
words a refusal uses to say so."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import InvalidInputError
from .._paths.broker import release_registrations
from .._service import get_service

__all__ = ["Export", "refusal_text", "track_auto", "weak_or_none"]

log = logging.getLogger("gpushare.export")


@dataclass
class Export:
    """One exported buffer, as the exporter tracks it."""

    share_id: str
    token: bytes
    nbytes: int
    device: Any
    memory_type: str
    offers: tuple[str, ...]
    descriptors: dict[str, Any]
    policy: Any  # "auto" | "closed" | "revoked" | "none" | int
    obj: Any = None
    obj_ref: Any = None
    opens: int = 0
    total: int = 0
    revoked: bool = False
    retired: bool = False
    readonly: bool = False
    #: Where the share's bytes start in the memory the paths serve (as the Share says).
    offset: int = 0
    registrations: list = field(default_factory=list)
    #: Lifetime "auto": a weak reference to the Share that export() returned,
    #: and whether it (or a copy) left the process, pickled or as bytes.
    share_ref: Any = None
    sent: bool = False
    #: What a path keeps for the share while it serves it, by path name
    #: (ucx-rma: the share's region in this process's region server, made on
    #: the first ucx-rma open; every lease over it holds a key of its own).
    state: dict[str, Any] = field(default_factory=dict)
    #: Each path's grant payload, made on its first open (:func:`gpushare._paths.base.descriptor_payload`).
    payloads: dict[str, Any] = field(default_factory=dict)
    #: A bundle's allocations, each an export of its own that only the
    #: bundle's leases reach (None: a share of one buffer); and the digest
    #: of its manifest, which an open must name.
    parts: list[Export] | None = None
    digest: bytes | None = None
    #: (slot, epoch) on the exporter's state page, while importers may keep
    #: closed views of it for a reopen (:mod:`gpushare._reopen`).
    slot: tuple[int, int] | None = None
    #: Set by the exporter's registry: called once when the share's lifetime ends.
    on_end: Callable[[Export, str], None] | None = None
    # Re-entrant: releasing the last reference to the object (closing the
    # share's agent) can run the weak-reference callback in the same thread.
    lock: threading.RLock = field(default_factory=threading.RLock)

    def target(self) -> Any:
        if self.obj is not None:
            return self.obj
        return self.obj_ref() if self.obj_ref is not None else None

    # -- policy ---------------------------------------------------------
    def refusal(self) -> str | None:
        """Why a new open is refused now, or None (call with the lock held)."""
        if self.revoked:
            return "revoked"
        if self.retired or self.target() is None:
            return "retired"
        if isinstance(self.policy, int) and self.total >= self.policy:
            return "exhausted"
        return None

    def after_close(self) -> None:
        """Apply the lifetime policy after an import closed (lock held)."""
        if self.opens > 0:
            return
        if self.policy == "auto":
            self.close_remote()
            self.settle()
        elif self.policy == "closed" and self.total >= 1:
            self.retire()
        elif isinstance(self.policy, int) and self.total >= self.policy:
            self.retire()
        elif self.policy == "none" or self.opens == 0:
            # No remote view is open: the region goes (its registration would
            # keep the object alive); a later ucx-rma open adds it again.
            self.close_remote()

    def needed(self) -> bool:
        """Lifetime "auto": whether the exporting process may still hand the
        share out: it holds the Share export() returned, or a share that left
        the process awaits its first import (lock held)."""
        return (self.share_ref is not None and self.share_ref() is not None) or (self.sent and self.total == 0)

    def settle(self) -> None:
        """Lifetime "auto" with no import open: keep ``obj`` while the share is
        :meth:`needed`; else hold it only weakly, openable while the exporting
        process still uses the object, and end once it is gone (lock held)."""
        if self.policy != "auto" or self.retired or self.revoked or self.opens > 0 or self.needed():
            return
        self.obj = None
        if self.obj_ref is None or self.obj_ref() is None:
            self.retire()

    def hold(self) -> None:
        """An open of an "auto" share: the object is held strongly again while
        the lease lasts (lock held; :meth:`refusal` said the object lives)."""
        if self.obj is None:
            self.obj = self.target()

    def close_remote(self) -> None:
        held: list[Any] = []
        self._take_states(held)
        kinds: dict[type, list[Any]] = {}
        for state in held:
            kinds.setdefault(type(state), []).append(state)
        for kind, states in kinds.items():
            # a region: every key of it is revoked, remote access stops at once;
            # a kind that closes many at once (a bundle's regions) does so
            close_all = getattr(kind, "close_all", None)
            if close_all is not None:
                close_all(states)
            else:
                for state in states:
                    state.close()

    def _take_states(self, out: list[Any]) -> None:
        """What the paths hold for this share and its parts, taken (lock held)."""
        states, self.state = self.state, {}
        out.extend(states.values())
        for part in self.parts or ():
            part._take_states(out)

    def end(self, reason: str) -> None:
        """The share's lifetime ended: leave the registry (lock held)."""
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end(self, reason)

    def close_mapped(self) -> None:
        """Stop handing out this share's fds: a descriptor given out before is dead."""
        regs, self.registrations = self.registrations, []
        if regs:
            release_registrations(regs)
        for part in self.parts or ():
            part.close_mapped()

    def retire(self) -> None:
        if not self.retired:
            log.info("share %s retired: its lifetime (%s) ended", self.share_id[:8], self.policy)
        self.retired = True
        self.close_remote()
        self.close_mapped()
        self.obj = None
        self.end("retired")


_REFUSALS = {
    "unknown": "the exporter has no such share (closed, or never exported here)",
    "denied": "wrong token for this share",
    "bad": "malformed open request",
    "revoked": "the share was revoked by its exporter",
    "retired": "the share is no longer available: its lifetime ended",
    "exhausted": "the share was opened as many times as its lifetime allows",
    "closed": "the lease ended (the view was closed)",
}

#: What would have fitted, by policy, for a share whose lifetime ended.
_FITS = {
    "auto": ("no import was open and the exporting process held neither the Share nor the object any more; "
             "keep a reference to one of them there until every importer has opened it (or export with "
             "lifetime=N or 'revoked' and call share.revoke())"),
    "closed": ("lifetime 'closed' ends as soon as every importer so far has closed it; for a share that "
               "several processes open one after another (Pool workers, Queue readers) use the default "
               "lifetime='auto', lifetime=N or 'revoked'"),
    "none": ("lifetime 'none' held the object weakly and it was garbage collected in the exporter; "
             "lifetime='auto' (the default) keeps it while the exporter holds the Share"),
}


def refusal_text(code: str, policy: Any) -> str:
    """Why an open is refused, and for a share whose lifetime ended, which
    lifetime would have fitted."""
    text = _REFUSALS[code]
    if code == "retired" and policy in _FITS:
        return f"{text}: {_FITS[policy]}"
    if code in ("retired", "exhausted") and isinstance(policy, int):
        return (f"{text}: lifetime={policy} allows {policy} import{'s' if policy > 1 else ''} and "
                f"{'they were' if code == 'exhausted' else 'all were made and closed'}; to hand it to more "
                "processes, export it with a larger N, or with lifetime='auto' (the default) or 'revoked'")
    return text


def track_auto(obj: Any, share: Any, export: Export) -> None:
    """Lifetime "auto": watch the Share export() returned and the object, and
    settle the export (:meth:`Export.settle`) in the service thread when
    either goes or the share leaves the process."""
    service = get_service()

    def settle() -> None:
        with export.lock:
            export.settle()

    def gone(_: Any) -> None:
        # Weak-reference callbacks run wherever the last reference went,
        # possibly under locks of their own: settle in the service thread.
        service.call_soon(settle)

    def sent() -> None:
        export.sent = True

    try:
        export.obj_ref = weakref.ref(obj, gone)
    except TypeError:
        export.obj_ref = None  # bytes, bytearray: kept only while the share is needed
    export.share_ref = weakref.ref(share, gone)
    share._on_send(sent)


def weak_or_none(obj: Any, export: Export) -> Any:
    """A weak reference to ``obj`` that retires ``export`` when ``obj`` goes."""
    service = get_service()

    def retire() -> None:
        with export.lock:
            export.retire()

    def gone(_: Any) -> None:
        # Weak-reference callbacks run wherever the last reference went,
        # possibly under locks of their own: retire in the service thread.
        export.retired = True
        service.call_soon(retire)

    try:
        return weakref.ref(obj, gone)
    except TypeError:
        raise InvalidInputError(
            f"lifetime='none' keeps no reference, so it needs an object that supports weak "
            f"references; {type(obj).__name__} does not (wrap it, or use another lifetime)"
        ) from None
