"""gpushare's UCX side with CUDA memory, run for real between processes
against the CUDA driver stand-in (``tests/cudadriver``).

A contract check, not GPU verification: UCX runs for real (its ``cuda_copy``
transport calls the stand-in as it would call the driver), and the stand-in
enforces what the driver does: allocation needs a current or active
context, and work queued on a stream runs only when something waits for it
(so a copy on UCX's own streams that is not ordered after the producer's
work reads the bytes from before it).  No test process has a CUDA context
current when it calls gpushare.
"""

from __future__ import annotations

import contextlib

import pytest
from _procs import Child
from conftest import standin_children

pytestmark = pytest.mark.cudadriver

MiB = 1 << 20
N = 256 * 1024


@pytest.fixture
def spawn(standin_lib):
    """Start peers on the stand-in (``env`` applied); closed after the test."""
    from _cudadriver_ucx_peer import setup

    with contextlib.ExitStack() as started:

        def start(**env: str | None) -> Child:
            with standin_children(standin_lib, **env):
                return started.enter_context(contextlib.closing(Child(setup, timeout=120)))

        yield start


# -- UCX allocates CUDA memory in a fresh process ------------------------------------


def test_agent_allocates_cuda_memory_with_no_context_current(spawn):
    p = spawn()
    made = p.call("agent_cuda_memory", MiB)
    assert made["before"] is None and made["after"] is None  # nothing was left current
    assert made["memory_type"] == "cuda" and made["size"] >= MiB
    assert made["ordinal"] == 0  # device memory the driver knows, on device 0
    p.call("write_at", made["base"], b"\x5a" * 64)
    assert p.call("read_at", made["base"], 64) == b"\x5a" * 64
    # Freed at close (cuMemFree needs a context: gpushare pushes the device's).
    p.call("close_agent")
    assert p.call("pointer_device", made["base"]) is None


def test_agent_allocates_on_the_callers_current_device_and_leaves_it_current(spawn):
    p = spawn()
    p.call("make_current", 1)
    made = p.call("agent_cuda_memory", MiB)
    assert made["before"] == 1 and made["after"] == 1
    assert made["ordinal"] == 1
    p.call("write_at", made["base"], b"\x21" * 64, 1)
    assert p.call("read_at", made["base"], 64, 1) == b"\x21" * 64
    p.call("close_agent")
    assert p.call("pointer_device", made["base"]) is None


def test_a_peer_reads_cuda_memory_ucx_allocated_in_a_fresh_process(spawn):
    exporter, importer = spawn(), spawn()
    made = exporter.call("agent_cuda_memory", MiB)
    exporter.call("write_at", made["base"], bytes(range(256)) * 4)
    importer.call("agent_connect", made["address"], made["key"])
    importer.call("pending", "dst", 1024, 0, "legacy")
    importer.call("transfer", "agent", "get", "dst", "legacy")
    assert importer.call("dev_read", "dst") == bytes(range(256)) * 4


# -- transfers come after the work queued before them ----------------------------------


def _view_pair(spawn):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", N, 0, None, 0)
    share = exporter.call("export", "buf")
    assert importer.call("open_view", "v", share, {"prefer": ["ucx-rma"]})["path"] == "ucx-rma"
    return exporter, importer


MODES = ["cai", "stream", "dlpack", "legacy"]
# A batch takes no stream=: its buffers name theirs.
VIEW_CASES = [(api, mode) for api in ("view", "view_async", "batch") for mode in MODES
              if not (api == "batch" and mode == "stream")]


@pytest.mark.parametrize("api,mode", VIEW_CASES)
def test_view_put_comes_after_the_producers_work(spawn, api, mode):
    exporter, importer = _view_pair(spawn)
    importer.call("pending", "src", N, 0x5A, "legacy" if mode == "legacy" else "stream")
    assert importer.call("transfer", api, "put", "src", mode, "v") == {"current": None}
    assert exporter.call("read", "buf", 0, N) == b"\x5a" * N


@pytest.mark.parametrize("api,mode", VIEW_CASES)
def test_view_get_comes_after_the_consumers_earlier_work(spawn, api, mode):
    exporter, importer = _view_pair(spawn)
    exporter.call("write", "buf", 0, b"\xc3" * N)
    # The destination's earlier work (a memset) must not land over the bytes got.
    importer.call("pending", "dst", N, 0x11, "legacy" if mode == "legacy" else "stream")
    assert importer.call("transfer", api, "get", "dst", mode, "v") == {"current": None}
    assert importer.call("dev_read_now", "dst") == b"\xc3" * N  # landed when the get returned
    assert importer.call("dev_read", "dst") == b"\xc3" * N


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("mode", ["cai", "stream"])
def test_view_async_transfers_wait_for_the_producer_without_blocking_the_loop(spawn, op, mode):
    exporter, importer = _view_pair(spawn)
    if op == "get":
        exporter.call("write", "buf", 0, b"\xc3" * N)
    importer.call("pending", "mem", N, 0x5A, "stream")
    # The other task ran while the memset was still queued: the transfer
    # awaited it instead of synchronising the stream in the loop's thread.
    assert importer.call("async_transfer_beside", op, "mem", mode, "v") == "pending"
    if op == "put":
        assert exporter.call("read", "buf", 0, N) == b"\x5a" * N
    else:
        assert importer.call("dev_read", "mem") == b"\xc3" * N


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("mode", MODES)
def test_region_server_client_orders_cuda_transfers(spawn, op, mode):
    exporter, importer = spawn(), spawn()
    exporter.call("allocate", "buf", N, 0, None, 0)
    target = exporter.call("serve", "buf")
    where = "legacy" if mode == "legacy" else "stream"
    if op == "put":
        importer.call("pending", "src", N, 0x6B, where)
        importer.call("transfer", "peer", "put", "src", mode, target)
        assert exporter.call("read", "buf", 0, N) == b"\x6b" * N
    else:
        exporter.call("write", "buf", 0, b"\x3c" * N)
        importer.call("pending", "dst", N, 0x11, where)
        importer.call("transfer", "peer", "get", "dst", mode, target)
        assert importer.call("dev_read_now", "dst") == b"\x3c" * N
        assert importer.call("dev_read", "dst") == b"\x3c" * N


