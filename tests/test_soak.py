"""10,000 open / get / close cycles over each path between two real
processes: fds, threads and memory stay flat on both sides."""

from __future__ import annotations

import threading
import time

import pytest

from _procs import Child, wait_for
import _share_peer

CYCLES = 10_000
#: Resident memory either side may gain over the cycles (allocator noise).
RSS_SLACK_KIB = 8 * 1024


@pytest.fixture(scope="module")
def pair():
    exporter, importer = Child(_share_peer.setup), Child(_share_peer.setup)
    yield exporter, importer
    importer.close()
    exporter.close()


def _settled(child: Child, key: str = "exporter") -> dict:
    """The child's counters once its idle connections have gone."""
    wait_for(lambda: (child.call("stats").get(key) or {}).get("leases", 0) == 0, 10)
    time.sleep(3)  # idle connections linger 2 s
    return child.call("stats")


@pytest.mark.parametrize("kind, how, path", [("host", {}, "host-fd"), ("numpy", {}, "cma"),
                                             ("numpy", {"prefer": "ucx-rma"}, "ucx-rma")])
def test_ten_thousand_cycles_leave_both_sides_flat(pair, kind, how, path):
    exporter, importer = pair
    share = exporter.call("export", kind, 64 * 1024, {"lifetime": "revoked"})
    assert importer.call("cycle", share, 300, how) == path  # warm: first connection, UCX load, caches
    before = (_settled(exporter), _settled(importer, "importer"))
    assert importer.call("cycle", share, CYCLES, how, timeout=600) == path
    after = (_settled(exporter), _settled(importer, "importer"))
    for side, b, a in zip(("exporter", "importer"), before, after, strict=True):
        assert a["fds"] <= b["fds"], f"{side} fds grew from {b['fds']} to {a['fds']} over {CYCLES} cycles"
        assert a["threads"] <= b["threads"], f"{side} threads grew from {b['threads']} to {a['threads']}"
        assert a["rss_kib"] - b["rss_kib"] < RSS_SLACK_KIB, (
            f"{side} memory grew by {(a['rss_kib'] - b['rss_kib']) / 1024:.1f} MiB over {CYCLES} cycles")
    assert after[0]["exporter"]["leases"] == 0 and after[0]["exporter"]["sessions"] == 0
    assert after[1]["importer"] == {"connections": 0, "leases": 0}


def test_idle_processes_holding_a_hundred_open_shares_use_no_cpu(pair):
    exporter, importer = pair
    shares = {path: [exporter.call("export", kind, 64 * 1024, {"lifetime": "revoked"}) for _ in range(count)]
              for path, kind, count in (("host-fd", "host", 34), ("cma", "numpy", 33), ("ucx-rma", "numpy", 33))}
    for path, group in shares.items():
        assert importer.call("open_many", f"idle-{path}", group, 1, {"prefer": path}) == [path]
    importer.call("cycle", shares["ucx-rma"][0], 1, {"prefer": "ucx-rma"})  # a transfer over UCX first
    time.sleep(3)  # what a closed view leaves closes after a short linger: idle from here on
    used: dict = {}
    threads = [threading.Thread(target=lambda who=who, child=child: used.__setitem__(who, child.call(
        "idle_cpu", 10.0, timeout=60))) for who, child in (("exporter", exporter), ("importer", importer))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert used["exporter"] < 0.010, f"the idle exporter used {used['exporter'] * 1000:.1f} ms of CPU in 10 s"
    assert used["importer"] < 0.010, f"the idle importer used {used['importer'] * 1000:.1f} ms of CPU in 10 s"
    for path in shares:
        importer.call("close_many", f"idle-{path}")
