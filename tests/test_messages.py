"""What gpushare says when a peer goes away, and how a view describes itself."""

from __future__ import annotations

import os
import signal

import numpy as np

import gpushare as gs
from gpushare._importer import get_importer

from _procs import Child, wait_for
import _share_peer


def test_a_view_of_a_killed_exporter_says_it_exited_once():
    exporter = Child(_share_peer.setup)
    share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
    view = gs.open(share, exclude=["ucx-rma"])  # cma: the exporter serves each copy
    try:
        assert view.path == "cma"
        pid = exporter.proc.pid
        os.kill(pid, signal.SIGKILL)
        exporter.proc.join(10)
        assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10)
        # This process has seen the connection end (no copy was in flight).
        assert wait_for(lambda: not any(key[0] == pid for key in get_importer()._links), 10)
        errors = []
        for _ in range(2):  # the copy that meets the end of the connection, and the one after it
            try:
                view.get(bytearray(8))
            except gs.GpuShareError as exc:
                errors.append(exc)
        assert len(errors) == 2
        for exc in errors:
            text = str(exc)
            assert type(exc) is gs.ClosedError, repr(exc)  # as for a view whose lease ended
            assert text.count(f"the exporter (pid {pid}) has exited") == 1, text
            assert "closed the connection" not in text, text
    finally:
        view.close()
        exporter.close()


def test_an_open_of_a_killed_exporter_says_it_exited():
    exporter = Child(_share_peer.setup)
    share = exporter.call("export", "numpy", 4096, {"lifetime": "revoked"})
    pid = exporter.proc.pid
    os.kill(pid, signal.SIGKILL)
    exporter.proc.join(10)
    try:
        gs.open(share, timeout=10)
    except gs.ExporterUnreachableError as exc:
        text = str(exc)
    else:
        raise AssertionError("opened a share of a killed exporter")
    finally:
        exporter.close()
    assert text.count("has exited") == 1 and "closed the connection" not in text, text


def test_a_closed_view_says_closed():
    share = gs.export(np.zeros(64, np.uint8), lifetime="revoked")
    try:
        view = gs.open(share)
        assert repr(view) == "<gpushare.View uint8 64 (64 bytes) on host via same-process>"
        view.close()
        assert repr(view) == "<gpushare.View uint8 64 (64 bytes) on host closed>"
    finally:
        share.revoke()
