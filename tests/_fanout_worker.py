"""Tasks for the fan-out tests: run in Pool / ProcessPoolExecutor workers
and plain processes of every start method (shares in tests/test_fanout.py,
objects carried by gpushare.multiprocessing in tests/test_mp.py)."""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

#: The start methods every fan-out test runs under.
METHODS = ["fork", "forkserver", "spawn"]


def digest(a: Any) -> dict:
    """Type, dtype, shape, strides and SHA-256 of the bytes of a NumPy array or a torch CPU tensor."""
    if type(a).__module__.startswith("torch"):
        import torch

        raw = a.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        strides = tuple(a.stride())
    else:
        import numpy as np

        raw = np.ascontiguousarray(a).tobytes()
        strides = tuple(a.strides)
    return {"type": type(a).__name__, "dtype": str(a.dtype), "shape": tuple(a.shape), "strides": strides,
            "sha": hashlib.sha256(raw).hexdigest()}


def describe(obj: Any) -> Any:
    """:func:`digest` of every array of a dict (nested), or of one array."""
    if isinstance(obj, dict):
        return {k: describe(v) for k, v in obj.items()}
    return digest(obj)


def mark(obj: Any, index: int) -> None:
    """Write through what arrived: ``obj["mark"][index] = 100 + index`` and
    ``obj["t"][index] = -1 - index`` (the producer checks it sees them)."""
    obj["mark"][index] = 100 + index
    obj["t"][index] = -1 - index


def consume(inbox: Any, outbox: Any, go: Any, index: int) -> None:
    """Take one message from ``inbox`` (a Queue or a Pipe end), report what
    arrived, write through it, hold it until ``go`` says, then drop it."""
    try:
        obj = inbox.get(timeout=60) if hasattr(inbox, "get") else inbox.recv()
        what = describe(obj)
        mark(obj, index)
        outbox.put({"index": index, "what": what, "requires_grad": getattr(obj.get("p"), "requires_grad", None)})
    except Exception as exc:  # reported to the test, which fails on it
        outbox.put({"index": index, "error": f"{type(exc).__name__}: {exc}"})
        return
    go.get(timeout=60)
    del obj
    outbox.put({"index": index, "dropped": True})


def fds_per_message(inbox: Any, outbox: Any) -> None:
    """Take two messages from ``inbox``, holding each; report this process's
    open file descriptors and threads before, after the first and after the second."""
    import threading

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    counts = [(fds(), threading.active_count())]
    held = []
    for _ in range(2):
        held.append(inbox.get(timeout=60))
        counts.append((fds(), threading.active_count()))
    outbox.put({"counts": counts, "sizes": [len(m) for m in held], "first": float(held[1]["t199"][0])})


def report(obj: Any, outbox: Any) -> None:
    """A Process target: say what came in its arguments, and write through it."""
    outbox.put(describe(obj))
    obj["mark"][7] = 107


def put_and_exit(queue: Any) -> None:
    """A producer that puts a gpushare array on ``queue`` and exits."""
    import numpy as np

    import gpushare as gs

    queue.put({"a": gs.zeros(8, dtype=np.int64)})
    queue.close()
    queue.join_thread()  # the message is in the pipe before this process ends


def installed_here() -> bool:
    """Whether this process has gpushare.multiprocessing's reducers."""
    pickling = sys.modules.get("gpushare._pickling")
    return pickling is not None and pickling.installed()


def task(obj: Any) -> tuple:
    """A Pool or executor task: what arrived, and results of each kind made here."""
    import numpy as np
    import torch

    import gpushare as gs

    made = gs.zeros((4, 2), dtype=np.int32)
    made[:] = 7
    installed = installed_here()
    return describe(obj), {"tensor": torch.arange(6, dtype=torch.float64).reshape(2, 3), "gs": made}, installed


def cuda_consume(inbox: Any, outbox: Any) -> None:
    """Take a dict of a CuPy array ``c`` and a CUDA tensor ``t``, report what
    arrived, and write -1 into the first element of each."""
    try:
        import cupy

        obj = inbox.get(timeout=120)
        c, t = obj["c"], obj["t"]
        report = {"c": (type(c).__name__, type(c).__module__.split(".")[0], str(c.dtype), tuple(c.shape),
                        float(c.sum(dtype=cupy.float64))),
                  "t": (type(t).__name__, t.device.type, str(t.dtype), tuple(t.shape), int(t.sum()))}
        c[0] = -1
        t[0] = -1
        cupy.cuda.runtime.deviceSynchronize()
        outbox.put(report)
    except Exception as exc:  # reported to the test, which fails on it
        outbox.put({"error": f"{type(exc).__name__}: {exc}"})


def die(obj: Any) -> None:
    """A receiver that dies holding what it got."""
    os._exit(3)


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
