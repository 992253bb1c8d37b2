"""Opening, using and closing one ucx-rma share again and again costs no memory.

Two processes: an exporter of one share of host memory, and an importer
that opens it over ucx-rma, reads it and closes the view, thousands of
times.  After a warm-up, neither side's Python heap (tracemalloc), native
tables (the region server's counts) nor resident memory grows with the
number of cycles.

By hand, a longer run: ``python tests/test_ucx_memory.py 20000``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import textwrap

WARM_UP, MEASURED = 2000, 5000
#: Resident memory is measured over this many windows of the measured
#: cycles, and the least growth counts: the allocator takes pages in steps
#: now and then, while what grows with every cycle grows in every window.
WINDOWS = 4
#: Growth allowed per cycle, in bytes.
PER_CYCLE = 16

#: Both sides measure themselves: resident memory, the Python heap when
#: traced (tracemalloc's own tables then grow the resident memory, which is
#: measured in a run without it), and the region server's counts.
_COMMON = """
import gc, json, os, sys, tracemalloc
TRACE = os.environ["MEMORY_TRACE"] == "1"
if TRACE:
    tracemalloc.start()
import numpy as np
import gpushare as gs
from gpushare._ucx import _peer, _server

def measure():
    gc.collect()
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
    traced = tracemalloc.get_traced_memory()[0] if TRACE else 0
    return {"rss": rss, "traced": traced, **_server.server().stats()}
"""

EXPORTER = _COMMON + """
share = gs.export(np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096], lifetime="revoked")
print(share.to_bytes().hex(), flush=True)
for line in sys.stdin:
    if line.strip() != "measure":
        break
    print(json.dumps(measure()), flush=True)
"""

IMPORTER = _COMMON + f"WINDOWS = {WINDOWS}\n" + """
share = gs.Share.from_bytes(bytes.fromhex(sys.stdin.readline()))
warm_up, measured = int(sys.argv[1]), int(sys.argv[2])
buf = np.empty(4096, np.uint8)
expected = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]

def cycles(n):
    for _ in range(n):
        view = gs.open(share, prefer="ucx-rma")
        view.get(buf)
        view.close()
    assert view.path == "ucx-rma" and (buf == expected).all()

cycles(warm_up)
mine, theirs = [], []
for window in range(WINDOWS + 1):
    if window:
        cycles(measured // WINDOWS)
    mine.append(measure())
    print("measure", flush=True)
    theirs.append(json.loads(sys.stdin.readline()))
print(json.dumps({"importer": mine, "exporter": theirs}), flush=True)
"""


def _python(code: str, *args: str, trace: bool) -> subprocess.Popen:
    """A child running ``code``; its stderr goes to a file (read on failure),
    which no amount of warnings fills up."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), GPUSHARE_AUTHKEY="6d656d6f7279" * 4,
               MEMORY_TRACE="1" if trace else "0")
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    proc.errors_file = err
    return proc


def _stderr(proc: subprocess.Popen) -> str:
    proc.errors_file.seek(0)
    return proc.errors_file.read()[-3000:]


def _cycle(warm_up: int, measured: int, trace: bool) -> dict:
    """Run the two processes; the importer relays the exporter's measurements."""
    exporter = _python(EXPORTER, trace=trace)
    importer = _python(IMPORTER, str(warm_up), str(measured), trace=trace)
    try:
        share = exporter.stdout.readline()
        assert share, _stderr(exporter)
        importer.stdin.write(share)
        importer.stdin.flush()
        while True:
            line = importer.stdout.readline()
            assert line, _stderr(importer)
            if line.strip() != "measure":
                break
            exporter.stdin.write("measure\n")
            exporter.stdin.flush()
            importer.stdin.write(exporter.stdout.readline())
            importer.stdin.flush()
        exporter.stdin.write("exit\n")
        exporter.stdin.flush()
        assert importer.wait(60) == 0, _stderr(importer)
        assert exporter.wait(60) == 0, _stderr(exporter)
        return json.loads(line)
    finally:
        for proc in (exporter, importer):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for pipe in (proc.stdin, proc.stdout, proc.errors_file):
                pipe.close()


