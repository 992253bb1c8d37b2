"""The other process of tests/test_fuzz_bundle.py: opens the bundle shares it
is sent (forged or genuine) and reports what each open left behind in it:
memfd mappings, and leases its importer holds."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from _bundle_peer import memfd_mappings


def setup() -> dict:
    return {"_handlers": HANDLERS, "_reply": {"pid": os.getpid()}}


def _leases() -> int:
    from gpushare._importer import get_importer

    return get_importer().stats()["leases"]


def _attempt(state: dict, share: Any, kwargs: dict | None = None) -> dict:
    """Open ``share`` (expected to be refused); what happened and what it left."""
    import gpushare as gs

    before = {"maps": memfd_mappings(), "leases": _leases()}
    try:
        bundle = gs.open(share, timeout=10, **(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - the test checks its type and message
        outcome = {"opened": False, "type": type(exc).__name__, "message": str(exc)}
    else:
        with bundle:
            got = bundle.get()
            outcome = {"opened": True, "paths": bundle.paths,
                       "values": {k: np.asarray(v).tolist() for k, v in got.items()}}
    return dict(outcome, before=before, after={"maps": memfd_mappings(), "leases": _leases()})


def _open_all(state: dict, share: Any) -> dict:
    """Open ``share``, read every top-level tensor, close: what it cost."""
    import gpushare as gs

    before = memfd_mappings()
    with gs.open(share, timeout=10) as bundle:
        got = {k: np.asarray(v).tolist() for k, v in bundle.get().items()}
        held = {"maps": memfd_mappings() - before, "leases": _leases(), "paths": bundle.paths}
    return dict(held, values=got, leases_after=_leases())


HANDLERS = {"attempt": _attempt, "open_all": _open_all}
