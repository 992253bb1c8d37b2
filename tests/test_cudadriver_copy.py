"""gpushare's own cost on a synchronous CUDA copy, against the CUDA driver
stand-in in its timed-copy mode (``GPUSHARE_STANDIN_COPY_GBPS``: a copy takes
its bytes at that bandwidth, measured from when it was queued): a contract
check of the overhead, not GPU verification (``benchmarks/bench_gpu.py``
measures the copies on a GPU).

* Wall time of a ``View.get`` of CUDA memory into CUDA memory, in the steady
  state: at most 1.1x the simulated time plus 20 us (the median of many: a
  2-core CI machine's scheduler is no part of gpushare).
* Driver calls of such a get, from the stand-in's trace: at most three
  (the current context, the copy, the query at the expected time) in the
  typical get; never a context push, an event made or destroyed.
"""

from __future__ import annotations

import collections

import pytest

pytestmark = pytest.mark.cudadriver

N = 1 << 20
GBPS = 0.5
SIMULATED_NS = N / (GBPS * 1e9) * 1e9


@pytest.fixture
def pair(standin_peers):
    from _cudadriver_copy_peer import setup

    def start(**env: str):
        exporter = standin_peers(setup, GPUSHARE_STANDIN_COPY_GBPS=str(GBPS))
        importer = standin_peers(setup, GPUSHARE_STANDIN_COPY_GBPS=str(GBPS), **env)
        exporter.call("allocate", "buf", N, 0, None, 0x5A)
        opened = importer.call("open_view", "v", exporter.call("export", "buf"))
        assert opened["path"] == "posix-fd", opened
        return importer

    return start


def test_a_get_costs_the_copy_and_little_more(pair):
    importer = pair()
    got = importer.call("timed_gets", "v", N, 60)
    assert got["head"] == got["tail"] == b"\x5a" * 16  # the bytes arrived
    bound = 1.1 * SIMULATED_NS + 20_000
    print(f"simulated {SIMULATED_NS / 1e3:.0f} us, median get {got['median_ns'] / 1e3:.0f} us "
          f"({got['median_ns'] / SIMULATED_NS:.3f}x), bound {bound / 1e3:.0f} us")
    assert got["median_ns"] <= bound, sorted(got["walls"])


def test_a_get_makes_three_driver_calls(pair):
    importer = pair(GPUSHARE_STANDIN_TRACE="1")
    gets = importer.call("traced_gets", "v", N, 40)
    counts = collections.Counter(len(calls) for calls in gets)
    typical = collections.Counter(tuple(calls) for calls in gets).most_common(1)[0][0]
    print("calls per get:", dict(counts), "typical:", typical)
    assert typical == ("cuCtxGetCurrent", "cuMemcpyDtoDAsync_v2", "cuStreamQuery"), typical
    assert counts[3] >= len(gets) * 0.6, counts  # a copy found a little late asks once more
    for calls in gets:
        assert not {"cuCtxPushCurrent_v2", "cuEventCreate", "cuEventDestroy_v2"} & set(calls), calls


def test_a_copy_with_memory_of_another_device_runs_there(standin_peers):
    from _cudadriver_copy_peer import setup

    exporter, importer = standin_peers(setup), standin_peers(setup)
    exporter.call("allocate", "buf", N, 0, None, 0x5A)
    importer.call("open_view", "v", exporter.call("export", "buf"))
    seen = importer.call("get_on_device", "v", N, 1)
    assert seen == {"view_device": 0, "got": b"\x5a" * 32, "after_put": b"\x00" * 16}, seen