@pytest.mark.parametrize("api", ["agent", "agent_batch"])
@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("mode", MODES)
def test_agent_orders_cuda_transfers(spawn, op, mode, api):
    exporter, importer = spawn(), spawn()
    made = exporter.call("agent_cuda_memory", N)
    importer.call("agent_connect", made["address"], made["key"])
    where = "legacy" if mode == "legacy" else "stream"
    if op == "put":
        importer.call("pending", "src", N, 0x77, where)
        assert importer.call("transfer", api, "put", "src", mode) == {"current": None}
        assert exporter.call("read_at", made["base"], N) == b"\x77" * N
    else:
        exporter.call("write_at", made["base"], b"\x4d" * N)
        importer.call("pending", "dst", N, 0x11, where)
        assert importer.call("transfer", api, "get", "dst", mode) == {"current": None}
        assert importer.call("dev_read_now", "dst") == b"\x4d" * N
        assert importer.call("dev_read", "dst") == b"\x4d" * N


def _two_items_on_two_streams(spawn):
    """(exporter, importer, the exporter's agent memory of 2 N bytes): the importer connected,
    with device memory "one" and "two", memsets to 0x21 and 0x22 queued on a stream of each."""
    exporter, importer = spawn(), spawn()
    made = exporter.call("agent_cuda_memory", 2 * N)
    importer.call("agent_connect", made["address"], made["key"])
    importer.call("pending", "one", N, 0x21, "stream")
    importer.call("pending", "two", N, 0x22, "stream")
    return exporter, importer, made


def test_an_agents_batch_follows_the_work_queued_on_each_items_stream(spawn):
    """Two items whose producers' memsets are queued on two streams of their own (each named by
    its array interface): the batch's puts carry both memsets' bytes."""
    exporter, importer, made = _two_items_on_two_streams(spawn)
    importer.call("put_batch_of", ["one", "two"], "cai")
    assert exporter.call("read_at", made["base"], 2 * N) == b"\x21" * N + b"\x22" * N


def test_each_post_of_a_plan_follows_the_work_queued_since_on_each_items_stream(spawn):
    """A plan made once: each post carries the bytes of the memsets queued (not run) on the
    items' streams before that post, made after the plan."""
    exporter, importer, made = _two_items_on_two_streams(spawn)
    importer.call("plan_of", ["one", "two"], "cai")
    importer.call("post_plan")
    assert exporter.call("read_at", made["base"], 2 * N) == b"\x21" * N + b"\x22" * N
    importer.call("requeue", "one", 0x31)
    importer.call("requeue", "two", 0x32)
    importer.call("post_plan")
    assert exporter.call("read_at", made["base"], 2 * N) == b"\x31" * N + b"\x32" * N


def test_an_agents_batch_takes_cuda_memory_of_one_device_only(spawn):
    exporter, importer = spawn(), spawn()
    made = exporter.call("agent_cuda_memory", N)
    importer.call("agent_connect", made["address"], made["key"])
    importer.call("pending_on", "a", 64, 0)
    importer.call("pending_on", "b", 64, 1)
    assert "item 1 is host memory and item 0 cuda memory" in importer.call("batch_refusal", ["a", "host"])
    assert "item 1 is on device 1 and item 0 on device 0" in importer.call("batch_refusal", ["a", "b"])
    assert importer.call("batch_refusal", ["a", "a"]) == "accepted"


# -- UCX_MEMTYPE_CACHE is one setting per process --------------------------------------


def test_memtype_cache_is_set_once_per_process_and_agents_cannot_change_it(spawn):
    p = spawn(UCX_MEMTYPE_CACHE=None)
    got = p.call("memtype_try", "y")
    assert got["before"] in ("n", "no")
    assert got["after"] in ("n", "no")  # every worker of the process still runs without the cache
    assert got["error"] is not None and got["error"].startswith("InvalidInputError")
    assert "per process" in got["error"] and "UCX_MEMTYPE_CACHE" in got["error"]
    assert got["env"] == "n"  # set where gpushare loads UCX, for the process and its children
    same = p.call("memtype_try", "off")  # the process's own value, spelt otherwise, is accepted
    assert same["error"] is None and same["after"] in ("n", "no")


def test_memtype_cache_from_the_environment_wins(spawn):
    got = spawn(UCX_MEMTYPE_CACHE="y").call("memtype_try", "n")
    assert got["env"] == "y" and got["before"] in ("y", "yes")
    assert got["error"] is not None and got["after"] in ("y", "yes")
