"""``gpushare demo``: share a buffer with a second process and say how it went."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from . import _by_descriptor, _export, _open, _paths
from ._cuda import _copies, _driver
from ._errors import GpuShareError

__all__ = ["run_demo"]


def _digest(view_or_buf: Any) -> str:
    import numpy as np

    return hashlib.sha256(np.asarray(view_or_buf).reshape(-1).view(np.uint8)).hexdigest()


def _bar_sender(conn: Any, what: str) -> Callable[[int, int], None]:
    """A copy's ``progress=`` callback that sends the bar's text to the
    parent, at most ten times a second (and at the end)."""
    last = [0.0]

    def sent(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= 0.1:
            last[0] = now
            conn.send({"bar": f"{what}: {done * 100 // max(total, 1):3d}% ({done >> 20} of {total >> 20} MiB)"})

    return sent


def _importer(conn: Any, share: Any, prefer: str | None, repeat: int, bar: bool = False) -> None:
    """The second process: opens the share, copies out and in, reports
    (with ``bar``, each copy's progress too)."""
    import numpy as np

    try:
        with _open.open(share, prefer=prefer) as view:
            conn.send({"progress": f"importer: opened over {view.path}"})
            dst = np.empty(view.nbytes, np.uint8)
            times = []
            for k in range(repeat):
                progress = _bar_sender(conn, f"get {k + 1}/{repeat} over {view.path}") if bar else None
                t0 = time.perf_counter()
                view.get(dst, progress=progress)
                times.append(time.perf_counter() - t0)
                conn.send({"progress": f"importer: get {k + 1}/{repeat}"})
            got = hashlib.sha256(dst).hexdigest()
            src = np.random.default_rng(2).integers(0, 256, view.nbytes, dtype=np.uint8)
            put_times = []
            for k in range(repeat):
                progress = _bar_sender(conn, f"put {k + 1}/{repeat} over {view.path}") if bar else None
                t0 = time.perf_counter()
                view.put(src, progress=progress)
                put_times.append(time.perf_counter() - t0)
                conn.send({"progress": f"importer: put {k + 1}/{repeat}"})
            conn.send({"path": view.path, "why": view.why, "got": got, "put": hashlib.sha256(src).hexdigest(),
                       "get_s": min(times), "put_s": min(put_times)})
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _allocate(size: int) -> tuple[Any, str]:
    """Device memory where a CUDA device is usable, else host memory."""
    reason = _driver.unavailable_reason()
    if reason is None:
        try:
            return _by_descriptor.allocate(size, device=0), "CUDA device 0"
        except GpuShareError as exc:
            reason = str(exc)
    return _by_descriptor.allocate(size, device="host"), f"host memory (no usable GPU: {reason.split(' (')[0]})"


def _device_copy(buf: Any, host: Any, size: int, to_device: bool, what: str) -> None:
    """Copy between the demo's CUDA buffer and host memory in the buffer's
    device context, and wait until the bytes have landed: a blocking copy
    from pageable memory returns once the bytes are staged, before they are
    in device memory where the importer reads them."""
    dev, hst = int(buf.handle), host.ctypes.data
    dst, src = (dev, hst) if to_device else (hst, dev)
    _copies.copy_async(dst, src, size, ordinal=int(buf.device_id), stream=None, producer=None, keep=host,
                     what=what).wait()


def _fill(buf: Any, size: int) -> str:
    import numpy as np

    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    if hasattr(buf, "__array_interface__"):
        np.asarray(buf)[:] = data
    else:  # CUDA memory
        _device_copy(buf, data, size, True, "fill the demo buffer")
    return hashlib.sha256(data).hexdigest()


def _read(buf: Any, size: int) -> str:
    import numpy as np

    if hasattr(buf, "__array_interface__"):
        return hashlib.sha256(np.asarray(buf)).hexdigest()
    out = np.empty(size, np.uint8)
    _device_copy(buf, out, size, False, "read the demo buffer")
    return hashlib.sha256(out).hexdigest()


class _Progress:
    """Progress lines on stderr, once a run has taken more than a second
    (short runs stay quiet), at most one a second."""

    def __init__(self, stream: TextIO | None, after: float = 1.0) -> None:
        self.stream = stream
        self.after = after
        self.start = time.monotonic()
        self.last = self.start - after

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if self.stream is None or now - self.start < self.after or now - self.last < self.after:
            return
        self.last = now
        print(f"[{now - self.start:5.1f} s] {message}", file=self.stream, flush=True)


class _Bar:
    """One line rewritten in place on a terminal: each copy's progress."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.shown = False

    def show(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(f"\r{text}\x1b[K")
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown and self.stream is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def run_demo(size: int = 64 << 20, repeat: int = 5, out: Any = print, *, as_json: bool = False,
             progress: TextIO | None = sys.stderr, progress_after: float = 1.0, bar: TextIO | None = None) -> int:
    """Export ``size`` bytes here, open them in a second process; return an exit code.

    Human-readable lines go to ``out``; with ``as_json`` one JSON object
    instead.  Progress lines go to ``progress`` (stderr) once the run has
    taken ``progress_after`` seconds, then at most one every ``progress_after``
    seconds.  With ``bar`` (the command gives stdout where it is a
    terminal), each copy's progress is one line rewritten in place there,
    cleared before the next output.
    """
    line = _Bar(bar)
    ticked = _Progress(progress, progress_after)

    def tick(message: str) -> None:
        line.clear()
        ticked(message)

    def said(*args: Any) -> None:
        line.clear()
        out(*args)
    report: dict[str, Any] = {"size": size, "repeat": repeat, "runs": []}
    say = (lambda *_: None) if as_json else said
    buf, where = _allocate(size)
    report["memory"] = where
    ctx = mp.get_context("spawn")
    ok = True
    try:
        say(f"exporting {size >> 20} MiB of {where} from process {mp.current_process().pid}")
        network = next(p.name for p in _paths.PATHS if p.network)  # ucx-rma, for comparison
        for prefer in (None, network):
            tick(f"filling {size >> 20} MiB with random bytes")
            digest = _fill(buf, size)
            share = _export.export(buf, lifetime="revoked")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_importer, args=(child, share, prefer, repeat, bar is not None), daemon=True)
            tick("starting the importing process" + (f" (path {prefer})" if prefer else ""))
            proc.start()
            try:
                while True:
                    if not parent.poll(120):
                        return _failed(said, as_json, report, "the importing process did not answer within 120 s")
                    r = parent.recv()
                    if "bar" in r:
                        line.show(str(r["bar"]))
                        continue
                    if "progress" not in r:
                        break
                    tick(str(r["progress"]))
            finally:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
                share.revoke()
            if "error" in r:
                return _failed(said, as_json, report, f"the importer failed: {r['error']}")
            tick("checking the bytes the importer wrote")
            get_ok, put_ok = r["got"] == digest, _read(buf, size) == r["put"]
            run = {"path": r["path"], "why": r["why"], "forced": prefer is not None,
                   "get_gbps": size / r["get_s"] / 1e9, "put_gbps": size / r["put_s"] / 1e9,
                   "get_ok": get_ok, "put_ok": put_ok}
            report["runs"].append(run)
            label = "path" if prefer is None else "for comparison, forced path"
            say(f"{label}: {r['path']}  ({r['why']})")
            say(f"  get: {run['get_gbps']:6.2f} GB/s, bytes match the exporter's: {get_ok}")
            say(f"  put: {run['put_gbps']:6.2f} GB/s, the exporter sees the bytes: {put_ok}")
            ok = ok and get_ok and put_ok
            if r["path"] == network:
                break  # nothing faster to compare with
    finally:
        line.clear()
        buf.close()
    report["passed"] = ok
    if as_json:
        out(json.dumps(report, indent=2))
    else:
        out("demo passed" if ok else "demo FAILED: the data did not match")
    return 0 if ok else 1


def _failed(out: Any, as_json: bool, report: dict[str, Any], error: str) -> int:
    report.update(passed=False, error=error)
    out(json.dumps(report, indent=2) if as_json else error)
    return 1
