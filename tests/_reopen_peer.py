"""The importing process of tests/test_reopen.py."""

from __future__ import annotations

import gc
import os
import pickle
from typing import Any

import numpy as np

import gpushare as gs
from gpushare._importer import get_importer


def memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:gpushare" in line for line in f)


def setup() -> dict:
    return {"_handlers": HANDLERS, "_reply": os.getpid(), "views": {}, "arrays": []}


def open_close(state: dict, blob: bytes, times: int) -> dict:
    """Open and close the share ``times`` times; what each open saw."""
    share = pickle.loads(blob)
    firsts, ids = [], []
    for _ in range(times):
        with gs.open(share) as view:
            if view.path == "host-fd":
                a = np.asarray(view).reshape(-1).view(np.uint8)
            else:  # a path that copies
                a = np.empty(view.nbytes, np.uint8)
                view.get(a)
            firsts.append(int(a[0]))
            ids.append(view._lease[0].id)
            why, path = view.why, view.path
    return {"firsts": firsts, "leases": ids, "why": why, "path": path, "kept": get_importer().kept()}


def open_keep_array(state: dict, blob: bytes) -> int:
    """Open, keep an array over the view, close the view; the array's first byte."""
    view = gs.open(pickle.loads(blob))
    state["arrays"].append(np.asarray(view))
    view.close()
    return int(state["arrays"][-1].reshape(-1).view(np.uint8)[0])


def first_byte_of_kept_array(state: dict) -> int:
    return int(state["arrays"][-1].reshape(-1).view(np.uint8)[0])


def write_through(state: dict, blob: bytes, value: int) -> None:
    with gs.open(pickle.loads(blob)) as view:
        np.asarray(view).reshape(-1).view(np.uint8)[0] = value


def try_open(state: dict, blob: bytes) -> str:
    """Open once: "ok", or the error's type and message."""
    try:
        gs.open(pickle.loads(blob)).close()
    except gs.GpuShareError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def status(state: dict) -> dict:
    gc.collect()
    return {"kept": get_importer().kept(), "leases": get_importer().stats()["leases"], "maps": memfd_maps()}


def open_many(state: dict, blobs: list[bytes]) -> dict:
    for blob in blobs:
        gs.open(pickle.loads(blob)).close()
    return status(state)


def export_revoked(state: dict, fill: int) -> bytes:
    state["buf"] = buf = gs.empty(4096, "uint8")
    np.asarray(buf)[:] = fill
    return pickle.dumps(gs.export(buf, lifetime="revoked"))


def fork_open(state: dict, blob: bytes) -> dict:
    """Keep a view here, fork, and open the share in the child: it asks the
    exporter (the parent's kept lease is not the child's); the child's
    result (how many requests the exporter served for it is told by the
    test)."""
    share = pickle.loads(blob)
    gs.open(share).close()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            inherited = memfd_maps()  # the parent's kept view was unmapped at the fork
            with gs.open(share) as view:
                ok = view._lease[0]._link is not None and get_importer().kept() == 0 and inherited == 0
                os.write(w, pickle.dumps((ok, int(np.asarray(view).reshape(-1).view(np.uint8)[0]))))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.close(r)
    _, status_ = os.waitpid(pid, 0)
    return {"child": pickle.loads(got) if got else None, "exit": os.waitstatus_to_exitcode(status_),
            "kept": get_importer().kept()}


def close_inside_keep(state: dict, blob: bytes) -> dict:
    """Two views of the share; while closing the first keeps it (right
    after the kept views' table was read for its key), the second is
    closed in the same thread, under the connection's re-entrant lock, as
    the garbage collector would close a view caught in a cycle.  The second
    must not be kept: kept there and then overwritten, its lease and
    mapping would never end."""
    import collections

    share = pickle.loads(blob)
    a, b = gs.open(share), gs.open(share)
    ids = (a._lease[0].id, b._lease[0].id)
    link = get_importer()._links[(share.exporter_pid, share.node, share.control)]
    nested: list[bool] = []

    class Collecting(collections.OrderedDict):
        def pop(self, *args: Any) -> Any:
            got = super().pop(*args)
            if not nested:
                nested.append(link.kept.busy)
                b.close()
            return got

    link.kept.entries = Collecting(link.kept.entries)
    a.close()
    kept = [entry[0].id for entry in link.kept.entries.values()]
    with gs.open(share) as again:  # the kept one
        reopened = again._lease[0].id
    return {"busy_inside": nested, "ids": ids, "kept_ids": kept, "reopened": reopened,
            "lease_ids": sorted(link.leases), **status(state)}


HANDLERS: dict[str, Any] = {
    "close_inside_keep": close_inside_keep,
    "open_close": open_close, "try_open": try_open, "status": status, "open_many": open_many,
    "export_revoked": export_revoked, "open_keep_array": open_keep_array,
    "first_byte_of_kept_array": first_byte_of_kept_array, "write_through": write_through, "fork_open": fork_open,
}