def _growth(result: dict, measured: int) -> dict[str, dict[str, float]]:
    """Bytes per cycle, by side: of the Python heap over all the measured
    cycles, of resident memory in the window where it grew least."""
    per_window = measured // WINDOWS
    return {side: {"traced": (seen[-1]["traced"] - seen[0]["traced"]) / measured,
                   "rss": min(b["rss"] - a["rss"] for a, b in itertools.pairwise(seen)) / per_window}
            for side, seen in result.items()}


def test_open_get_close_cycles_of_one_ucx_rma_share_leave_no_native_state_behind():
    result = _cycle(WARM_UP, MEASURED, trace=False)
    growth = _growth(result, MEASURED)
    exporter_before, exporter_after = result["exporter"][0], result["exporter"][-1]
    importer_before, importer_after = result["importer"][0], result["importer"][-1]
    # Every transfer was served; no lease is left with a key.
    assert exporter_after["served"] - exporter_before["served"] == MEASURED
    assert exporter_after["keys"] == 0 and exporter_after["regions"] == 0
    # Native tables: nothing remembered of regions that closed with no key
    # left, nothing of regions no view of the importer uses, no transfer left.
    assert exporter_after["closed_regions"] == exporter_before["closed_regions"] == 0, result
    assert importer_after["known_host_regions"] == importer_before["known_host_regions"] == 0, result
    assert importer_after["transfers"] == 0
    for side in ("exporter", "importer"):
        assert growth[side]["rss"] < PER_CYCLE, growth


def test_open_get_close_cycles_of_one_ucx_rma_share_leave_no_python_objects_behind():
    growth = _growth(_cycle(WARM_UP, MEASURED, trace=True), MEASURED)
    for side in ("exporter", "importer"):
        assert growth[side]["traced"] < PER_CYCLE, growth


def test_a_closed_region_is_remembered_until_the_last_key_to_it_is_revoked():
    from gpushare._ucx import _server

    srv = _server.server()
    base = srv.stats()["closed_regions"]
    memory = bytearray(4096)
    region = srv.add_region(memory)
    (_, first), (_, second) = region.grant(), region.grant()
    region.close()
    assert srv.stats()["closed_regions"] == base + 1  # its key holders are told it closed
    assert region.revoke(first) is False
    assert srv.stats()["closed_regions"] == base + 1
    assert region.revoke(second) is False
    assert srv.stats()["closed_regions"] == base
    srv.add_region(memory).close()  # no key to it: forgotten at once
    assert srv.stats()["closed_regions"] == base


def test_a_connection_forgets_what_it_learnt_of_a_region_when_told():
    from gpushare._ucx import _peer, _server

    srv = _server.server()
    peer = _peer.client().connect(srv.address)
    memory = bytearray(4096)
    with srv.add_region(memory) as region:
        region_id, key = region.grant()
        base = srv.stats()["known_host_regions"]
        peer.get(region_id, key, 0, bytearray(16), 10)
        assert srv.stats()["known_host_regions"] == base + 1  # the reply said: host memory
        peer.forget_region(region_id)
        assert srv.stats()["known_host_regions"] == base
        peer.get(region_id, key, 0, bytearray(16), 10)
        assert srv.stats()["known_host_regions"] == base + 1
    peer.close()
    assert srv.stats()["known_host_regions"] == base  # a closed peer's go with it


if __name__ == "__main__":
    # By hand, a longer run: python tests/test_ucx_memory.py [CYCLES]
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    for trace in (False, True):
        outcome = _cycle(WARM_UP, cycles, trace)
        print(json.dumps({"cycles": cycles, "traced": trace, "bytes_per_cycle": _growth(outcome, cycles), **outcome}))
