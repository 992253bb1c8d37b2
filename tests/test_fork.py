"""Fork-safe importers: a forked child holds none of its parent's leases,
never destroys the parent's native objects, and exits quickly however it
exits (sys.exit runs the interpreter's exit handlers), leaving the parent's
views working."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gpushare as gs
from gpushare._exporter.registry import registered

from _procs import Child, wait_for
import _share_peer

COPIED = [pytest.param({}, "cma", id="cma"), pytest.param({"prefer": "ucx-rma"}, "ucx-rma", id="ucx-rma"),
          pytest.param({}, "host-fd", id="host-fd")]

def _program(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` as a program of its own (a fresh interpreter, this
    process's environment and import path), its output captured."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


#: The importer: a program of its own (a forked child's sys.exit runs the
#: interpreter's whole exit there, as in any program).
_IMPORTER = r"""
import json, os, sys, time
import gpushare as gs

share = gs.Share.from_bytes(bytes.fromhex(sys.argv[1]))
how = json.loads(sys.argv[2])
view = gs.open(share, **how)
out = bytearray(8)
view.get(out)
start = time.monotonic()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        view.close()  # a no-op for the parent's lease
        with gs.open(share, **how) as again:  # the child's own connection
            buf = bytearray(8)
            again.get(buf)
            code = 0 if buf == bytes(range(8)) else 4
            if view.path == "ucx-rma" and (again.path != "cma" or "forked from" not in again.why):
                code = 5  # UCX does not survive fork: the child goes over cma and says why
    except BaseException:
        code = 3
    sys.exit(code)  # the interpreter's exit: atexit handlers, finalizers
_, status = os.waitpid(pid, 0)
took = time.monotonic() - start
view.get(out, 8)  # the parent's view, after the child's exit
view.put(b"after", 100)
print(json.dumps({"path": view.path, "child": os.waitstatus_to_exitcode(status), "took": took,
                  "after": list(out)}))
view.close()
"""


@pytest.mark.parametrize("how, path", COPIED)
def test_a_child_that_exits_with_sys_exit_leaves_the_parents_view_working(how, path, monkeypatch):
    key = os.urandom(16).hex()
    monkeypatch.setenv("GPUSHARE_AUTHKEY", key)  # this process and the importer program
    src = gs.empty(64 * 1024, np.uint8) if path == "host-fd" else np.zeros(64 * 1024, np.uint8)
    src[:256] = np.arange(256)
    share = gs.export(src)
    r = _program(_IMPORTER, share.to_bytes().hex(), json.dumps(how))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["path"] == path and got["child"] == 0
    assert got["took"] < 5, f"the forked child took {got['took']:.1f} s to exit"
    assert got["after"] == list(range(8, 16))
    assert bytes(src[100:105]) == b"after"
    export = registered(share)
    assert wait_for(lambda: export.opens == 0)  # the parent's lease and the child's, both ended


def test_a_forked_child_does_not_keep_the_parents_lease_alive():
    arr = np.arange(4096, dtype=np.uint8)
    share = gs.export(arr, lifetime="closed")
    peer = Child(_share_peer.setup)
    try:
        peer.call("open", "v", share)
        export = registered(share)
        assert export.opens == 1
        # The importer forks a child that just lives on, then the importer closes.
        peer.call("fork_sleeper", 30)
        peer.call("close", "v")
        assert wait_for(lambda: export.retired, 5), "the forked child kept the lease"
    finally:
        peer.call("kill_sleepers")
        peer.close()


_AGENT_FORK = r"""
import os, sys, time
import gpushare.ucx as gu

agent = gu.Agent(progress="blocking")
buf = bytearray(4096)
handle = agent.create_memory_handle(len(buf), buf)
peer = gu.Agent(progress="blocking")
ep = peer.connect(agent.address)
start = time.monotonic()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the parent's agents, endpoint and handle die with the child's interpreter
_, status = os.waitpid(pid, 0)
took = time.monotonic() - start
print(os.waitstatus_to_exitcode(status), took, agent.address == agent.address, ep.closed)
"""


def test_a_child_exiting_never_destroys_its_parents_ucx_agents():
    r = _program(_AGENT_FORK)
    assert r.returncode == 0, r.stderr
    code, took, works, closed = r.stdout.split()
    assert code == "0" and float(took) < 5 and works == "True" and closed == "False"
    assert "leaked" not in r.stderr and "terminate" not in r.stderr


#: Forks before any UCX, then both processes start their own: the child's
#: UCX works (the refusal is only for children of a process that started it).
_FORK_FIRST = r"""
import os, sys
import gpushare.ucx as gu

def round_trip():
    a, b = gu.Agent(progress="blocking"), gu.Agent(progress="blocking")
    buf = bytearray(b"fresh ucx" + bytes(55))
    handle = a.create_memory_handle(len(buf), buf)
    ep = b.connect(a.address, timeout=30)
    key = ep.unpack_remote_key(handle.create_remote_key().serialize())
    out = bytearray(9)
    ep.mem_get(out, key.base_address, key).wait(30)
    ep.close(); key.close(); handle.close(); a.close(); b.close()
    return bytes(out)

pid = os.fork()
if pid == 0:
    code = 1
    try:
        code = 0 if round_trip() == b"fresh ucx" else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), round_trip() == b"fresh ucx")
"""


def test_a_child_forked_before_its_parent_used_ucx_starts_ucx():
    r = _program(_FORK_FIRST)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "True"], r.stdout + r.stderr


def test_an_exporter_forked_after_its_parent_started_ucx_refuses_ucx_rma_and_says_why(monkeypatch):
    monkeypatch.setenv("GPUSHARE_AUTHKEY", os.urandom(16).hex())  # this process and the forked exporter
    from gpushare._ucx import _server

    _server.server()  # this process has started UCX (the suite's earlier tests may have too)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked exporter; killed by the parent
        try:
            os.close(r)
            src = np.arange(256, dtype=np.uint8)
            os.write(w, gs.export(src, lifetime="revoked").to_bytes().hex().encode() + b"\n")
            os.close(w)
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r) as pipe:
            share = gs.Share.from_bytes(bytes.fromhex(pipe.readline().strip()))
        assert "ucx-rma" in share.offers
        importer = _program(_ASK_UCX, share.to_bytes().hex())
        assert importer.returncode == 0, importer.stderr
        path, why, refused = importer.stdout.splitlines()
        # ucx-rma asked first, refused by the exporter with the whole reason; cma serves the right bytes
        assert path == "cma 0 1 2 3", importer.stdout
        said = f"exporter cannot serve ucx-rma: UCX cannot start in this process: it was forked from process {os.getpid()}"
        assert said in why and "fork first)" in why, why
        assert refused.startswith("GpuShareError every path failed") and said in refused, refused
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


#: An importer of its own (UCX fresh): asks for ucx-rma first, then with cma excluded.
_ASK_UCX = r"""
import sys
import gpushare as gs
share = gs.Share.from_bytes(bytes.fromhex(sys.argv[1]))
with gs.open(share, prefer="ucx-rma") as view:
    out = bytearray(4)
    view.get(out)
    print(view.path, *out)
    print(view.why)
try:
    gs.open(share, prefer="ucx-rma", exclude="cma")
    print("opened")
except gs.GpuShareError as exc:
    print(type(exc).__name__, exc)
"""
