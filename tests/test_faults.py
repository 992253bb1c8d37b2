"""Faults with default settings: either side killed (SIGKILL) or frozen
(SIGSTOP), mid-transfer included, ends in a clear error within 5 s; nothing
hangs, and the other side goes on serving."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

import gpushare as gs

from _procs import Child, wait_for
import _share_peer

BOUND = 5.0
COPIED = [pytest.param({}, "cma", id="cma"), pytest.param({"prefer": "ucx-rma"}, "ucx-rma", id="ucx-rma")]
BIG = 256 << 20  # a transfer that takes a while


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped: the
    thread that takes the signal stops the others after it, and until then
    they may still answer a request sent after ``kill`` returned."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/stat", "rb") as f:
                    states.append(f.read().rsplit(b")", 1)[1].split()[0])
        except OSError:
            return False
        return all(state == b"T" for state in states)

    assert wait_for(stopped, BOUND)


def _timed(fn) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.fixture
def stoppable():
    """An exporter process that a test may stop or kill; always resumed and closed."""
    exporter = Child(_share_peer.setup)
    yield exporter
    with contextlib.suppress(ProcessLookupError):
        os.kill(exporter.proc.pid, signal.SIGCONT)
    exporter.close()


def _get_hit_by(view, pid: int, fault: int) -> tuple[BaseException | None, float]:
    """A large get in a thread, and ``fault`` sent to the exporter while it
    runs (or, if the get beat the signal, a get after it): how the get ended."""
    dst = np.empty(view.nbytes, np.uint8)
    errors: list = []
    t = threading.Thread(target=lambda: errors.append(_timed(lambda: view.get(dst))))
    t.start()
    time.sleep(0.02)
    os.kill(pid, fault)
    t.join(BOUND + 5)
    exc, took = errors[0]
    if exc is None:  # the get beat the signal: the next one meets the fault
        exc, took = _timed(lambda: view.get(dst))
    return exc, took


@pytest.mark.parametrize("how, path", COPIED)
def test_a_frozen_exporter_ends_a_wait_with_a_clear_error_then_recovers(stoppable, how, path):
    view = gs.open(stoppable.call("export", "numpy", BIG, {"lifetime": "revoked"}), **how)
    assert view.path == path
    exc, took = _get_hit_by(view, stoppable.proc.pid, signal.SIGSTOP)
    assert isinstance(exc, gs.ExporterUnreachableError), repr(exc)
    assert "stopped by a signal" in str(exc) and took < BOUND, (took, str(exc))
    os.kill(stoppable.proc.pid, signal.SIGCONT)
    out = bytearray(16)
    view.get(out)  # it answers again: the view works
    assert out == bytes(range(16))
    view.close()


@pytest.mark.parametrize("how, path", COPIED)
def test_a_killed_exporter_ends_a_transfer_with_a_clear_error(stoppable, how, path):
    share = stoppable.call("export", "numpy", BIG, {"lifetime": "revoked"})
    view = gs.open(share, **how)
    exc, took = _get_hit_by(view, stoppable.proc.pid, signal.SIGKILL)
    assert isinstance(exc, (gs.ClosedError, gs.UCXError, gs.ExporterUnreachableError)), repr(exc)
    assert took < BOUND and "exporter" in str(exc), (took, str(exc))
    view.close()
    exc, took = _timed(lambda: gs.open(share, **how))
    assert isinstance(exc, gs.ExporterUnreachableError) and "has exited" in str(exc) and took < BOUND


@pytest.mark.parametrize("how, path", COPIED)
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_an_importer_killed_or_frozen_mid_transfer_holds_up_nothing(how, path, fault):
    arr = np.ones(BIG, np.uint8)
    share = gs.export(arr, lifetime="revoked")
    stuck, other = Child(_share_peer.setup), Child(_share_peer.setup)
    try:
        assert stuck.call("open", "v", share, how)["path"] == path
        stuck.conn.send(("get", ("v", 0, BIG)))  # a large get, in flight
        time.sleep(0.02)
        os.kill(stuck.proc.pid, fault)
        start = time.monotonic()
        assert other.call("open", "w", share, how)["path"] == path  # the exporter serves on
        assert other.call("get", "w", 0, 4, timeout=BOUND) == b"\x01" * 4
        assert time.monotonic() - start < BOUND
        other.call("close", "w")
        if fault == signal.SIGKILL:  # its lease ends with its connection
            from gpushare._exporter.registry import registered

            assert wait_for(lambda: registered(share).opens == 0, BOUND)
    finally:
        os.kill(stuck.proc.pid, signal.SIGCONT)
        stuck.proc.kill()
        stuck.proc.join(10)
        other.close()
        share.revoke()


def test_opening_a_share_of_a_frozen_exporter_fails_clearly_within_the_bound():
    exporter = Child(_share_peer.setup)
    try:
        first = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
        second = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
        _stop(exporter.proc.pid)
        exc, took = _timed(lambda: gs.open(first))  # a new connection: its hello is never answered
        assert isinstance(exc, gs.ExporterUnreachableError) and "stopped by a signal" in str(exc), repr(exc)
        assert took < BOUND
        os.kill(exporter.proc.pid, signal.SIGCONT)
        view = gs.open(first)
        _stop(exporter.proc.pid)
        exc, took = _timed(lambda: gs.open(second))  # on the connection the first view holds
        assert isinstance(exc, gs.ExporterUnreachableError) and "stopped by a signal" in str(exc), repr(exc)
        assert took < BOUND
        os.kill(exporter.proc.pid, signal.SIGCONT)
        with gs.open(second) as again:  # answered again: it opens
            again.get(bytearray(4))
        view.close()
    finally:
        os.kill(exporter.proc.pid, signal.SIGCONT)
        exporter.close()


@pytest.mark.parametrize("how, path", COPIED)
def test_an_awaited_transfer_of_a_frozen_exporter_ends_within_the_bound(stoppable, how, path):
    import asyncio

    view = gs.open(stoppable.call("export", "numpy", 4096, {"lifetime": "revoked"}), **how)
    os.kill(stoppable.proc.pid, signal.SIGSTOP)
    exc, took = _timed(lambda: asyncio.run(view.get_async(bytearray(64))))  # timeout=None: no limit of its own
    assert isinstance(exc, gs.ExporterUnreachableError) and took < BOUND, (repr(exc), took)
    os.kill(stoppable.proc.pid, signal.SIGCONT)
    # An await given up on, its loop closed, does not break the connection for the others.
    with pytest.raises(gs.WaitTimeoutError):
        asyncio.run(view.get_async(bytearray(64), timeout=1e-6))
    out = bytearray(8)
    view.get(out)
    assert out == bytes(range(8))
    view.close()
