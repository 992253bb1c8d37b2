"""What one ucx-rma importer may cost the region server (docs/limits.md):
the replies it has not taken stay under a bound, the exporter goes on
serving others, and a peer that goes away gives back what it held.

The exporter, the flooding importer and the other importer are processes
of their own over real UCX (TCP on loopback); the flooder asks batches of
gets and is stopped (SIGSTOP) so that it reads nothing.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import gpushare

from _procs import Child, wait_for
from test_misuse import rss

MiB = 1 << 20
REGION = 8 * MiB
ITEM = 8 * 1024
ITEMS = 4096  # one batch message (the wire's most)
BATCHES = 48  # 1.5 GiB of replies asked
BOUND = 64 * MiB  # kMaxPeerReplyBytes
ALLOWANCE = 4 * MiB  # kBusyReplyBytes: refusals past the bound
COST = 4096  # kReplyCost
# UCX keeps the memory pools a flood made it grow (they are reused, not
# returned to the system): the exporter's memory stays within the bound of
# its baseline, and a second flood reuses what the first left.
RSS_TOLERANCE = 16 * MiB


# ------------------------------------------------------------- the exporter


def _exporter_setup() -> dict:
    from gpushare._ucx import _server

    srv = _server.server()
    arr = np.arange(REGION, dtype=np.uint64).astype(np.uint8)
    region = srv.add_region(arr)
    state: dict[str, Any] = {"server": srv, "arr": arr, "region": region, "_handlers": EXPORTER}
    state["_reply"] = {"address": srv.address, "pid": os.getpid()}
    return state


def _grant(state: dict) -> tuple[int, bytes]:
    return state["region"].grant()


def _load(state: dict) -> dict:
    outstanding, peers, busy, dropped = state["server"]._node.check().reply_load()
    return {"outstanding": outstanding, "peers": peers, "busy": busy, "dropped": dropped,
            "messages": state["server"].stats()["messages"], "rss": rss()}


EXPORTER = {"grant": _grant, "load": _load}


# ------------------------------------------------------------- the importers


def _importer_setup(address: bytes) -> dict:
    from gpushare._ucx import _peer

    peer = _peer.client().connect(address, timeout=30)
    return {"peer": peer, "requests": [], "_handlers": IMPORTER, "_reply": {"pid": os.getpid()}}


def _get(state: dict, cap: tuple[int, bytes], offset: int, n: int) -> bytes:
    out = bytearray(n)
    state["peer"].get(*cap, offset, out, timeout=30)
    return bytes(out)


def _flood(state: dict, cap: tuple[int, bytes], batches: int) -> int:
    """Post ``batches`` batches of ITEMS gets of ITEM bytes each, all into
    one buffer, and return at once (the requests stay under way)."""
    dst = state.setdefault("dst", np.zeros(ITEM, np.uint8))
    for b in range(batches):
        items = [(*cap, ((b * ITEMS + i) * ITEM) % REGION, dst) for i in range(ITEMS)]
        state["requests"].append(state["peer"].get_batch(items))
    return batches


def _outcomes(state: dict) -> list[str]:
    """Wait for every flood request; each one's error, or "ok"."""
    out = []
    for req in state.pop("requests"):
        try:
            req.wait(60)
            out.append("ok")
        except gpushare.GpuShareError as exc:
            out.append(f"{type(exc).__name__}: {getattr(exc, 'status', '')}: {exc}")
    state["requests"] = []
    return out


IMPORTER = {"get": _get, "flood": _flood, "outcomes": _outcomes}


# ------------------------------------------------------------------ helpers


@pytest.fixture
def exporter():
    child = Child(_exporter_setup)
    yield child
    child.close()


def _importer(exporter: Child) -> Child:
    return Child(_importer_setup, exporter.hello["address"])


