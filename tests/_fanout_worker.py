"""Tasks for the fan-out tests: run in Pool / ProcessPoolExecutor workers
and plain processes of every start method."""

from __future__ import annotations

import hashlib
from typing import Any


def read(share: Any) -> dict:
    """Open ``share`` with the defaults and report what arrived."""
    import numpy as np

    import gpushare as gs

    with gs.open(share) as view:
        out = np.empty(view.shape, dtype=np.dtype(view.typestr))
        view.get(out)
        mapped = None
        if view.path not in ("cma", "ucx-rma"):
            a = np.asarray(view)
            mapped = (str(a.dtype), a.shape, hashlib.sha256(a.tobytes()).hexdigest())
            del a
        return {"path": view.path, "dtype": str(out.dtype), "shape": out.shape,
                "sha": hashlib.sha256(out.tobytes()).hexdigest(), "mapped": mapped}


def from_queue(inbox: Any, outbox: Any) -> None:
    """Take one share from ``inbox``, read it, put the report in ``outbox``."""
    share = inbox.get(timeout=60)
    try:
        outbox.put(read(share))
    except Exception as exc:  # reported to the test, which fails on it
        outbox.put({"error": f"{type(exc).__name__}: {exc}"})