def _flood_and_stop(exporter: Child, flooder: Child, cap: tuple[int, bytes]) -> dict:
    """Flood, stop the flooder once the exporter refuses it (it is at the
    bound), and return the exporter's load once it stops changing."""
    busy = exporter.call("load")["busy"]
    flooder.call("flood", cap, BATCHES)
    assert wait_for(lambda: exporter.call("load")["busy"] > busy, timeout=30), exporter.call("load")
    os.kill(flooder.proc.pid, signal.SIGSTOP)
    last = exporter.call("load")
    for _ in range(50):
        time.sleep(0.1)
        now = exporter.call("load")
        if now["outstanding"] == last["outstanding"] and now["messages"] == last["messages"]:
            return now
        last = now
    return last


def _limit_error(line: str) -> bool:
    return line.startswith("UCXError: GS_ERR_BUSY") and "64 MiB of replies" in line


# -------------------------------------------------------------------- tests


def test_stopped_flooder_is_bounded_others_served_and_killed_one_gives_back(exporter):
    cap = exporter.call("grant")
    other = _importer(exporter)
    offset = 3 * MiB + 5
    want = bytes((np.arange(offset, offset + 100_000, dtype=np.uint64)).astype(np.uint8))
    assert other.call("get", cap, offset, 100_000) == want
    baseline = exporter.call("load")["rss"]
    after = []
    for _ in range(2):
        flooder = _importer(exporter)
        try:
            flooder.call("get", cap, 0, 4096)
            load = _flood_and_stop(exporter, flooder, cap)
            # It asked far more than the bound and reads nothing now: what
            # the exporter holds for it stays within the bound (plus one
            # reply) and its allowance of refusals.
            assert load["peers"] == 1, load
            assert 0 < load["outstanding"] <= BOUND + ALLOWANCE + COST, load
            assert load["busy"] > 0, load
            assert load["rss"] - baseline < BOUND + ALLOWANCE + RSS_TOLERANCE, (load, baseline)

            # Another importer is served meanwhile.
            assert other.call("get", cap, offset, 100_000) == want

            # The flooder dies: its sends fail with its endpoint, and what
            # they held is given back.
            os.kill(flooder.proc.pid, signal.SIGKILL)
            flooder.proc.join(10)
            assert wait_for(lambda: exporter.call("load")["outstanding"] == 0, timeout=30), exporter.call("load")
            now = exporter.call("load")
            assert now["peers"] == 0, now
            after.append(now["rss"])
            assert other.call("get", cap, offset, 100_000) == want
        finally:
            if flooder.proc.is_alive():
                os.kill(flooder.proc.pid, signal.SIGKILL)
            flooder.close()
    other.close()
    assert after[0] - baseline < BOUND + ALLOWANCE + RSS_TOLERANCE, (after, baseline)
    # The second flood reused what the first gave back.
    assert after[1] - after[0] < RSS_TOLERANCE, (after, baseline)


def test_flooder_past_the_bound_hears_the_limit(exporter):
    cap = exporter.call("grant")
    flooder = _importer(exporter)
    try:
        flooder.call("get", cap, 0, 4096)
        load = _flood_and_stop(exporter, flooder, cap)
        assert load["busy"] > 0, load
        os.kill(flooder.proc.pid, signal.SIGCONT)
        outcomes = flooder.call("outcomes", timeout=120)
        assert len(outcomes) == BATCHES
        refused = [o for o in outcomes if o != "ok"]
        # Batches asked once the bound was reached are refused with the
        # limit's error; none fails any other way.
        assert refused, outcomes
        assert all(_limit_error(o) for o in refused), refused[:3]
        assert wait_for(lambda: exporter.call("load")["outstanding"] == 0, timeout=30)
        # Once it has read its replies, it is served again.
        assert flooder.call("get", cap, 8, 8) == bytes(range(8, 16))
    finally:
        if flooder.proc.is_alive():
            os.kill(flooder.proc.pid, signal.SIGKILL)
        flooder.close()
